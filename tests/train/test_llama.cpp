// The Llama family model (tools/train/llama.h) against the reference
// implementation: tiny random Llama, Llama-3-scaled and Qwen2 models that
// `transformers` built and saved (tools/hf_fixtures.py, versions in
// tests/fixtures/hf/versions.json), with the logits, the causal-LM loss and
// some parameter gradients it computed for a fixed batch. Loaded by their
// Hugging Face names, tandem's model must give the same numbers; saved and
// loaded again, the same bits; under context parallelism with each rank's
// positions declared, the same logits rows. Configs and checkpoints tandem
// cannot honour are refused naming the field or tensor.
#include <catch2/catch.hpp>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "tandem/autograd/ops.h"
#include "tandem/comm/threads/threads_backend.h"
#include "tandem/parallel/context_parallel.h"
#include "tandem/parallel/expert_parallel.h"
#include "tandem/parallel/tensor_parallel.h"
#include "tandem/tensor/io/safetensors.h"
#include "tools/train/llama.h"

using namespace tandem;
using namespace tandem::train;
using Catch::Matchers::Contains;

namespace {

const std::string kFixtures = TANDEM_HF_FIXTURES;

std::string fixture(const std::string& name) {
  return kFixtures + "/" + name;
}

std::shared_ptr<LlamaForCausalLM> load_fixture(const std::string& name) {
  LlamaConfig config = LlamaConfig::from_file(fixture(name) + "/config.json");
  Generator gen(1);
  auto model = nn::make<LlamaForCausalLM>(config, gen);
  load_hf_checkpoint(*model, fixture(name));
  return model;
}

// |got - want| <= atol + rtol |want|, with the worst element in the message.
std::string compare(const Tensor& got, const Tensor& want, double rtol, double atol) {
  if (got.shape() != want.shape()) return fmt::format("shape {} vs {}", got.shape(), want.shape());
  const std::vector<float> g = ops::to(got, DType::F32).to_vector<float>();
  const std::vector<float> w = ops::to(want, DType::F32).to_vector<float>();
  double worst = 0;
  size_t at = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    const double excess = std::abs(g[i] - w[i]) - (atol + rtol * std::abs(w[i]));
    if (excess > worst) {
      worst = excess;
      at = i;
    }
  }
  return worst > 0 ? fmt::format("element {}: {} vs {}", at, g[at], w[at]) : "";
}

std::string temp_dir(const std::string& what) {
  auto dir = std::filesystem::temp_directory_path() /
             fmt::format("tandem-llama-{}-{}", what, static_cast<long>(::getpid()));
  std::filesystem::remove_all(dir);
  return dir.string();
}

}  // namespace

TEST_CASE("Llama-family checkpoints from transformers give its logits, loss and gradients",
          "[llama]") {
  for (const char* name : {"llama", "llama3-scaled", "qwen2", "mixtral"}) {
    INFO(name);
    auto model = load_fixture(name);
    SafetensorsFile ref = load_safetensors(fixture(name) + "/reference.safetensors");
    const Tensor tokens = ref.at("input_ids");
    Tensor logits = nn::call_with_aux(*model, Args{tokens}).out;
    CHECK(compare(logits, ref.at("logits"), 1e-4, 1e-5) == "");
    Tensor loss = causal_lm_loss(logits, tokens);
    CHECK(compare(reshape(loss, Shape{1}), ref.at("loss"), 1e-4, 0) == "");
    backward(loss);
    int checked = 0;
    for (const auto& [pname, p] : model->named_parameters()) {
      if (!ref.contains("grad." + pname)) continue;
      INFO(pname);
      CHECK(compare(grad(p), ref.at("grad." + pname), 1e-4, 1e-6) == "");
      ++checked;
    }
    CHECK(checked >= 5);  // the fixture's gradients were found by name
  }
}

