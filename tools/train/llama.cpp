#include "tools/train/llama.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include <fmt/format.h>

#include "tandem/autograd/ops.h"
#include "tandem/runtime/error.h"
#include "tandem/tensor/io/safetensors.h"
#include "tandem/tensor/ops.h"

namespace tandem::train {
namespace {

using Json = nlohmann::json;
namespace fs = std::filesystem;

// A positive integer field; `fallback` (> 0) when absent or null.
int64_t size_field(const Json& j, const char* key, int64_t fallback = 0) {
  if (!j.contains(key) || j[key].is_null()) {
    TANDEM_CHECK(fallback > 0,
                 "[llama::config] expected field {}, a positive integer; it is missing", key);
    return fallback;
  }
  TANDEM_CHECK(j[key].is_number_integer() && j[key].get<int64_t>() > 0,
               "[llama::config] expected field {} to be a positive integer, got {}", key,
               j[key].dump());
  return j[key].get<int64_t>();
}

double number_field(const Json& j, const char* key, double fallback) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  TANDEM_CHECK(j[key].is_number(), "[llama::config] expected field {} to be a number, got {}", key,
               j[key].dump());
  return j[key].get<double>();
}

bool flag_field(const Json& j, const char* key, bool fallback) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  TANDEM_CHECK(j[key].is_boolean(), "[llama::config] expected field {} to be true or false, got {}",
               key, j[key].dump());
  return j[key].get<bool>();
}

nn::SelfAttentionOptions attention_options(const LlamaConfig& c) {
  return {
      .d_model = c.hidden_size,
      .n_heads = c.num_attention_heads,
      .n_kv_heads = c.num_key_value_heads,
      .causal = true,
      .head_dim = c.head_dim,
      .qkv_bias = c.qkv_bias,
      .o_bias = c.o_bias,
      .rope = nn::RotaryOptions{.head_dim = c.head_dim, .theta = c.rope_theta, .llama3 = c.llama3}};
}

}  // namespace

