// The attention rows of `tandem-bench autograd --device cuda`: tandem's tiled
// attention kernels (tensor/cuda/attention.cu) forward and backward against
// PyTorch's scaled_dot_product_attention on its GPU (issue 21's target: at
// least 0.8x the speed of PyTorch's flash attention).
//
// Note [Attention on a GPU]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// - Workload: causal attention of q, k, v (B, H, S, D) and the loss
//   sum(f32(out) * w), made of Note [Autograd benchmark workload]'s values
//   (salts 21-24) on the CPU in f32, rounded to the row's dtype and copied to
//   the device, so both sides start from the same bits. One step is the
//   forward and the backward (dq, dk, dv), each phase ended by synchronising
//   the device.
// - Rows: bf16 against PyTorch's flash kernel (forced with
//   torch.nn.attention.sdpa_kernel; flash takes f16/bf16 only), and f32
//   against the kernel PyTorch picks for f32 (memory-efficient). Target: the
//   step at most 1/0.8 of PyTorch's.
// - Correctness first: the L2 norms of out, dq, dk, dv must agree
//   with PyTorch's within kAttentionRtol (bf16: both sides round P and the
//   gradients to bf16 at different points) before a ratio is reported.
// - Rounds alternate tandem and a PyTorch process as for the block row (Note
//   [Autograd on a GPU]). Without a PyTorch that has CUDA the rows are skipped
//   with the reason, after tandem's own step was measured.
#include <cmath>
#include <exception>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "tandem/autograd/ops.h"
#include "tandem/runtime/device.h"
#include "tools/bench/bench.h"
#include "tools/bench/bench_autograd_baselines.h"
#include "tools/bench/bench_autograd_workload.h"

namespace tandem::bench {
namespace {

using namespace autograd_workload;
using namespace autograd_baselines;
using Json = nlohmann::ordered_json;

constexpr double kAttentionTarget = 0.8;  // tandem's speed / PyTorch's

struct AttentionShape {
  int64_t batch, heads, seq, head_dim;
  std::string str() const { return fmt::format("B{} H{} S{} D{}", batch, heads, seq, head_dim); }
};

AttentionShape attention_shape(bool quick) {
  return quick ? AttentionShape{1, 2, 128, 32} : AttentionShape{4, 16, 2048, 64};
}

Tensor attention_leaf(uint64_t salt, const Shape& shape, DType dtype, Device device) {
  Tensor t = ops::to(ops::to(workload_tensor(salt, shape, 1.0f), dtype), device);
  set_requires_grad(t);
  return t;
}

struct AttentionWorkload {
  AttentionWorkload(const AttentionShape& s, DType dtype, Device device)
      : device(device),
        q(attention_leaf(21, {s.batch, s.heads, s.seq, s.head_dim}, dtype, device)),
        k(attention_leaf(22, {s.batch, s.heads, s.seq, s.head_dim}, dtype, device)),
        v(attention_leaf(23, {s.batch, s.heads, s.seq, s.head_dim}, dtype, device)),
        w(workload_tensor(24, {s.batch, s.heads, s.seq, s.head_dim}, 1.0f, 0.0f, device)) {}
  Device device;
  Tensor q, k, v, w;