TEST_CASE("a Llama checkpoint saved by tandem loads back bit for bit, sharded or not, or as bf16",
          "[llama]") {
  auto model = load_fixture("qwen2");
  for (int64_t shard_bytes : {int64_t{1} << 30, int64_t{4096}}) {
    INFO("max shard bytes " << shard_bytes);
    const std::string dir = temp_dir("save");
    save_hf_checkpoint(*model, dir, DType::F32, shard_bytes);
    CHECK(std::filesystem::exists(dir + "/model.safetensors.index.json") ==
          (shard_bytes < 4096 * 8));
    LlamaConfig again = LlamaConfig::from_file(dir + "/config.json");
    CHECK(again.qkv_bias);
    CHECK(again.tie_word_embeddings);
    Generator gen(2);
    auto loaded = nn::make<LlamaForCausalLM>(again, gen);
    load_hf_checkpoint(*loaded, dir);
    const auto a = model->named_parameters(), b = loaded->named_parameters();
    REQUIRE(a.size() == b.size());
    for (size_t i = 0; i < a.size(); ++i) {
      CHECK(a[i].first == b[i].first);
      CHECK(ops::equal(a[i].second, b[i].second));
    }
    std::filesystem::remove_all(dir);
  }
  // bf16 on disk: every weight comes back as its bf16 rounding.
  const std::string dir = temp_dir("bf16");
  save_hf_checkpoint(*model, dir, DType::BF16);
  CHECK(load_safetensors(dir + "/model.safetensors").at("model.norm.weight").dtype() ==
        DType::BF16);
  Generator gen(4);
  auto from_bf16 = nn::make<LlamaForCausalLM>(LlamaConfig::from_file(dir + "/config.json"), gen);
  load_hf_checkpoint(*from_bf16, dir);
  const auto a = model->named_parameters(), b = from_bf16->named_parameters();
  bool rounded = a.size() == b.size(), changed = false;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    const Tensor want = ops::to(ops::to(a[i].second, DType::BF16), DType::F32);
    rounded = rounded && ops::equal(b[i].second, want);
    changed = changed || !ops::equal(b[i].second, a[i].second);
  }
  CHECK(rounded);
  CHECK(changed);  // not vacuous: f32 weights do not all survive bf16
  std::filesystem::remove_all(dir);
  // For tools/hf_fixtures.py --check-export: every fixture as tandem writes
  // it, for transformers to load and compare with its own reference.
  if (const char* out = std::getenv("TANDEM_LLAMA_EXPORT_DIR")) {
    for (const char* name : {"llama", "llama3-scaled", "qwen2", "mixtral"})
      save_hf_checkpoint(*load_fixture(name), std::string(out) + "/" + name, DType::F32, 16384);
  }
}

TEST_CASE("a Llama model under context parallelism gives transformers' logits, loss, gradients",
          "[llama][cp]") {
  auto reference = load_fixture("llama3-scaled");
  SafetensorsFile ref = load_safetensors(fixture("llama3-scaled") + "/reference.safetensors");
  const Tensor tokens = ref.at("input_ids");
  const Tensor want = (*reference)(tokens);
  const int64_t S = tokens.shape()[1];
  struct Layout {
    int ds;
    bool ring, load_balance;
  };
  for (Layout l : {Layout{2, false, false}, Layout{1, true, true}, Layout{1, false, true}}) {
    INFO("ds=" << l.ds << " ring=" << l.ring << " lb=" << l.load_balance);
    std::vector<std::string> errors(2);
    run_ranks(2, [&](ProcessGroupPtr pg) {
      const int r = pg->rank();
      auto model = load_fixture("llama3-scaled");
      DeviceMesh mesh(pg, {2}, {"cp"});
      ContextParallel cp;
      cp.ulysses_degree = l.ds;
      cp.load_balance = l.load_balance;
      cp.mode = l.ring ? CPMode::Ring : CPMode::Auto;
      for (int64_t i = 0; i < model->config().num_hidden_layers; ++i)
        cp.apply(model->model()->layer(i)->self_attn()->core(), mesh);
      nn::PositionScope scope(sequence_positions(S, 2, r, l.load_balance));
      Tensor logits = (*model)(shard_sequence(tokens, 1, 2, r, l.load_balance));
      std::string e = compare(logits, shard_sequence(want, 1, 2, r, l.load_balance), 1e-5, 1e-5);
      // The loss: each rank scores its tokens against the next token of the
      // whole sequence (the last position scores nothing), weighted by its
      // share; the ranks' losses and gradients sum to transformers'.
      Tensor targets = ops::cat(
          {ops::narrow(tokens, 1, 1, S - 1), ops::full({tokens.shape()[0], 1}, -100.0, DType::I64)},
          1);
      Tensor local_targets = ops::reshape(shard_sequence(targets, 1, 2, r, l.load_balance), {-1});
      const double scored =
          ops::sum(ops::to(ops::ne(local_targets, -100.0), DType::F64)).item_double();
      const double total = static_cast<double>(tokens.shape()[0] * (S - 1));
      Tensor loss = mul(cross_entropy(reshape(logits, {-1, logits.shape()[2]}), local_targets),
                        scored / total);
      backward(loss);
      auto summed = [&](const Tensor& t) {
        WorkPtr w = pg->all_reduce(ops::clone(t), {});
        w->wait();
        return w->result();
      };
      if (e.empty()) e = compare(reshape(summed(loss), Shape{1}), ref.at("loss"), 1e-4, 0);
      int checked = 0;
      for (const auto& [pname, p] : model->named_parameters()) {
        if (!e.empty() || !ref.contains("grad." + pname)) continue;
        e = compare(summed(grad(p)), ref.at("grad." + pname), 1e-4, 1e-6);
        if (!e.empty()) e = pname + ": " + e;
        ++checked;
      }
      if (checked < 5) e += fmt::format(" only {} gradients checked", checked);
      errors[r] = e;
    });
    CHECK(errors[0] == "");
    CHECK(errors[1] == "");
  }
}