LlamaConfig LlamaConfig::from_json(const Json& j) {
  TANDEM_CHECK(j.is_object(), "[llama::config] expected a JSON object, got {}", j.type_name());
  LlamaConfig c;
  c.model_type = j.value("model_type", std::string("llama"));
  TANDEM_CHECK(c.model_type == "llama" || c.model_type == "mistral" || c.model_type == "qwen2" ||
                   c.model_type == "mixtral",
               "[llama::config] field model_type: expected llama, mistral, qwen2 or mixtral, got "
               "'{}'",
               c.model_type);
  const std::string act = j.value("hidden_act", std::string("silu"));
  TANDEM_CHECK(act == "silu", "[llama::config] field hidden_act: tandem implements silu, got '{}'",
               act);
  TANDEM_CHECK(!flag_field(j, "mlp_bias", false),
               "[llama::config] field mlp_bias: tandem's Llama MLP has no biases, got true");
  TANDEM_CHECK(!flag_field(j, "use_sliding_window", false) &&
                   ((c.model_type != "mistral" && c.model_type != "mixtral") ||
                    !j.contains("sliding_window") || j["sliding_window"].is_null()),
               "[llama::config] field sliding_window: tandem attends to the whole causal context; "
               "a sliding window is not implemented (got {})",
               j.value("sliding_window", Json()).dump());
  if (j.contains("layer_types") && j["layer_types"].is_array()) {
    for (const Json& t : j["layer_types"]) {
      TANDEM_CHECK(t == "full_attention",
                   "[llama::config] field layer_types: tandem implements full_attention layers "
                   "only, got {}",
                   t.dump());
    }
  }
  if (c.model_type == "mixtral") {
    c.num_local_experts = size_field(j, "num_local_experts");
    c.num_experts_per_tok = size_field(j, "num_experts_per_tok", 2);
    TANDEM_CHECK(c.num_experts_per_tok <= c.num_local_experts,
                 "[llama::config] expected num_experts_per_tok ({}) <= num_local_experts ({})",
                 c.num_experts_per_tok, c.num_local_experts);
    c.router_aux_loss_coef = number_field(j, "router_aux_loss_coef", 0.001);
    TANDEM_CHECK(number_field(j, "router_jitter_noise", 0.0) == 0.0,
                 "[llama::config] field router_jitter_noise: tandem's router adds no noise, got "
                 "{}",
                 j["router_jitter_noise"].dump());
  } else {
    for (const char* moe : {"num_local_experts", "num_experts"}) {
      TANDEM_CHECK(!j.contains(moe) || j[moe].is_null() || j[moe] == 0,
                   "[llama::config] field {}: experts belong to model_type mixtral, got {} with "
                   "model_type {}",
                   moe, j[moe].dump(), c.model_type);
    }
  }
  c.vocab_size = size_field(j, "vocab_size");
  c.hidden_size = size_field(j, "hidden_size");
  c.intermediate_size = size_field(j, "intermediate_size");
  c.num_hidden_layers = size_field(j, "num_hidden_layers");
  c.num_attention_heads = size_field(j, "num_attention_heads");
  c.num_key_value_heads = size_field(j, "num_key_value_heads", c.num_attention_heads);
  TANDEM_CHECK(c.num_attention_heads % c.num_key_value_heads == 0,
               "[llama::config] expected num_attention_heads ({}) divisible by "
               "num_key_value_heads ({})",
               c.num_attention_heads, c.num_key_value_heads);
  const bool explicit_head_dim = j.contains("head_dim") && !j["head_dim"].is_null();
  TANDEM_CHECK(explicit_head_dim || c.hidden_size % c.num_attention_heads == 0,
               "[llama::config] expected hidden_size ({}) divisible by num_attention_heads ({}) "
               "when head_dim is not given",
               c.hidden_size, c.num_attention_heads);
  c.head_dim = size_field(j, "head_dim", c.hidden_size / c.num_attention_heads);
  c.max_position_embeddings = size_field(j, "max_position_embeddings", 4096);
  c.rms_norm_eps = number_field(j, "rms_norm_eps", 1e-6);
  c.tie_word_embeddings = flag_field(j, "tie_word_embeddings", false);
  const bool attention_bias = flag_field(j, "attention_bias", false);
  c.qkv_bias = attention_bias || c.model_type == "qwen2";
  c.o_bias = attention_bias;

  // transformers 5 writes rope_parameters, 4 wrote rope_theta and rope_scaling.
  Json rope = Json::object();
  for (const char* key : {"rope_parameters", "rope_scaling"}) {
    if (j.contains(key) && j[key].is_object()) {
      rope = j[key];
      break;
    }
  }
  c.rope_theta = number_field(rope, "rope_theta", number_field(j, "rope_theta", 10000.0));
  const std::string type = rope.value("rope_type", rope.value("type", std::string("default")));
  if (type == "llama3") {
    nn::Llama3Scaling s;
    s.factor = number_field(rope, "factor", 0);
    s.low_freq_factor = number_field(rope, "low_freq_factor", 0);
    s.high_freq_factor = number_field(rope, "high_freq_factor", 0);
    s.original_max_position_embeddings = size_field(rope, "original_max_position_embeddings");
    c.llama3 = s;
  } else {
    TANDEM_CHECK(type == "default",
                 "[llama::config] field rope_scaling.rope_type: tandem implements default and "
                 "llama3, got '{}'",
                 type);
  }
  nn::rope_inv_freq({.head_dim = c.head_dim, .theta = c.rope_theta, .llama3 = c.llama3});
  return c;
}

LlamaConfig LlamaConfig::from_file(const std::string& path) {
  std::ifstream in(path);
  TANDEM_CHECK(in.good(), "[llama::config] cannot open '{}'", path);
  Json j = Json::parse(in, nullptr, /*allow_exceptions=*/false);
  TANDEM_CHECK(!j.is_discarded(), "[llama::config] '{}' is not valid JSON", path);
  try {
    return from_json(j);
  } catch (const Error& e) {
    throw Error(fmt::format("{} (in {})", e.what(), path));
  }
}

