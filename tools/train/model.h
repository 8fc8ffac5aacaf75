// The model tandem-train trains: a small decoder-only mixture-of-experts
// language model, written only against tandem's public API. Copy this file to
// start a model of your own; tools/train/trainer.cpp shows how the parallel
// styles are applied to it from the outside.
//
//   tokens (B, S) ─ tok_emb ─┐
//                            + ─→ block × L ─→ norm_f ─→ lm_head ─→ logits (B, S, vocab)
//   positions (S) ─ pos_emb ─┘
//
//   block (nn::TransformerBlock with experts):
//     h   = x + attn(norm1(x))        causal self-attention, q/k/v/o projections
//     out = h + moe(norm2(h))         router → top-k of E SwiGLU experts
//
// `positions` are the global positions of the tokens this rank holds. Without
// context parallelism they are 0 … S-1; under it a rank holds pieces of the
// sequence (parallel/context_parallel.h, sequence_pieces) and the learned
// position embedding must see where those pieces sit in the whole sequence.
//
// forward returns {logits, aux}: aux is the sum of the layers' load-balancing
// losses (Note [MoE per-call state] in autograd/nn/moe.h).
#pragma once

#include <cstdint>
#include <memory>

#include "tandem/autograd/module.h"
#include "tandem/autograd/nn/container.h"
#include "tandem/autograd/nn/linear.h"
#include "tandem/autograd/nn/transformer.h"

namespace tandem::train {

struct ModelConfig {
  int64_t vocab = 64;
  int64_t d_model = 64;
  int64_t layers = 2;
  int64_t heads = 4;
  int64_t hidden = 128;  // per expert
  int64_t experts = 4;
  int64_t top_k = 2;
  int64_t max_seq = 128;
};

class MoELanguageModel final : public Module {
 public:
  MoELanguageModel(const ModelConfig& config, Generator& gen);

  const ModelConfig& config() const { return config_; }
  std::shared_ptr<nn::TransformerBlock> block(int64_t i) const;

 protected:
  // positional: tokens (B, S) i64; named "positions": (S) i64, default 0 … S-1.
  std::vector<Tensor> forward(Args& args) override;

 private:
  ModelConfig config_;
  std::shared_ptr<nn::Embedding> tok_emb_;
  std::shared_ptr<nn::Embedding> pos_emb_;
  std::shared_ptr<nn::ModuleList> blocks_;
  std::shared_ptr<Module> norm_f_;
  std::shared_ptr<nn::Linear> lm_head_;
};

}  // namespace tandem::train
