#include "tools/train/data.h"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <numeric>

#include "tandem/runtime/error.h"
#include "tandem/tensor/ops.h"

namespace tandem::train {

namespace {

// SplitMix64: a tiny counter-based generator, enough to draw batches as a
// pure function of their coordinates (Note [Deterministic batches]).
class Rng {
 public:
  explicit Rng(uint64_t state) : state_(state) {}
  uint64_t next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  // Uniform in [0, n) (n small: the modulo bias is far below 1e-9).
  int64_t below(int64_t n) { return static_cast<int64_t>(next() % static_cast<uint64_t>(n)); }

 private:
  uint64_t state_;
};

Rng batch_rng(uint64_t seed, int64_t step, int micro_batch, int data_rank) {
  Rng mix(seed);
  uint64_t s = mix.next();
  for (uint64_t v : {static_cast<uint64_t>(step), static_cast<uint64_t>(micro_batch),
                     static_cast<uint64_t>(data_rank)}) {
    Rng r(s ^ (v * 0xd1b54a32d192ed03ULL));
    s = r.next();
  }
  return Rng(s);
}

Batch make_batch(std::vector<int64_t> tokens, std::vector<int64_t> targets, int64_t batch,
                 int64_t seq) {
  Batch b;
  b.tokens = ops::from_vector(tokens, Shape{batch, seq});
  b.targets = ops::from_vector(targets, Shape{batch, seq});
  return b;
}

}  // namespace

RecallTask::RecallTask(const RecallConfig& config) : config_(config) {
  TANDEM_CHECK(config.keys > 0 && config.values > 0 && config.pairs > 0 && config.queries > 0,
               "[train::RecallTask] expected positive keys, values, pairs and queries, got {}, "
               "{}, {}, {}",
               config.keys, config.values, config.pairs, config.queries);
  TANDEM_CHECK(config.pairs <= config.keys,
               "[train::RecallTask] expected at most as many pairs as keys ({}), got {} pairs",
               config.keys, config.pairs);
}

std::string RecallTask::describe() const {
  return fmt::format(
      "associative recall: {} key:value bindings then {} queries, sequence {} tokens, vocabulary "
      "{} (chance accuracy {:.1f}%)",
      config_.pairs, config_.queries, seq_len(), vocab(), 100.0 * chance_accuracy());
}

Batch RecallTask::sample(uint64_t seed, int64_t step, int micro_batch, int data_rank,
                         int64_t batch) const {
  const int64_t S = seq_len(), n = config_.pairs, V = config_.values;
  const int64_t first_query = config_.keys * V, first_answer = first_query + config_.keys;
  std::vector<int64_t> tokens(static_cast<size_t>(batch * S));
  std::vector<int64_t> targets(tokens.size(), kIgnore);
  Rng rng = batch_rng(seed, step, micro_batch, data_rank);
  std::vector<int64_t> keys(static_cast<size_t>(config_.keys));
  std::vector<int64_t> values(static_cast<size_t>(n));
  for (int64_t b = 0; b < batch; ++b) {
    int64_t* t = tokens.data() + b * S;
    int64_t* y = targets.data() + b * S;
    // n distinct keys: a partial Fisher-Yates shuffle.
    std::iota(keys.begin(), keys.end(), 0);
    for (int64_t i = 0; i < n; ++i)
      std::swap(keys[i], keys[i + rng.below(config_.keys - i)]);
    for (int64_t i = 0; i < n; ++i) {
      values[i] = rng.below(V);
      t[i] = keys[i] * V + values[i];
    }
    for (int64_t j = 0; j < config_.queries; ++j) {
      const int64_t pick = rng.below(n);
      t[n + j] = first_query + keys[pick];
      y[n + j] = first_answer + values[pick];
    }
  }
  return make_batch(std::move(tokens), std::move(targets), batch, S);
}

TextTask::TextTask(const std::string& path, int64_t seq_len) : path_(path), seq_len_(seq_len) {
  TANDEM_CHECK(seq_len > 0, "[train::TextTask] expected a positive sequence length, got {}",
               seq_len);
  std::error_code ec;
  TANDEM_CHECK(std::filesystem::exists(path, ec),
               "[train::TextTask] cannot open the data file '{}': it does not exist", path);
  TANDEM_CHECK(std::filesystem::is_regular_file(path, ec),
               "[train::TextTask] expected the data file '{}' to be a regular file, got another "
               "kind (a directory, device or pipe)",
               path);
  std::ifstream in(path, std::ios::binary);
  TANDEM_CHECK(in.good(), "[train::TextTask] cannot open the data file '{}': {}", path,
               std::strerror(errno));
  bytes_.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  TANDEM_CHECK(!in.bad(), "[train::TextTask] error reading the data file '{}'", path);
  TANDEM_CHECK(static_cast<int64_t>(bytes_.size()) > seq_len,
               "[train::TextTask] expected a data file of more than {} bytes (the sequence length "
               "+ 1), '{}' has {}",
               seq_len, path, bytes_.size());
}

std::string TextTask::describe() const {
  return fmt::format("byte-level language model on '{}' ({} bytes), sequence {} bytes", path_,
                     bytes_.size(), seq_len_);
}

Batch TextTask::sample(uint64_t seed, int64_t step, int micro_batch, int data_rank,
                       int64_t batch) const {
  const int64_t S = seq_len_;
  const int64_t starts = static_cast<int64_t>(bytes_.size()) - S;  // windows of S + 1 bytes
  std::vector<int64_t> tokens(static_cast<size_t>(batch * S));
  std::vector<int64_t> targets(tokens.size());
  Rng rng = batch_rng(seed, step, micro_batch, data_rank);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t start = rng.below(starts);
    for (int64_t i = 0; i < S; ++i) {
      tokens[b * S + i] = bytes_[start + i];
      targets[b * S + i] = bytes_[start + i + 1];
    }
  }
  return make_batch(std::move(tokens), std::move(targets), batch, S);
}

}  // namespace tandem::train