Json LlamaConfig::to_json() const {
  Json j = {{"architectures",
             {model_type == "qwen2"     ? "Qwen2ForCausalLM"
              : model_type == "mistral" ? "MistralForCausalLM"
              : model_type == "mixtral" ? "MixtralForCausalLM"
                                        : "LlamaForCausalLM"}},
            {"model_type", model_type},
            {"vocab_size", vocab_size},
            {"hidden_size", hidden_size},
            {"intermediate_size", intermediate_size},
            {"num_hidden_layers", num_hidden_layers},
            {"num_attention_heads", num_attention_heads},
            {"num_key_value_heads", num_key_value_heads},
            {"head_dim", head_dim},
            {"max_position_embeddings", max_position_embeddings},
            {"rms_norm_eps", rms_norm_eps},
            {"rope_theta", rope_theta},
            {"hidden_act", "silu"},
            {"tie_word_embeddings", tie_word_embeddings},
            {"torch_dtype", "float32"}};
  if (model_type != "qwen2") j["attention_bias"] = o_bias;
  if (model_type == "qwen2") j["use_sliding_window"] = false;
  if (model_type == "mixtral") {
    j["num_local_experts"] = num_local_experts;
    j["num_experts_per_tok"] = num_experts_per_tok;
    j["router_aux_loss_coef"] = router_aux_loss_coef;
    j["router_jitter_noise"] = 0.0;
    j["sliding_window"] = nullptr;
  }
  if (llama3) {
    j["rope_scaling"] = {
        {"rope_type", "llama3"},
        {"factor", llama3->factor},
        {"low_freq_factor", llama3->low_freq_factor},
        {"high_freq_factor", llama3->high_freq_factor},
        {"original_max_position_embeddings", llama3->original_max_position_embeddings}};
  }
  return j;
}

LlamaMLP::LlamaMLP(const LlamaConfig& c, Generator& gen) : Module("LlamaMLP") {
  auto linear = [&](const char* name, int64_t in, int64_t out) {
    return register_module(
        name, nn::make<nn::Linear>({.in_features = in, .out_features = out, .bias = false}, gen));
  };
  gate_proj_ = linear("gate_proj", c.hidden_size, c.intermediate_size);
  up_proj_ = linear("up_proj", c.hidden_size, c.intermediate_size);
  down_proj_ = linear("down_proj", c.intermediate_size, c.hidden_size);
}

std::vector<Tensor> LlamaMLP::forward(Args& args) {
  const Tensor& x = nn::single_input(args, "LlamaMLP");
  return {(*down_proj_)(swiglu((*gate_proj_)(x), (*up_proj_)(x)))};
}

LlamaDecoderLayer::LlamaDecoderLayer(const LlamaConfig& c, Generator& gen)
    : Module("LlamaDecoderLayer") {
  const nn::RMSNormOptions norm{.dim = c.hidden_size, .eps = c.rms_norm_eps};
  input_layernorm_ = register_module("input_layernorm", nn::make<nn::RMSNorm>(norm));
  self_attn_ = register_module("self_attn", nn::make<nn::SelfAttention>(attention_options(c), gen));
  post_attention_layernorm_ =
      register_module("post_attention_layernorm", nn::make<nn::RMSNorm>(norm));
  if (c.num_local_experts > 0) {
    moe_ =
        register_module("block_sparse_moe", nn::make<nn::MoE>({.d_model = c.hidden_size,
                                                               .hidden = c.intermediate_size,
                                                               .num_experts = c.num_local_experts,
                                                               .top_k = c.num_experts_per_tok,
                                                               .router_name = "gate"},
                                                              gen));
  } else {
    mlp_ = register_module("mlp", nn::make<LlamaMLP>(c, gen));
  }
}

std::vector<Tensor> LlamaDecoderLayer::forward(Args& args) {
  const Tensor& x = nn::single_input(args, "LlamaDecoderLayer");
  Tensor h = add(x, (*self_attn_)((*input_layernorm_)(x)));
  if (!moe_) return {add(h, (*mlp_)((*post_attention_layernorm_)(h)))};
  nn::AuxOutput m = nn::call_with_aux(*moe_, Args{(*post_attention_layernorm_)(h)});
  return {add(h, m.out), m.aux_loss};
}

LlamaModel::LlamaModel(const LlamaConfig& c, Generator& gen) : Module("LlamaModel") {
  embed_tokens_ = register_module(
      "embed_tokens",
      nn::make<nn::Embedding>(
          {.num_embeddings = c.vocab_size, .dim = c.hidden_size, .init_std = 0.02}, gen));
  layers_ = register_module("layers", std::make_shared<nn::ModuleList>());
  for (int64_t i = 0; i < c.num_hidden_layers; ++i)
    layers_->append(nn::make<LlamaDecoderLayer>(c, gen));
  norm_ =
      register_module("norm", nn::make<nn::RMSNorm>({.dim = c.hidden_size, .eps = c.rms_norm_eps}));
}

