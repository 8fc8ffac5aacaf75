// The training data of tandem-train: an embedded synthetic long-context task
// (associative recall) or the bytes of any text file.
//
// Note [Deterministic batches]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A batch is a pure function of (seed, step, micro-batch, data rank): no
// sampler state advances between steps. So a run resumed from a checkpoint at
// step s sees exactly the batches an uninterrupted run sees from step s on,
// and a checkpoint needs no data-loader state. The data rank numbers the
// replicas that see different sequences (the dp × ep ranks); the cp and tp
// ranks of one data rank draw the same whole sequences and keep their part.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tandem/tensor/tensor.h"

namespace tandem::train {

// tokens (B, S) i64; targets (B, S) i64: the next token where the position is
// scored, kIgnore elsewhere.
struct Batch {
  Tensor tokens;
  Tensor targets;
};

constexpr int64_t kIgnore = -100;

class Task {
 public:
  virtual ~Task() = default;
  virtual int64_t vocab() const = 0;
  virtual int64_t seq_len() const = 0;
  virtual std::string describe() const = 0;
  // Accuracy of guessing (for the progress line): what "learned" is measured against.
  virtual double chance_accuracy() const = 0;
  // Scored positions per sequence (the same for every sequence).
  virtual int64_t scored_per_sequence() const = 0;
  virtual Batch sample(uint64_t seed, int64_t step, int micro_batch, int data_rank,
                       int64_t batch) const = 0;
};

// Associative recall: `pairs` context tokens, each binding a key to a value,
// then `queries` keys whose values are to be recalled:
//
//   [k1:v1] [k2:v2] … [kn:vn]  q1 q2 … qm          S = n + m
//
// The n keys of a sequence are distinct and drawn anew for every sequence,
// values are random; tokens [0, keys·values) are the bindings [k:v] = k·values
// + v, then `keys` query tokens, then `values` answer tokens (the targets).
// The prediction at each query position is scored: it must attend back over
// the whole sequence to the one binding of its key, so it tests that context
// parallelism gives every position the whole context. (With key and value as
// separate adjacent tokens the task needs an induction head, which a small
// model finds only after thousands of steps; bound pairs make it learnable in
// a few hundred, on 2 cores in about a minute.)
struct RecallConfig {
  int64_t keys = 32;
  int64_t values = 16;
  int64_t pairs = 24;
  int64_t queries = 40;
};

class RecallTask final : public Task {
 public:
  explicit RecallTask(const RecallConfig& config);
  int64_t vocab() const override { return (config_.keys + 1) * config_.values + config_.keys; }
  int64_t seq_len() const override { return config_.pairs + config_.queries; }
  std::string describe() const override;
  double chance_accuracy() const override { return 1.0 / static_cast<double>(config_.values); }
  int64_t scored_per_sequence() const override { return config_.queries; }
  Batch sample(uint64_t seed, int64_t step, int micro_batch, int data_rank,
               int64_t batch) const override;

 private:
  RecallConfig config_;
};

// Byte-level language modelling on a text file: windows of S + 1 bytes at
// positions drawn from the batch's seed; every position is scored.
class TextTask final : public Task {
 public:
  TextTask(const std::string& path, int64_t seq_len);
  int64_t vocab() const override { return 256; }
  int64_t seq_len() const override { return seq_len_; }
  std::string describe() const override;
  double chance_accuracy() const override { return 1.0 / 256.0; }
  int64_t scored_per_sequence() const override { return seq_len_; }
  Batch sample(uint64_t seed, int64_t step, int micro_batch, int data_rank,
               int64_t batch) const override;

 private:
  std::string path_;
  std::vector<uint8_t> bytes_;
  int64_t seq_len_;
};

// Note [Token files]
// ~~~~~~~~~~~~~~~~~~
// Tokenized text as one flat array of token ids, the format llm.c writes
// (and nanoGPT's headerless variant): a header of 256 little-endian int32,
// [0] = 20240520, [1] = 1 for uint16 tokens or 2 for uint32, [2] = the token
// count, then the tokens; a file without that magic is read as bare uint16
// tokens. The file is memory-mapped, not read: a corpus may exceed memory,
// and every rank process maps the same pages. Batches are windows of S + 1
// tokens, every position scored. Window g of a micro-batch's global batch
// starts where a generator seeded by (seed, step, micro-batch, g) says, with
// g = data_rank × batch + b for a data rank's b-th sequence (Note
// [Deterministic batches]): a resumed run sees the same windows, data ranks
// different ones, and a global batch is the same windows however many data
// ranks share it, so layouts that split it differently train on the same
// data (and a fine-tune's losses compare across them). tools/tokenize_text.py
// writes such files with a Hugging Face tokenizer.
class TokenFile {
 public:
  explicit TokenFile(const std::string& path);
  ~TokenFile();
  TokenFile(const TokenFile&) = delete;
  TokenFile& operator=(const TokenFile&) = delete;

  int64_t size() const { return count_; }
  int bytes_per_token() const { return width_; }
  bool has_header() const { return header_; }
  int64_t operator[](int64_t i) const;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  const uint8_t* tokens_ = nullptr;
  int64_t count_ = 0;
  int width_ = 2;
  bool header_ = false;
};

// Writes `tokens` in the llm.c format (uint16 when every id fits, else
// uint32): for tests and small tools; tools/tokenize_text.py writes large ones.
void write_token_file(const std::string& path, const std::vector<int64_t>& tokens);

class TokenTask final : public Task {
 public:
  // `vocab`: the model's; a token id at or beyond it fails the batch naming
  // the file and the position.
  TokenTask(const std::string& path, int64_t seq_len, int64_t vocab);
  int64_t vocab() const override { return vocab_; }
  int64_t seq_len() const override { return seq_len_; }
  std::string describe() const override;
  double chance_accuracy() const override { return 1.0 / static_cast<double>(vocab_); }
  int64_t scored_per_sequence() const override { return seq_len_; }
  Batch sample(uint64_t seed, int64_t step, int micro_batch, int data_rank,
               int64_t batch) const override;

 private:
  std::shared_ptr<TokenFile> file_;
  int64_t seq_len_;
  int64_t vocab_;
};

}  // namespace tandem::train
