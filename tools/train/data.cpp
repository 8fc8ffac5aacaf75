#include "tools/train/data.h"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <numeric>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

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

// ---- token files (Note [Token files]) ----

namespace {
constexpr int32_t kTokenMagic = 20240520;
constexpr size_t kHeaderBytes = 256 * sizeof(int32_t);
}  // namespace

TokenFile::TokenFile(const std::string& path) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TANDEM_CHECK(fd >= 0, "[train::tokens] cannot open '{}': {}", path, std::strerror(errno));
  struct stat st {};
  const bool stat_ok = ::fstat(fd, &st) == 0;
  map_bytes_ = stat_ok ? static_cast<size_t>(st.st_size) : 0;
  if (map_bytes_ > 0) {
    map_ = ::mmap(nullptr, map_bytes_, PROT_READ, MAP_SHARED, fd, 0);
    if (map_ == MAP_FAILED) map_ = nullptr;
  }
  ::close(fd);
  TANDEM_CHECK(stat_ok && map_ != nullptr,
               "[train::tokens] cannot map '{}' ({} bytes): expected a non-empty token file", path,
               map_bytes_);
  const auto* bytes = static_cast<const uint8_t*>(map_);
  int32_t header[3] = {0, 0, 0};
  if (map_bytes_ >= kHeaderBytes) std::memcpy(header, bytes, sizeof(header));
  if (header[0] == kTokenMagic) {
    header_ = true;
    TANDEM_CHECK(header[1] == 1 || header[1] == 2,
                 "[train::tokens] '{}': expected header version 1 (uint16 tokens) or 2 (uint32), "
                 "got {}",
                 path, header[1]);
    width_ = header[1] == 1 ? 2 : 4;
    count_ = header[2];
    const size_t want = kHeaderBytes + static_cast<size_t>(count_) * static_cast<size_t>(width_);
    TANDEM_CHECK(count_ >= 0 && want == map_bytes_,
                 "[train::tokens] '{}': the header announces {} tokens of {} bytes ({} bytes with "
                 "the header), the file has {} bytes",
                 path, count_, width_, want, map_bytes_);
    tokens_ = bytes + kHeaderBytes;
  } else {
    TANDEM_CHECK(map_bytes_ % 2 == 0,
                 "[train::tokens] '{}': no llm.c header, so expected bare uint16 tokens (an even "
                 "byte count), got {} bytes",
                 path, map_bytes_);
    width_ = 2;
    count_ = static_cast<int64_t>(map_bytes_ / 2);
    tokens_ = bytes;
  }
}

TokenFile::~TokenFile() {
  if (map_ != nullptr) ::munmap(map_, map_bytes_);
}

int64_t TokenFile::operator[](int64_t i) const {
  if (width_ == 2) {
    uint16_t v;
    std::memcpy(&v, tokens_ + 2 * i, 2);
    return v;
  }
  uint32_t v;
  std::memcpy(&v, tokens_ + 4 * i, 4);
  return v;
}

void write_token_file(const std::string& path, const std::vector<int64_t>& tokens) {
  const int64_t top = tokens.empty() ? 0 : *std::max_element(tokens.begin(), tokens.end());
  const int64_t low = tokens.empty() ? 0 : *std::min_element(tokens.begin(), tokens.end());
  TANDEM_CHECK(low >= 0 && top <= 0xffffffffll,
               "[train::tokens] expected token ids in [0, 2^32), got [{}, {}]", low, top);
  const bool narrow = top <= 0xffff;
  std::vector<int32_t> header(256, 0);
  header[0] = kTokenMagic;
  header[1] = narrow ? 1 : 2;
  header[2] = static_cast<int32_t>(tokens.size());
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(header.data()), kHeaderBytes);
  for (int64_t t : tokens) {
    if (narrow) {
      const auto v = static_cast<uint16_t>(t);
      out.write(reinterpret_cast<const char*>(&v), 2);
    } else {
      const auto v = static_cast<uint32_t>(t);
      out.write(reinterpret_cast<const char*>(&v), 4);
    }
  }
  TANDEM_CHECK(out.good(), "[train::tokens] cannot write '{}'", path);
}

TokenTask::TokenTask(const std::string& path, int64_t seq_len, int64_t vocab)
    : file_(std::make_shared<TokenFile>(path)), seq_len_(seq_len), vocab_(vocab) {
  TANDEM_CHECK(seq_len > 0 && vocab > 0,
               "[train::tokens] expected a positive sequence length and vocab, got {} and {}",
               seq_len, vocab);
  TANDEM_CHECK(file_->size() > seq_len,
               "[train::tokens] '{}' holds {} tokens; expected more than the sequence length {}",
               path, file_->size(), seq_len);
}

std::string TokenTask::describe() const {
  return fmt::format("tokens of '{}' ({} tokens, uint{}{}), windows of {}", file_->path(),
                     file_->size(), 8 * file_->bytes_per_token(),
                     file_->has_header() ? ", llm.c header" : "", seq_len_);
}

Batch TokenTask::sample(uint64_t seed, int64_t step, int micro_batch, int data_rank,
                        int64_t batch) const {
  const int64_t S = seq_len_;
  const int64_t starts = file_->size() - S;  // windows of S + 1 tokens
  std::vector<int64_t> tokens(static_cast<size_t>(batch * S));
  std::vector<int64_t> targets(tokens.size());
  for (int64_t b = 0; b < batch; ++b) {
    // Window g of the micro-batch's global batch (Note [Token files]).
    const int64_t g = static_cast<int64_t>(data_rank) * batch + b;
    const int64_t start = batch_rng(seed, step, micro_batch, static_cast<int>(g)).below(starts);
    for (int64_t i = 0; i <= S; ++i) {
      const int64_t t = (*file_)[start + i];
      TANDEM_CHECK(t < vocab_,
                   "[train::tokens] '{}': token {} at position {} is outside the model's vocab "
                   "of {}",
                   file_->path(), t, start + i, vocab_);
      if (i < S) tokens[b * S + i] = t;
      if (i > 0) targets[b * S + i - 1] = t;
    }
  }
  return make_batch(std::move(tokens), std::move(targets), batch, S);
}

}  // namespace tandem::train