TEST_CASE("under tp 2 and ep 2 the fixtures give transformers' logits, loss and gradients",
          "[llama][tp][ep]") {
  for (const char* name : {"llama", "qwen2", "mixtral"}) {
    INFO(name);
    SafetensorsFile ref = load_safetensors(fixture(name) + "/reference.safetensors");
    const Tensor tokens = ref.at("input_ids");
    const int64_t B = tokens.shape()[0], S = tokens.shape()[1];
    // tp 2: each rank the whole batch, half the heads (and of a dense MLP);
    // a column-wise weight's gradient is its rows of the reference's, a
    // row-wise one's its columns.
    std::vector<std::string> errors(2);
    run_ranks(2, [&](ProcessGroupPtr pg) {
      const int r = pg->rank();
      auto model = load_fixture(name);
      parallelize_module(model, DeviceMesh(pg, {2}, {"tp"}), tensor_parallel_plan(model->config()));
      Tensor logits = nn::call_with_aux(*model, Args{tokens}).out;
      std::string e = compare(logits, ref.at("logits"), 1e-4, 1e-5);
      backward(causal_lm_loss(logits, tokens));
      for (const auto& [pname, p] : model->named_parameters()) {
        if (!e.empty() || !ref.contains("grad." + pname)) continue;
        Tensor want = ref.at("grad." + pname);
        if (pname.find("q_proj") != std::string::npos || pname.find("k_proj") != std::string::npos)
          want = ops::narrow(want, 0, r * p.shape()[0], p.shape()[0]);
        if (pname.find("down_proj") != std::string::npos)
          want = ops::narrow(want, 1, r * p.shape()[1], p.shape()[1]);
        e = compare(grad(p), want, 1e-4, 1e-6);
        if (!e.empty()) e = pname + ": " + e;
      }
      errors[r] = e;
    });
    CHECK(errors[0] == "");
    CHECK(errors[1] == "");
    if (std::string(name) != "mixtral") continue;
    // ep 2: rank r holds experts [2r, 2r + 2) and sequence r of the batch, as
    // a data rank does; each scores its half of the reference's tokens. An
    // expert's gradient is whole on its owner; the others' sum over ranks.
    run_ranks(2, [&](ProcessGroupPtr pg) {
      const int r = pg->rank();
      auto model = load_fixture(name);
      const DeviceMesh mesh(pg, {2}, {"ep"});
      for (int64_t i = 0; i < model->config().num_hidden_layers; ++i)
        expert_parallel(model->model()->layer(i)->block_sparse_moe(), mesh, {}, i);
      const Tensor mine = ops::narrow(tokens, 0, r, 1);
      Tensor logits = nn::call_with_aux(*model, Args{mine}).out;
      std::string e = compare(logits, ops::narrow(ref.at("logits"), 0, r, 1), 1e-4, 1e-5);
      backward(mul(causal_lm_loss(logits, mine), 1.0 / static_cast<double>(B)));
      int experts_checked = 0;
      for (const auto& [pname, p] : model->named_parameters()) {
        if (!ref.contains("grad." + pname)) continue;
        Tensor g = grad(p);
        if (pname.find(".experts.") != std::string::npos) {
          ++experts_checked;
        } else {
          WorkPtr w = pg->all_reduce(ops::clone(g), {});
          w->wait();
          g = w->result();
        }
        if (e.empty()) {
          e = compare(g, ref.at("grad." + pname), 1e-4, 1e-6);
          if (!e.empty()) e = pname + ": " + e;
        }
      }
      if (experts_checked != 6) e += fmt::format(" {} expert gradients checked", experts_checked);
      errors[r] = e;
    });
    CHECK(errors[0] == "");
    CHECK(errors[1] == "");
    CHECK(S > 1);
  }
}