std::shared_ptr<LlamaDecoderLayer> LlamaModel::layer(int64_t i) const {
  return layers_->at<LlamaDecoderLayer>(static_cast<size_t>(i));
}

std::vector<Tensor> LlamaModel::forward(Args& args) {
  const Tensor& tokens = nn::single_input(args, "LlamaModel");
  TANDEM_CHECK(tokens.dim() == 2 && is_integral(tokens.dtype()),
               "[llama] expected integer tokens (B, S), got {} {}", dtype_name(tokens.dtype()),
               tokens.shape());
  Tensor h = (*embed_tokens_)(tokens);
  Tensor aux;
  for (size_t i = 0; i < layers_->size(); ++i) {
    nn::AuxOutput out = nn::call_with_aux(*(*layers_)[i], Args{h});
    h = out.out;
    if (out.aux_loss.defined()) aux = aux.defined() ? add(aux, out.aux_loss) : out.aux_loss;
  }
  if (aux.defined()) return {(*norm_)(h), aux};
  return {(*norm_)(h)};
}

LlamaForCausalLM::LlamaForCausalLM(const LlamaConfig& config, Generator& gen)
    : Module("LlamaForCausalLM"), config_(config) {
  model_ = register_module("model", nn::make<LlamaModel>(config, gen));
  if (!config.tie_word_embeddings) {
    lm_head_ = register_module("lm_head", nn::make<nn::Linear>({.in_features = config.hidden_size,
                                                                .out_features = config.vocab_size,
                                                                .bias = false},
                                                               gen));
  }
}

std::vector<Tensor> LlamaForCausalLM::forward(Args& args) {
  nn::AuxOutput out = nn::call_with_aux(*model_, Args{nn::single_input(args, "LlamaForCausalLM")});
  Tensor logits =
      lm_head_ ? (*lm_head_)(out.out) : linear(out.out, model_->embed_tokens()->weight());  // tied
  if (out.aux_loss.defined()) return {logits, out.aux_loss};
  return {logits};
}

ParallelizePlan tensor_parallel_plan(const LlamaConfig& c) {
  ParallelizePlan plan;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string a = fmt::format("model.layers.{}.self_attn.", i);
    const std::string m = fmt::format("model.layers.{}.mlp.", i);
    plan[a + "q_proj"] = colwise();
    plan[a + "k_proj"] = colwise();
    plan[a + "v_proj"] = colwise();
    plan[a + "o_proj"] = rowwise();
    if (c.num_local_experts > 0) continue;  // experts: replicated over tp
    plan[m + "gate_proj"] = colwise();
    plan[m + "up_proj"] = colwise();
    plan[m + "down_proj"] = rowwise();
  }
  return plan;
}

Tensor causal_lm_loss(const Tensor& logits, const Tensor& tokens) {
  TANDEM_CHECK(logits.dim() == 3 && tokens.dim() == 2 && tokens.shape()[0] == logits.shape()[0] &&
                   tokens.shape()[1] == logits.shape()[1],
               "[llama::causal_lm_loss] expected logits (B, S, V) and tokens (B, S), got {} and {}",
               logits.shape(), tokens.shape());
  const int64_t S = tokens.shape()[1];
  Tensor targets = ops::full(tokens.shape(), -100.0, DType::I64, tokens.device());
  if (S > 1) {
    ops::copy_(ops::narrow(targets, 1, 0, S - 1),
               ops::to(ops::narrow(tokens, 1, 1, S - 1), DType::I64));
  }
  const int64_t V = logits.shape()[2], N = tokens.numel();
  return cross_entropy(reshape(logits, Shape{N, V}), reshape(targets, Shape{N}), -100);
}

