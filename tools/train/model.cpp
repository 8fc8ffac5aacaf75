#include "tools/train/model.h"

#include "tandem/autograd/ops.h"
#include "tandem/runtime/error.h"

namespace tandem::train {

MoELanguageModel::MoELanguageModel(const ModelConfig& config, Generator& gen)
    : Module("MoELanguageModel"), config_(config) {
  TANDEM_CHECK(config.vocab > 0 && config.d_model > 0 && config.layers > 0 && config.max_seq > 0,
               "[train::MoELanguageModel] expected positive vocab, d_model, layers and max_seq, "
               "got {}, {}, {}, {}",
               config.vocab, config.d_model, config.layers, config.max_seq);
  TANDEM_CHECK(config.heads > 0 && config.d_model % config.heads == 0,
               "[train::MoELanguageModel] expected heads dividing d_model {}, got {}",
               config.d_model, config.heads);
  TANDEM_CHECK(config.experts > 0 && config.top_k > 0 && config.top_k <= config.experts,
               "[train::MoELanguageModel] expected experts > 0 and 0 < top_k <= experts, got "
               "experts {} and top_k {}",
               config.experts, config.top_k);
  tok_emb_ = register_module(
      "tok_emb",
      nn::make<nn::Embedding>(
          {.num_embeddings = config.vocab, .dim = config.d_model, .init_std = 0.02}, gen));
  pos_emb_ = register_module(
      "pos_emb",
      nn::make<nn::Embedding>(
          {.num_embeddings = config.max_seq, .dim = config.d_model, .init_std = 0.02}, gen));
  blocks_ = register_module("blocks", std::make_shared<nn::ModuleList>());
  nn::TransformerBlockConfig block;
  block.d_model = config.d_model;
  block.n_heads = config.heads;
  block.hidden = config.hidden;
  block.causal = true;
  block.norm = nn::NormKind::Rms;
  block.experts = config.experts;
  block.top_k = config.top_k;
  for (int64_t i = 0; i < config.layers; ++i)
    blocks_->append(std::make_shared<nn::TransformerBlock>(block, gen));
  norm_f_ = register_module("norm_f", nn::make_norm(nn::NormKind::Rms, config.d_model, 1e-5));
  lm_head_ = register_module(
      "lm_head",
      nn::make<nn::Linear>(
          {.in_features = config.d_model, .out_features = config.vocab, .bias = false}, gen));
}

std::shared_ptr<nn::TransformerBlock> MoELanguageModel::block(int64_t i) const {
  TANDEM_CHECK(i >= 0 && i < config_.layers,
               "[train::MoELanguageModel] expected a block index in [0, {}), got {}",
               config_.layers, i);
  return blocks_->at<nn::TransformerBlock>(static_cast<size_t>(i));
}

std::vector<Tensor> MoELanguageModel::forward(Args& args) {
  TANDEM_CHECK(args.positional.size() == 1 && args.positional[0].dim() == 2,
               "[train::MoELanguageModel] expected one positional input, tokens (B, S), got {} "
               "inputs",
               args.positional.size());
  const Tensor& tokens = args.positional[0];
  const int64_t S = tokens.shape()[1];
  Tensor positions;
  if (Tensor* p = args.find("positions")) {
    positions = *p;
    TANDEM_CHECK(positions.dim() == 1 && positions.shape()[0] == S,
                 "[train::MoELanguageModel] expected positions of shape ({}), got {}", S,
                 positions.shape());
  } else {
    TANDEM_CHECK(S <= config_.max_seq,
                 "[train::MoELanguageModel] expected at most {} tokens per sequence, got {}",
                 config_.max_seq, S);
    positions = ops::arange(0, static_cast<double>(S), 1, DType::I64, tokens.device());
  }
  Tensor x = add((*tok_emb_)(tokens), (*pos_emb_)(positions));  // (B, S, D) + (S, D)
  Tensor aux;
  for (size_t i = 0; i < blocks_->size(); ++i) {
    nn::AuxOutput out = nn::call_with_aux(*(*blocks_)[i], Args{x});
    x = out.out;
    aux = aux.defined() ? add(aux, out.aux_loss) : out.aux_loss;
  }
  return {(*lm_head_)((*norm_f_)(x)), aux};
}

}  // namespace tandem::train