TEST_CASE("Llama configs and checkpoints tandem cannot honour are refused by name", "[llama]") {
  std::ifstream in(fixture("llama") + "/config.json");
  const nlohmann::json base = nlohmann::json::parse(in);
  auto with = [&](const char* key, nlohmann::json value) {
    nlohmann::json j = base;
    j[key] = std::move(value);
    return j;
  };
  CHECK_THROWS_WITH(LlamaConfig::from_json(with("hidden_act", "gelu")),
                    Contains("field hidden_act: tandem implements silu, got 'gelu'"));
  CHECK_THROWS_WITH(
      LlamaConfig::from_json(with("rope_parameters", {{"rope_type", "yarn"}, {"factor", 4.0}})),
      Contains("rope_type: tandem implements default and llama3, got 'yarn'"));
  nlohmann::json mistral = with("model_type", "mistral");
  mistral["sliding_window"] = 4096;
  CHECK_THROWS_WITH(LlamaConfig::from_json(mistral), Contains("field sliding_window"));
  CHECK_THROWS_WITH(LlamaConfig::from_json(with("model_type", "gemma")),
                    Contains("model_type: expected llama, mistral, qwen2 or mixtral, got 'gemma'"));
  CHECK_THROWS_WITH(LlamaConfig::from_json(with("num_local_experts", 8)),
                    Contains("field num_local_experts: experts belong to model_type mixtral"));
  std::ifstream mixtral_in(fixture("mixtral") + "/config.json");
  const nlohmann::json mixtral = nlohmann::json::parse(mixtral_in);
  nlohmann::json jitter = mixtral;
  jitter["router_jitter_noise"] = 0.1;
  CHECK_THROWS_WITH(LlamaConfig::from_json(jitter), Contains("field router_jitter_noise"));
  nlohmann::json too_many = mixtral;
  too_many["num_experts_per_tok"] = 5;
  CHECK_THROWS_WITH(LlamaConfig::from_json(too_many),
                    Contains("num_experts_per_tok (5) <= num_local_experts (4)"));
  nlohmann::json windowed = mixtral;
  windowed["sliding_window"] = 128;
  CHECK_THROWS_WITH(LlamaConfig::from_json(windowed), Contains("field sliding_window"));
  const LlamaConfig m = LlamaConfig::from_json(mixtral);
  CHECK(LlamaConfig::from_json(m.to_json()).to_json() == m.to_json());
  CHECK(m.to_json()["architectures"][0] == "MixtralForCausalLM");
  nlohmann::json no_vocab = base;
  no_vocab.erase("vocab_size");
  CHECK_THROWS_WITH(LlamaConfig::from_json(no_vocab), Contains("field vocab_size"));
  CHECK_THROWS_WITH(LlamaConfig::from_json(with("num_key_value_heads", 3)),
                    Contains("divisible by num_key_value_heads (3)"));

  // A config wider than the checkpoint: the first tensor that differs is named.
  LlamaConfig wider = LlamaConfig::from_json(with("intermediate_size", 32));
  Generator gen(3);
  auto model = nn::make<LlamaForCausalLM>(wider, gen);
  CHECK_THROWS_WITH(load_hf_checkpoint(*model, fixture("llama")),
                    Contains("'model.layers.0.mlp.gate_proj.weight' has shape [24,16], the config "
                             "expects [32,16]"));
  // One layer more than stored: a missing tensor.
  auto deeper =
      nn::make<LlamaForCausalLM>(LlamaConfig::from_json(with("num_hidden_layers", 3)), gen);
  CHECK_THROWS_WITH(load_hf_checkpoint(*deeper, fixture("llama")),
                    Contains("has no tensor 'model.layers.2."));
  // One layer fewer: a tensor the config has no parameter for.
  auto shallower =
      nn::make<LlamaForCausalLM>(LlamaConfig::from_json(with("num_hidden_layers", 1)), gen);
  CHECK_THROWS_WITH(load_hf_checkpoint(*shallower, fixture("llama")),
                    Contains("holds tensor 'model.layers.1."));
  CHECK_THROWS_WITH(load_hf_checkpoint(*shallower, kFixtures), Contains("found neither"));
}