void load_hf_checkpoint(LlamaForCausalLM& model, const std::string& dir) {
  const fs::path root(dir);
  std::map<std::string, std::string> file_of;  // tensor name → file
  std::vector<std::string> files;
  if (fs::exists(root / "model.safetensors.index.json")) {
    std::ifstream in(root / "model.safetensors.index.json");
    Json index = Json::parse(in, nullptr, false);
    TANDEM_CHECK(
        !index.is_discarded() && index.contains("weight_map") && index["weight_map"].is_object(),
        "[llama::load] expected {} to be JSON with a weight_map object",
        (root / "model.safetensors.index.json").string());
    for (const auto& [name, file] : index["weight_map"].items()) {
      file_of[name] = file.get<std::string>();
      if (std::find(files.begin(), files.end(), file_of[name]) == files.end())
        files.push_back(file_of[name]);
    }
  } else {
    TANDEM_CHECK(fs::exists(root / "model.safetensors"),
                 "[llama::load] expected model.safetensors or model.safetensors.index.json in "
                 "'{}', found neither",
                 dir);
    files.push_back("model.safetensors");
  }
  std::map<std::string, Tensor> stored;
  for (const std::string& file : files) {
    SafetensorsFile f = load_safetensors((root / file).string());
    for (const auto& [name, t] : f.tensors()) {
      if (file_of.empty() || file_of[name] == file) stored[name] = t;
    }
  }
  NoGradGuard no_grad;
  std::set<std::string> used;
  for (const auto& [name, p] : model.named_parameters()) {
    auto it = stored.find(name);
    TANDEM_CHECK(it != stored.end(), "[llama::load] checkpoint '{}' has no tensor '{}' ({} {})",
                 dir, name, dtype_name(p.dtype()), p.shape());
    TANDEM_CHECK(it->second.shape() == p.shape(),
                 "[llama::load] checkpoint '{}': tensor '{}' has shape {}, the config expects {}",
                 dir, name, it->second.shape(), p.shape());
    ops::copy_(p, ops::to(ops::to(it->second, p.dtype()), p.device()));
    used.insert(name);
  }
  for (const auto& [name, t] : stored) {
    const bool ignorable = (name == "lm_head.weight" && model.config().tie_word_embeddings) ||
                           name.ends_with("rotary_emb.inv_freq");
    TANDEM_CHECK(used.count(name) != 0 || ignorable,
                 "[llama::load] checkpoint '{}' holds tensor '{}' {}, which the config has no "
                 "parameter for",
                 dir, name, t.shape());
  }
}

void save_hf_checkpoint(const LlamaForCausalLM& model, const std::string& dir, DType dtype,
                        int64_t max_shard_bytes) {
  TANDEM_CHECK(dtype == DType::F32 || dtype == DType::BF16,
               "[llama::save] expected dtype f32 or bf16, got {}", dtype_name(dtype));
  TANDEM_CHECK(max_shard_bytes > 0, "[llama::save] expected a positive shard size, got {}",
               max_shard_bytes);
  const fs::path root(dir);
  fs::create_directories(root);
  Json config = model.config().to_json();
  config["torch_dtype"] = dtype == DType::F32 ? "float32" : "bfloat16";
  {
    std::ofstream out(root / "config.json");
    out << config.dump(2) << "\n";
    TANDEM_CHECK(out.good(), "[llama::save] cannot write {}", (root / "config.json").string());
  }
  // Shards of at most max_shard_bytes (a larger tensor gets one of its own),
  // in name order.
  std::vector<std::vector<std::pair<std::string, Tensor>>> shards(1);
  int64_t in_shard = 0, total = 0;
  for (const auto& [name, p] : model.named_parameters()) {
    Tensor t = ops::to(ops::to(p, Device::cpu()), dtype);
    const auto bytes = static_cast<int64_t>(t.nbytes());
    if (in_shard > 0 && in_shard + bytes > max_shard_bytes) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back().emplace_back(name, t);
    in_shard += bytes;
    total += bytes;
  }
  const std::map<std::string, std::string> metadata = {{"format", "pt"}};
  if (shards.size() == 1) {
    save_safetensors((root / "model.safetensors").string(), shards[0], metadata);
    return;
  }
  Json index = {{"metadata", {{"total_size", total}}}, {"weight_map", Json::object()}};
  for (size_t i = 0; i < shards.size(); ++i) {
    const std::string file =
        fmt::format("model-{:05d}-of-{:05d}.safetensors", i + 1, shards.size());
    save_safetensors((root / file).string(), shards[i], metadata);
    for (const auto& [name, t] : shards[i])
      index["weight_map"][name] = file;
  }
  std::ofstream out(root / "model.safetensors.index.json");
  out << index.dump(2) << "\n";
  TANDEM_CHECK(out.good(), "[llama::save] cannot write the index in {}", dir);
}

}  // namespace tandem::train
