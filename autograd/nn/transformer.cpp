#include "tandem/autograd/nn/transformer.h"

#include "tandem/autograd/ops.h"
#include "tandem/runtime/error.h"

namespace tandem::nn {

TransformerBlock::TransformerBlock(const TransformerBlockConfig& config, Generator& gen)
    : Module("TransformerBlock"), config_(config) {
  if (config_.n_kv_heads == 0) config_.n_kv_heads = config_.n_heads;
  TANDEM_CHECK(config_.d_model > 0 && config_.hidden > 0,
               "[nn::TransformerBlock] expected positive d_model and hidden, got {} and {}",
               config_.d_model, config_.hidden);
  norm1_ = register_module("norm1", make_norm(config_.norm, config_.d_model, config_.norm_eps));
  attn_ = register_module("attn", nn::make<nn::SelfAttention>({.d_model = config_.d_model,
                                                               .n_heads = config_.n_heads,
                                                               .n_kv_heads = config_.n_kv_heads,
                                                               .causal = config_.causal},
                                                              gen));
  norm2_ = register_module("norm2", make_norm(config_.norm, config_.d_model, config_.norm_eps));
  if (config_.experts > 0) {
    moe_ = register_module("moe", nn::make<nn::MoE>({.d_model = config_.d_model,
                                                     .hidden = config_.hidden,
                                                     .num_experts = config_.experts,
                                                     .top_k = config_.top_k},
                                                    gen));
  } else {
    mlp_ = register_module(
        "mlp", nn::make<nn::SwiGLU>({.d_model = config_.d_model, .hidden = config_.hidden}, gen));
  }
}

std::vector<Tensor> TransformerBlock::forward(Args& args) {
  const Tensor& x = single_input(args, "TransformerBlock");
  Tensor h = add(x, (*attn_)((*norm1_)(x)));
  Tensor normed = (*norm2_)(h);
  if (moe_) {
    auto [y, aux_loss] = call_with_aux(*moe_, Args{normed});
    TANDEM_CHECK(aux_loss.defined(),
                 "[nn::TransformerBlock] expected MoE outputs {{y, aux_loss}}, got y alone");
    return {add(h, y), aux_loss};
  }
  return {add(h, (*mlp_)(normed))};
}

TransformerLM::TransformerLM(const TransformerLMConfig& config, Generator& gen)
    : Module("TransformerLM"), config_(config) {
  TANDEM_CHECK(config.vocab > 0 && config.layers > 0 && config.max_seq > 0,
               "[nn::TransformerLM] expected positive vocab, layers and max_seq, got {}, {}, {}",
               config.vocab, config.layers, config.max_seq);
  tok_emb_ = register_module("tok_emb", nn::make<nn::Embedding>({.num_embeddings = config.vocab,
                                                                 .dim = config.d_model,
                                                                 .init_std = config.embedding_std},
                                                                gen));
  pos_emb_ = register_module("pos_emb", nn::make<nn::Embedding>({.num_embeddings = config.max_seq,
                                                                 .dim = config.d_model,
                                                                 .init_std = config.embedding_std},
                                                                gen));
  blocks_ = register_module("blocks", std::make_shared<ModuleList>());
  TransformerBlockConfig block;
  block.d_model = config.d_model;
  block.n_heads = config.heads;
  block.n_kv_heads = config.kv_heads;
  block.hidden = config.hidden;
  block.causal = true;
  block.norm = config.norm;
  block.norm_eps = config.norm_eps;
  block.experts = config.experts;
  block.top_k = config.top_k;
  for (int64_t i = 0; i < config.layers; ++i) {
    blocks_->append(std::make_shared<TransformerBlock>(block, gen));
  }
  norm_f_ = register_module("norm_f", make_norm(config.norm, config.d_model, config.norm_eps));
  lm_head_ = register_module(
      "lm_head",
      nn::make<nn::Linear>(
          {.in_features = config.d_model, .out_features = config.vocab, .bias = false}, gen));
}

std::shared_ptr<TransformerBlock> TransformerLM::block(int64_t i) const {
  TANDEM_CHECK(i >= 0 && i < config_.layers,
               "[nn::TransformerLM] expected a block index in [0, {}), got {}", config_.layers, i);
  return blocks_->at<TransformerBlock>(static_cast<size_t>(i));
}

std::vector<Tensor> TransformerLM::forward(Args& args) {
  const Tensor& tokens = single_input(args, "TransformerLM");
  TANDEM_CHECK(tokens.dim() == 2 && tokens.shape()[1] <= config_.max_seq,
               "[nn::TransformerLM] expected tokens (B, S) with S <= {}, got {}", config_.max_seq,
               tokens.shape());
  const int64_t S = tokens.shape()[1];
  Tensor positions = ops::arange(0, static_cast<double>(S), 1, DType::I64, tokens.device());
  Tensor x = add((*tok_emb_)(tokens), (*pos_emb_)(positions));  // (B, S, D) + (S, D)
  Tensor aux;
  for (size_t i = 0; i < blocks_->size(); ++i) {
    AuxOutput out = call_with_aux(*(*blocks_)[i], Args{x});
    x = out.out;
    if (out.aux_loss.defined()) aux = aux.defined() ? add(aux, out.aux_loss) : out.aux_loss;
  }
  Tensor logits = (*lm_head_)((*norm_f_)(x));
  if (aux.defined()) return {logits, aux};
  return {logits};
}

Tensor lm_loss(const Tensor& logits, const Tensor& targets, int64_t ignore_index) {
  TANDEM_CHECK(logits.dim() == 3 && targets.dim() == 2 && logits.shape()[0] == targets.shape()[0] &&
                   logits.shape()[1] == targets.shape()[1],
               "[nn::lm_loss] expected logits (B, S, V) and targets (B, S), got {} and {}",
               logits.shape(), targets.shape());
  const int64_t V = logits.shape()[2], N = logits.shape()[0] * logits.shape()[1];
  return cross_entropy(reshape(logits, Shape{N, V}), reshape(targets, Shape{N}), ignore_index);
}

}  // namespace tandem::nn
