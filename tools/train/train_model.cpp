#include "tools/train/train_model.h"

#include <fmt/format.h>

#include "tandem/autograd/nn/rope.h"
#include "tandem/runtime/error.h"
#include "tandem/tensor/ops.h"
#include "tools/train/model.h"
#include "tools/train/trainer.h"

namespace tandem::train {

namespace {

using Json = nlohmann::json;

class MoETrainModel final : public TrainModel {
 public:
  MoETrainModel(const TrainOptions& o, const Task& task, Generator& init) {
    ModelConfig m = o.model;
    m.vocab = task.vocab();
    m.max_seq = task.seq_len();
    model_ = std::make_shared<MoELanguageModel>(m, init);
  }
  std::shared_ptr<Module> module() const override { return model_; }
  std::string describe() const override {
    const ModelConfig& m = model_->config();
    return fmt::format("{} layers, d_model {}, {} heads, {} experts (top-{}) of hidden {}",
                       m.layers, m.d_model, m.heads, m.experts, m.top_k, m.hidden);
  }
  Json identity() const override {
    const ModelConfig& m = model_->config();
    return {{"vocab", m.vocab}, {"d_model", m.d_model}, {"layers", m.layers},
            {"heads", m.heads}, {"hidden", m.hidden},   {"experts", m.experts},
            {"top_k", m.top_k}, {"max_seq", m.max_seq}};
  }
  ParallelizePlan tp_plan() const override {
    ParallelizePlan plan;
    for (int64_t i = 0; i < model_->config().layers; ++i) {
      const std::string a = fmt::format("blocks.{}.attn.", i);
      plan[a + "q_proj"] = colwise();
      plan[a + "k_proj"] = colwise();
      plan[a + "v_proj"] = colwise();
      plan[a + "o_proj"] = rowwise();
    }
    return plan;  // the MoE layers run replicated over tp (Note [Training layout])
  }
  std::vector<std::shared_ptr<nn::SelfAttention>> attention_layers() const override {
    std::vector<std::shared_ptr<nn::SelfAttention>> out;
    for (int64_t i = 0; i < model_->config().layers; ++i)
      out.push_back(model_->block(i)->attn());
    return out;
  }
  std::vector<std::shared_ptr<Module>> blocks() const override {
    std::vector<std::shared_ptr<Module>> out;
    for (int64_t i = 0; i < model_->config().layers; ++i)
      out.push_back(model_->block(i));
    return out;
  }
  bool has_experts() const override { return true; }
  nn::AuxOutput forward(const Tensor& tokens, const std::vector<int64_t>& positions) override {
    Tensor p = ops::from_vector(positions, Shape{static_cast<int64_t>(positions.size())});
    if (!tokens.device().is_cpu()) p = ops::to(p, tokens.device());
    Args args{tokens};
    args.named["positions"] = p;
    return nn::call_with_aux(*model_, args);
  }

 private:
  std::shared_ptr<MoELanguageModel> model_;
};

class LlamaTrainModel final : public TrainModel {
 public:
  LlamaTrainModel(const TrainOptions& o, Generator& init) {
    model_ = std::make_shared<LlamaForCausalLM>(llama_config(o), init);
    if (!o.init_from.empty()) load_hf_checkpoint(*model_, o.init_from);
    from_ = o.init_from.empty() ? "random weights" : fmt::format("weights of '{}'", o.init_from);
  }
  std::shared_ptr<Module> module() const override { return model_; }
  std::string describe() const override {
    const LlamaConfig& c = model_->config();
    const std::string mlp = c.num_local_experts > 0
                                ? fmt::format("{} experts (top-{}) of {}", c.num_local_experts,
                                              c.num_experts_per_tok, c.intermediate_size)
                                : fmt::format("MLP {}", c.intermediate_size);
    return fmt::format(
        "{}: {} layers, hidden {}, {} heads ({} KV) of dim {}, {}, vocab {}{}, from {}",
        c.model_type, c.num_hidden_layers, c.hidden_size, c.num_attention_heads,
        c.num_key_value_heads, c.head_dim, mlp, c.vocab_size,
        c.tie_word_embeddings ? " (tied)" : "", from_);
  }
  Json identity() const override {
    return {{"type", "llama"}, {"config", model_->config().to_json()}};
  }
  ParallelizePlan tp_plan() const override { return tensor_parallel_plan(model_->config()); }
  std::vector<std::shared_ptr<nn::SelfAttention>> attention_layers() const override {
    std::vector<std::shared_ptr<nn::SelfAttention>> out;
    for (int64_t i = 0; i < model_->config().num_hidden_layers; ++i)
      out.push_back(model_->model()->layer(i)->self_attn());
    return out;
  }
  std::vector<std::shared_ptr<Module>> blocks() const override {
    std::vector<std::shared_ptr<Module>> out;
    for (int64_t i = 0; i < model_->config().num_hidden_layers; ++i)
      out.push_back(model_->model()->layer(i));
    return out;
  }
  bool has_experts() const override { return model_->config().num_local_experts > 0; }
  nn::AuxOutput forward(const Tensor& tokens, const std::vector<int64_t>& positions) override {
    nn::PositionScope scope(positions);
    return nn::call_with_aux(*model_, Args{tokens});
  }

 private:
  std::shared_ptr<LlamaForCausalLM> model_;
  std::string from_;
};

}  // namespace

LlamaConfig llama_config(const TrainOptions& o) {
  TANDEM_CHECK(!o.llama_config.empty(),
               "[train] --model llama expects --config CONFIG.JSON (a Hugging Face config.json)");
  return LlamaConfig::from_file(o.llama_config);
}

std::unique_ptr<TrainModel> make_train_model(const TrainOptions& o, const Task& task,
                                             Generator& init) {
  if (o.model_type == "llama") return std::make_unique<LlamaTrainModel>(o, init);
  TANDEM_CHECK(o.model_type == "moe", "[train] expected --model moe|llama, got '{}'", o.model_type);
  return std::make_unique<MoETrainModel>(o, task, init);
}

}  // namespace tandem::train
