// Text generation with a Llama-family model (tools/train/llama.h): greedy
// decoding or top-p (nucleus) sampling, with a KV cache (Note [KV cache] in
// autograd/nn/attention.h), and the decoding of token ids back to text with a
// Hugging Face tokenizer.json. tandem-generate (tools/train/generate_main.cpp)
// is the command line over it.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "tools/train/llama.h"

namespace tandem::train {

struct GenerateOptions {
  int64_t max_new_tokens = 32;
  bool greedy = true;        // else sample
  double temperature = 1.0;  // sampling: logits / temperature
  double top_p = 1.0;        // sampling: the smallest set of tokens whose probability >= top_p
  uint64_t seed = 0;         // sampling
  bool kv_cache = true;      // false: every step runs the whole sequence again
  std::vector<int64_t> stop_tokens;  // generation ends after emitting one of these
};

struct Generation {
  std::vector<int64_t> tokens;             // the new tokens
  std::vector<std::vector<float>> logits;  // per new token: the logits it was drawn from
  bool stopped = false;                    // ended at a stop token
};

// Continues `prompt` (token ids, at least one) with `model` (batch 1).
Generation generate(LlamaForCausalLM& model, const std::vector<int64_t>& prompt,
                    const GenerateOptions& options);

// The token top-p sampling draws from `logits` with the uniform number u in
// [0, 1): softmax(logits / temperature), the most probable tokens kept until
// their mass reaches top_p (at least one), renormalised, and the token where
// u falls in their cumulative mass (ties: the lower id first).
int64_t sample_top_p(const std::vector<float>& logits, double temperature, double top_p, double u);

// Token ids back to text with a tokenizer.json's vocabulary: byte-level BPE
// (GPT-2, Llama 3, Qwen2: each character of a token stands for one byte) or
// SentencePiece-style (Llama 2, Mistral: "▁" is a space, <0xNN> a byte
// fallback, the leading space of the text dropped). Special tokens are
// skipped, as tokenizer.decode(ids, skip_special_tokens=True) does.
class TokenDecoder {
 public:
  static TokenDecoder from_file(const std::string& tokenizer_json);
  std::string decode(const std::vector<int64_t>& ids) const;
  bool byte_level() const { return byte_level_; }

 private:
  std::map<int64_t, std::string> pieces_;
  std::map<int64_t, bool> special_;
  bool byte_level_ = false;
};

}  // namespace tandem::train
