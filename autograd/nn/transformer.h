// Pre-norm transformer blocks and a small language model built from them.
//
//   h   = x + attn(norm1(x))
//   out = h + mlp(norm2(h))       mlp = SwiGLU, or MoE when experts > 0
//
// With MoE the block's second output is the layer's load-balancing loss
// (Note [MoE per-call state] in autograd/nn/moe.h); TransformerLM sums them.
#pragma once

#include <cstdint>
#include <memory>

#include "tandem/autograd/module.h"
#include "tandem/autograd/nn/attention.h"
#include "tandem/autograd/nn/container.h"
#include "tandem/autograd/nn/linear.h"
#include "tandem/autograd/nn/moe.h"
#include "tandem/autograd/nn/norm.h"

namespace tandem::nn {

struct TransformerBlockConfig {
  int64_t d_model = 0;
  int64_t n_heads = 0;
  int64_t n_kv_heads = 0;  // 0: n_heads (no grouping)
  int64_t hidden = 0;      // SwiGLU hidden size (per expert with MoE)
  bool causal = true;
  NormKind norm = NormKind::Rms;
  double norm_eps = 1e-5;
  int64_t experts = 0;  // > 0: an MoE layer with this many experts
  int64_t top_k = 2;
};

// x (B, S, d_model) → {out (B, S, d_model)} or, with MoE, {out, aux_loss}.
// Children: norm1, attn (SelfAttention), norm2, and mlp (SwiGLU) or moe (MoE).
class TransformerBlock final : public Module {
 public:
  using Options = TransformerBlockConfig;
  TransformerBlock(const TransformerBlockConfig& config, Generator& gen);

  const TransformerBlockConfig& config() const { return config_; }
  const std::shared_ptr<SelfAttention>& attn() const { return attn_; }
  const std::shared_ptr<SwiGLU>& mlp() const { return mlp_; }  // null with MoE
  const std::shared_ptr<MoE>& moe() const { return moe_; }     // null without MoE

 protected:
  std::vector<Tensor> forward(Args& args) override;

 private:
  TransformerBlockConfig config_;
  std::shared_ptr<Module> norm1_;
  std::shared_ptr<SelfAttention> attn_;
  std::shared_ptr<Module> norm2_;
  std::shared_ptr<SwiGLU> mlp_;
  std::shared_ptr<MoE> moe_;
};

struct TransformerLMConfig {
  int64_t vocab = 0;
  int64_t d_model = 0;
  int64_t layers = 0;
  int64_t heads = 0;
  int64_t kv_heads = 0;  // 0: heads
  int64_t hidden = 0;
  int64_t max_seq = 0;
  int64_t experts = 0;  // > 0: every block's MLP is an MoE
  int64_t top_k = 2;
  NormKind norm = NormKind::Rms;
  double norm_eps = 1e-5;
  double embedding_std = 0.02;  // token and position embeddings (GPT-2)
};

// tokens (B, S) integer, S <= max_seq → {logits (B, S, vocab)}, plus the sum
// of the blocks' load-balancing losses as a second output when experts > 0.
// Children: tok_emb, pos_emb (learned positions), blocks (ModuleList of
// TransformerBlock), norm_f, lm_head (Linear d_model → vocab, no bias).
class TransformerLM final : public Module {
 public:
  using Options = TransformerLMConfig;
  TransformerLM(const TransformerLMConfig& config, Generator& gen);

  const TransformerLMConfig& config() const { return config_; }
  std::shared_ptr<TransformerBlock> block(int64_t i) const;

 protected:
  std::vector<Tensor> forward(Args& args) override;

 private:
  TransformerLMConfig config_;
  std::shared_ptr<Embedding> tok_emb_;
  std::shared_ptr<Embedding> pos_emb_;
  std::shared_ptr<ModuleList> blocks_;
  std::shared_ptr<Module> norm_f_;
  std::shared_ptr<Linear> lm_head_;
};

// Mean next-token cross-entropy of logits (B, S, V) against targets (B, S).
Tensor lm_loss(const Tensor& logits, const Tensor& targets, int64_t ignore_index = -100);

}  // namespace tandem::nn