  // sum(f32(out) * w); `out` gets the attention output when given.
  Tensor loss(Tensor* out = nullptr) const {
    AttentionOptions causal;
    causal.causal = true;
    Tensor o = to(scaled_dot_product_attention(q, k, v, causal).out, DType::F32);
    if (out != nullptr) *out = o;
    return sum(mul(o, w));
  }
  void step(double& forward_s, double& backward_s) {
    auto t0 = Clock::now();
    Tensor l = loss();
    synchronize(device);
    auto t1 = Clock::now();
    backward(l);
    synchronize(device);
    auto t2 = Clock::now();
    for (Tensor* t : {&q, &k, &v})
      zero_grad(*t);
    forward_s += seconds(t0, t1);
    backward_s += seconds(t1, t2);
  }
  // L2 norms (|out|, |dq|, |dk|, |dv|), as the script's "check": positive
  // sums, well-conditioned where the loss itself may come out near zero.
  std::vector<float> check() {
    Tensor out;
    backward(loss(&out));
    auto norm = [](const Tensor& t) {
      return static_cast<float>(std::sqrt(ops::sum(ops::mul(t, t)).item_double()));
    };
    std::vector<float> values = {norm(out)};
    for (Tensor* t : {&q, &k, &v}) {
      values.push_back(norm(ops::to(grad(*t), DType::F32)));
      zero_grad(*t);
    }
    return values;
  }
};

struct Case {
  DType dtype;
  const char* dtype_name;  // the script's --attention-dtype
  const char* baseline;
  double rtol;
};
const Case kCases[] = {
    {DType::BF16, "bf16", "PyTorch flash SDPA", 2e-2},
    {DType::F32, "f32", "PyTorch SDPA (memory-efficient)", 5e-3},
};

Json run_pytorch_attention(const Baseline& b, const AttentionShape& s, const Case& c, int trials,
                           double min_trial_s) {
  const std::string out = run_command(fmt::format(
      "env {} {} --device cuda --attention {} --attention-shape {},{},{},{} --block-trials {} "
      "--min-trial-ms {}",
      b.env, b.command, c.dtype_name, s.batch, s.heads, s.seq, s.head_dim, trials,
      min_trial_s * 1e3));
  Json j = Json::parse(out, nullptr, false);
  TANDEM_CHECK(!j.is_discarded() && j.is_object(),
               "[bench::autograd] expected one JSON object from {} --attention, got: {}", b.name,
               out.substr(0, 200));
  return j;
}

void bench_case(Report& report, const Options& options, const Case& c,
                const std::optional<Baseline>& pytorch, const std::string& why) {
  const AttentionShape shape = attention_shape(options.quick);
  const int rounds = options.quick ? 2 : 5, trials = options.quick ? 3 : 7;
  const double min_trial_s = options.quick ? 0.01 : 0.02;
  const Device device = Device::cuda(0);
  Row row;
  row.group = "attention";
  row.name = fmt::format("fwd+bwd {} causal {}", shape.str(), c.dtype_name);
  row.device = device.str();
  row.threads = 0;  // a GPU row
  row.baseline = c.baseline;
  row.target = kAttentionTarget;
  // Forward 2 GEMMs, backward 5 (with the recomputed scores), halved by the mask.
  row.flops = 7.0 * 2 * shape.batch * shape.heads * shape.seq * shape.seq * shape.head_dim / 2;
  if (!report.wants(row)) return;
  AttentionWorkload work(shape, c.dtype, device);
  const std::vector<float> got = work.check();
  std::vector<StepTimes> tandem_rounds;
  std::vector<Json> runs;
  std::string error;
  for (int round = 0; round < rounds; ++round) {
    auto run_tandem = [&] {
      tandem_rounds.push_back(
          measure([&](double& f, double& b) { work.step(f, b); }, trials, min_trial_s));
    };
    auto run_pytorch = [&] {
      if (!pytorch || !error.empty()) return;
      try {
        runs.push_back(run_pytorch_attention(*pytorch, shape, c, trials, min_trial_s));
      } catch (const std::exception& e) {
        error = e.what();
      }
    };
    if (round % 2 == 0) {
      run_tandem();
      run_pytorch();
    } else {
      run_pytorch();
      run_tandem();
    }
  }
  std::vector<double> t;
  for (const StepTimes& r : tandem_rounds)
    t.push_back(r.total_s);
  Json entry = {{"dtype", c.dtype_name},
                {"shape", shape.str()},
                {"tandem_check", got},
                {"tandem_step_ms", median_of(t) * 1e3}};
  if (!pytorch) {
    row.skipped = "PyTorch baseline not run: " + why;
  } else if (!error.empty()) {
    row.error = pytorch->name + " --attention run failed: " + error;
  } else {
    const std::vector<float> want = json_floats(runs.front().at("check"));
    const std::string m = compare(got, want, c.rtol, 1e-5);
    entry["pytorch_check"] = want;
    entry["pytorch_backend"] = runs.front().value("backend", "");
    entry["runs"] = runs;
    if (!m.empty()) {
      row.error = fmt::format("tandem against {} (|out|, |dq|, |dk|, |dv|): {}", c.baseline, m);
    } else {
      std::vector<double> b, ratios;
      for (size_t r = 0; r < tandem_rounds.size() && r < runs.size(); ++r) {
        b.push_back(runs[r].at("step").at("median_ms").get<double>() * 1e-3);
        ratios.push_back(b.back() / t[r]);
      }
      row.timing = {timing_over_rounds(t, tandem_rounds.front().reps), timing_over_rounds(b, 1),
                    median_of(ratios)};
      entry["pytorch_step_ms"] = median_of(b) * 1e3;
      entry["ratio"] = row.timing.ratio;
    }
  }
  report.set(fmt::format("attention_{}", c.dtype_name), std::move(entry),
             fmt::format("\nattention {} {} on {}: tandem {:.3f} ms per step", shape.str(),
                         c.dtype_name, device.str(), median_of(t) * 1e3));
  report.add(std::move(row));
}

}  // namespace

void bench_attention_cuda(Report& report, const Options& options) {
  std::string why;
  const std::optional<Baseline> pytorch = find_pytorch(why, /*cuda=*/true);
  for (const Case& c : kCases) {
    try {
      bench_case(report, options, c, pytorch, why);
    } catch (const std::exception& e) {  // a tandem op failing on the device
      Row row;
      row.group = "attention";
      row.name = fmt::format("fwd+bwd {}", c.dtype_name);
      row.device = Device::cuda(0).str();
      row.threads = 0;
      row.baseline = c.baseline;
      row.target = kAttentionTarget;
      row.error = e.what();
      report.add(std::move(row));
    }
  }
}

}  // namespace tandem::bench
