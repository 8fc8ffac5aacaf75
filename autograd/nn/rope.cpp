#include "tandem/autograd/nn/rope.h"

#include <cmath>
#include <mutex>
#include <numbers>

#include "tandem/autograd/functions/node_name.h"
#include "tandem/autograd/node.h"
#include "tandem/autograd/ops.h"
#include "tandem/runtime/error.h"
#include "tandem/tensor/dtype.h"
#include "tandem/tensor/ops.h"

namespace tandem::nn {

std::vector<double> rope_inv_freq(const RotaryOptions& options) {
  const int64_t d = options.head_dim;
  TANDEM_CHECK(d > 0 && d % 2 == 0, "[nn::rope] expected a positive even head_dim, got {}", d);
  TANDEM_CHECK(options.theta > 0 && std::isfinite(options.theta),
               "[nn::rope] expected a positive finite theta, got {}", options.theta);
  std::vector<double> inv(static_cast<size_t>(d / 2));
  for (int64_t i = 0; i < d / 2; ++i)
    inv[i] = 1.0 / std::pow(options.theta, static_cast<double>(2 * i) / static_cast<double>(d));
  if (!options.llama3) return inv;
  const Llama3Scaling& s = *options.llama3;
  TANDEM_CHECK(s.factor > 0 && s.low_freq_factor > 0 && s.high_freq_factor > s.low_freq_factor &&
                   s.original_max_position_embeddings > 0,
               "[nn::rope] expected llama3 scaling with factor > 0, 0 < low_freq_factor < "
               "high_freq_factor and original_max_position_embeddings > 0, got factor {}, "
               "low_freq_factor {}, high_freq_factor {}, original_max_position_embeddings {}",
               s.factor, s.low_freq_factor, s.high_freq_factor, s.original_max_position_embeddings);
  const auto context = static_cast<double>(s.original_max_position_embeddings);
  const double low_wavelen = context / s.low_freq_factor;    // longer: stretched
  const double high_wavelen = context / s.high_freq_factor;  // shorter: kept
  for (double& f : inv) {
    const double wavelen = 2 * std::numbers::pi / f;
    if (wavelen > low_wavelen) {
      f /= s.factor;
    } else if (wavelen >= high_wavelen) {
      const double smooth =
          (context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
      f = (1 - smooth) * f / s.factor + smooth * f;
    }
  }
  return inv;
}

std::pair<Tensor, Tensor> rope_tables(const RotaryOptions& options,
                                      const std::vector<int64_t>& positions, DType dtype,
                                      Device device) {
  const std::vector<double> inv = rope_inv_freq(options);
  TANDEM_CHECK(is_floating(dtype), "[nn::rope] expected a floating dtype for the tables, got {}",
               dtype_name(dtype));
  const int64_t d = options.head_dim, n = static_cast<int64_t>(positions.size());
  std::vector<double> cos(static_cast<size_t>(n * d)), sin(cos.size());
  for (int64_t p = 0; p < n; ++p) {
    TANDEM_CHECK(positions[p] >= 0,
                 "[nn::rope] expected non-negative positions, got {} at index {}", positions[p], p);
    for (int64_t i = 0; i < d / 2; ++i) {
      const double angle = static_cast<double>(positions[p]) * inv[i];
      cos[p * d + i] = cos[p * d + i + d / 2] = std::cos(angle);
      sin[p * d + i] = sin[p * d + i + d / 2] = std::sin(angle);
    }
  }
  auto table = [&](const std::vector<double>& v) {
    return ops::to(ops::to(ops::from_vector(v, Shape{n, d}), dtype), device);
  };
  return {table(cos), table(sin)};
}

namespace {
struct RotaryBackward final : Node {
  TANDEM_NODE_NAME(RotaryBackward)
  Tensor cos, sin;
  int64_t seq_dim = 1;
  std::vector<Tensor> apply(std::vector<Tensor>& g) override {
    return {ops::rotary(g[0], cos, sin, seq_dim, /*inverse=*/true)};
  }
  void release_saved() override { cos = sin = Tensor(); }
};
}  // namespace

Tensor apply_rotary(const Tensor& x, const Tensor& cos, const Tensor& sin, int64_t seq_dim) {
  TANDEM_CHECK(x.defined() && x.dim() == 4 && (seq_dim == 1 || seq_dim == 2),
               "[nn::apply_rotary] expected x of 4 dims, (B, S, H, D) with seq_dim 1 or (B, H, S, "
               "D) with seq_dim 2, got {} with seq_dim {}",
               x.defined() ? fmt::format("{}", x.shape()) : std::string("an undefined tensor"),
               seq_dim);
  const int64_t s = x.shape()[static_cast<int>(seq_dim)], d = x.shape()[3];
  const Shape table{s, d};
  TANDEM_CHECK(cos.defined() && sin.defined() && cos.shape() == table && sin.shape() == table,
               "[nn::apply_rotary] expected cos and sin tables of shape {} for x of shape {}, got "
               "{} and {}",
               table, x.shape(), cos.defined() ? fmt::format("{}", cos.shape()) : "undefined",
               sin.defined() ? fmt::format("{}", sin.shape()) : "undefined");
  TANDEM_CHECK(d % 2 == 0, "[nn::apply_rotary] expected an even head dim, got {}", d);
  TANDEM_CHECK(
      cos.dtype() == x.dtype() && sin.dtype() == x.dtype() && cos.device() == x.device() &&
          sin.device() == x.device(),
      "[nn::apply_rotary] expected tables of x's dtype and device ({} on {}), got {} on {}",
      dtype_name(x.dtype()), x.device(), dtype_name(cos.dtype()), cos.device());
  TANDEM_CHECK(!requires_grad(cos) && !requires_grad(sin),
               "[nn::apply_rotary] expected cos and sin tables that do not require grad (the "
               "rotation is differentiable in x only)");
  // One kernel each way (Note [Fused rotary embedding]); backward keeps the
  // tables only.
  Tensor out = ops::rotary(x, cos, sin, seq_dim);
  if (auto node = record<RotaryBackward>({&x}, {&out})) {
    node->cos = cos;
    node->sin = sin;
    node->seq_dim = seq_dim;
  }
  return out;
}

// The tables a scope's forwards computed, for each (options, dtype, device):
// the forward and backward workers (and checkpoint re-runs) may share a
// scope, hence the lock.
struct PositionScope::Data {
  struct Tables {
    RotaryOptions options;
    DType dtype;
    Device device;
    std::pair<Tensor, Tensor> cos_sin;
  };
  std::vector<int64_t> positions;
  std::mutex mutex;
  std::vector<Tables> tables;
};

namespace {
const char kPositionsKey = 0;  // PositionScope's per-call data

std::shared_ptr<PositionScope::Data> scope_data() {
  // Only PositionScope stores under the key, and always a Data.
  return std::const_pointer_cast<PositionScope::Data>(
      std::static_pointer_cast<const PositionScope::Data>(find_call_data(&kPositionsKey)));
}

bool same_options(const RotaryOptions& a, const RotaryOptions& b) {
  if (a.head_dim != b.head_dim || a.theta != b.theta ||
      a.llama3.has_value() != b.llama3.has_value())
    return false;
  if (!a.llama3) return true;
  const Llama3Scaling &x = *a.llama3, &y = *b.llama3;
  return x.factor == y.factor && x.low_freq_factor == y.low_freq_factor &&
         x.high_freq_factor == y.high_freq_factor &&
         x.original_max_position_embeddings == y.original_max_position_embeddings;
}
}  // namespace

PositionScope::PositionScope(std::vector<int64_t> positions)
    : scope_(&kPositionsKey, [&] {
        auto data = std::make_shared<Data>();
        data->positions = std::move(positions);
        return data;
      }()) {}

std::shared_ptr<const std::vector<int64_t>> scoped_positions() {
  std::shared_ptr<PositionScope::Data> data = scope_data();
  if (!data) return nullptr;
  return {data, &data->positions};  // aliasing: keeps the scope's data alive
}

std::vector<int64_t> local_positions(int64_t length, const char* who) {
  std::shared_ptr<const std::vector<int64_t>> scoped = scoped_positions();
  if (!scoped) return position_range(0, length);
  TANDEM_CHECK(static_cast<int64_t>(scoped->size()) == length,
               "[{}] expected the PositionScope to hold the {} positions of the local sequence, "
               "got {}",
               who, length, scoped->size());
  return *scoped;
}

std::pair<Tensor, Tensor> rotary_tables(const RotaryOptions& options, int64_t length, DType dtype,
                                        Device device, const char* who) {
  std::shared_ptr<PositionScope::Data> data = scope_data();
  if (!data) return rope_tables(options, position_range(0, length), dtype, device);
  const std::vector<int64_t> positions = local_positions(length, who);  // checks the length
  std::lock_guard<std::mutex> lock(data->mutex);
  for (const PositionScope::Data::Tables& t : data->tables) {
    if (same_options(t.options, options) && t.dtype == dtype && t.device == device)
      return t.cos_sin;
  }
  data->tables.push_back({options, dtype, device, rope_tables(options, positions, dtype, device)});
  return data->tables.back().cos_sin;
}

std::vector<int64_t> position_range(int64_t start, int64_t length) {
  TANDEM_CHECK(start >= 0 && length >= 0,
               "[nn::position_range] expected a non-negative start and length, got {} and {}",
               start, length);
  std::vector<int64_t> out(static_cast<size_t>(length));
  for (int64_t i = 0; i < length; ++i)
    out[i] = start + i;
  return out;
}

}  // namespace tandem::nn
