// The Llama family (Llama 2/3, Mistral without a sliding window, Qwen2, and
// Mixtral, its mixture-of-experts form) written only against tandem's public
// API, with the module tree of the
// Hugging Face implementation, so that a state_dict's names are a
// checkpoint's names and a Hugging Face safetensors checkpoint loads and
// saves without a conversion table:
//
//   model.embed_tokens                      Embedding (vocab, hidden)
//   model.layers.N.input_layernorm          RMSNorm
//   model.layers.N.self_attn.{q,k,v,o}_proj SelfAttention (RoPE, GQA, biases, QK-norm)
//   model.layers.N.post_attention_layernorm RMSNorm
//   model.layers.N.mlp.{gate,up,down}_proj  down(silu(gate(x)) * up(x))
//   model.layers.N.block_sparse_moe        Mixtral, in place of mlp: nn::MoE with
//     .gate                                 the router (hidden → experts), and
//     .experts.E.{w1,w2,w3}                 SwiGLU experts w2(silu(w1 x) * w3 x)
//   model.norm                              RMSNorm
//   lm_head                                 Linear (hidden → vocab); absent when tied
//
// The rotary embedding rotates each token at the global position a
// nn::PositionScope declares (Note [Rotary positions]), so a context-parallel
// rank declares its tokens' positions around the forward.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "tandem/autograd/module.h"
#include "tandem/autograd/nn/attention.h"
#include "tandem/autograd/nn/container.h"
#include "tandem/autograd/nn/linear.h"
#include "tandem/autograd/nn/moe.h"
#include "tandem/autograd/nn/norm.h"
#include "tandem/autograd/nn/rope.h"
#include "tandem/parallel/tensor_parallel.h"

namespace tandem::train {

// The fields of a Hugging Face config.json that shape the model. Fields
// tandem does not implement are refused by name (from_json), never ignored.
struct LlamaConfig {
  std::string model_type = "llama";  // llama, mistral, qwen2 or mixtral
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;  // hidden_size / num_attention_heads unless given
  int64_t max_position_embeddings = 0;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  std::optional<nn::Llama3Scaling> llama3;  // rope_type "llama3"
  bool tie_word_embeddings = false;
  bool qkv_bias = false;  // Qwen2, or attention_bias
  bool o_bias = false;    // attention_bias
  // Mixtral: every layer's MLP is an MoE of num_local_experts SwiGLU experts
  // (intermediate_size each), num_experts_per_tok per token; 0: dense.
  int64_t num_local_experts = 0;
  int64_t num_experts_per_tok = 2;
  double router_aux_loss_coef = 0.0;  // recorded for to_json; the trainer's --aux-weight applies

  // Reads a config.json object: rope_theta / rope_scaling (transformers 4)
  // or rope_parameters (transformers 5). Throws naming the first field it
  // cannot honour (a sliding window, a rope type other than default and
  // llama3, an activation other than silu, MLP biases, an unknown
  // model_type) or a missing/invalid size.
  static LlamaConfig from_json(const nlohmann::json& j);
  static LlamaConfig from_file(const std::string& path);
  // A config.json that transformers reads back as this model.
  nlohmann::json to_json() const;
};

// down(silu(gate(x)) * up(x)).
class LlamaMLP final : public Module {
 public:
  using Options = LlamaConfig;
  LlamaMLP(const LlamaConfig& config, Generator& gen);

 protected:
  std::vector<Tensor> forward(Args& args) override;

 private:
  std::shared_ptr<nn::Linear> gate_proj_, up_proj_, down_proj_;
};

// h = x + self_attn(input_layernorm(x)); out = h + mlp(post_attention_layernorm(h)),
// with block_sparse_moe in place of mlp in a Mixtral layer, which outputs
// {out, aux_loss} (nn::call_with_aux).
class LlamaDecoderLayer final : public Module {
 public:
  using Options = LlamaConfig;
  LlamaDecoderLayer(const LlamaConfig& config, Generator& gen);
  const std::shared_ptr<nn::SelfAttention>& self_attn() const { return self_attn_; }
  const std::shared_ptr<nn::MoE>& block_sparse_moe() const { return moe_; }  // null: dense

 protected:
  std::vector<Tensor> forward(Args& args) override;

 private:
  std::shared_ptr<nn::RMSNorm> input_layernorm_, post_attention_layernorm_;
  std::shared_ptr<nn::SelfAttention> self_attn_;
  std::shared_ptr<LlamaMLP> mlp_;
  std::shared_ptr<nn::MoE> moe_;
};

// tokens (B, S) integer → hidden states (B, S, hidden) after the final norm
// (and, with experts, the layers' summed load-balancing loss).
class LlamaModel final : public Module {
 public:
  using Options = LlamaConfig;
  LlamaModel(const LlamaConfig& config, Generator& gen);
  const std::shared_ptr<nn::Embedding>& embed_tokens() const { return embed_tokens_; }
  std::shared_ptr<LlamaDecoderLayer> layer(int64_t i) const;

 protected:
  std::vector<Tensor> forward(Args& args) override;

 private:
  std::shared_ptr<nn::Embedding> embed_tokens_;
  std::shared_ptr<nn::ModuleList> layers_;
  std::shared_ptr<nn::RMSNorm> norm_;
};

// tokens (B, S) → {logits (B, S, vocab)}, or with experts {logits, aux_loss}:
// call it through nn::call_with_aux to serve both.
class LlamaForCausalLM final : public Module {
 public:
  using Options = LlamaConfig;
  // Weights drawn from `gen` (normal, std 0.02; norms 1): for training from
  // scratch. load_hf_checkpoint() replaces them.
  LlamaForCausalLM(const LlamaConfig& config, Generator& gen);
  const LlamaConfig& config() const { return config_; }
  const std::shared_ptr<LlamaModel>& model() const { return model_; }

 protected:
  std::vector<Tensor> forward(Args& args) override;

 private:
  LlamaConfig config_;
  std::shared_ptr<LlamaModel> model_;
  std::shared_ptr<nn::Linear> lm_head_;  // null when tied
};

// Megatron's tensor-parallel plan over the model's names: q/k/v and a dense
// MLP's gate/up column-wise, o and down row-wise; a Mixtral layer's experts
// run replicated over tp. What tandem-train applies for --tp.
ParallelizePlan tensor_parallel_plan(const LlamaConfig& config);

// Mean next-token cross-entropy as transformers computes it with labels =
// tokens: logits at position s score token s + 1; the last position scores
// nothing.
Tensor causal_lm_loss(const Tensor& logits, const Tensor& tokens);

// Loads a Hugging Face checkpoint directory (model.safetensors, or the
// shards that model.safetensors.index.json lists) into `model`, converting
// each tensor to the parameter's dtype. Every parameter must be found with
// its shape; a tied model ignores a stored lm_head.weight. The first missing
// name, shape mismatch or unexpected tensor is named in the error.
void load_hf_checkpoint(LlamaForCausalLM& model, const std::string& dir);

// Writes config.json and the weights (f32 or bf16 as `dtype` says) as
// model.safetensors, or, beyond `max_shard_bytes`, as numbered shards with
// model.safetensors.index.json, as save_pretrained does.
void save_hf_checkpoint(const LlamaForCausalLM& model, const std::string& dir,
                        DType dtype = DType::F32, int64_t max_shard_bytes = 5ll << 30);

}  // namespace tandem::train
