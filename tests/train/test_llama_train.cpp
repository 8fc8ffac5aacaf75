// tandem-train --model llama end to end, in-process on the threads backend:
// the tiny Llama fixture (tests/fixtures/hf/llama, made by transformers)
// fine-tuned on a token file lowers its loss alike under every layout; its
// checkpoints resume bit-exactly and export to a Hugging Face directory that
// loads back; options that cannot apply to a dense rotary model are refused.
#include <catch2/catch.hpp>

#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "tandem/tensor/io/safetensors.h"
#include "tandem/tensor/ops.h"
#include "tests/support/test_device.h"
#include "tests/support/test_util.h"
#include "tests/support/train_util.h"
#include "tools/train/data.h"
#include "tools/train/llama.h"
#include "tools/train/trainer.h"

using namespace tandem;
using namespace tandem::train;
using Catch::Matchers::Contains;
using tandem::test::losses;
using tandem::test::TempDir;
namespace fs = std::filesystem;

namespace {

const std::string kFixture = std::string(TANDEM_HF_FIXTURES) + "/llama";

// A text the 48-token fixture can learn: each character is one token.
std::string write_text_tokens(const TempDir& dir) {
  const std::string text =
      "the quick brown fox jumps over the lazy dog. a stitch in time saves nine. "
      "all that glitters is not gold. the early bird catches the worm. ";
  std::vector<int64_t> tokens;
  for (int repeat = 0; repeat < 40; ++repeat) {
    for (char c : text)
      tokens.push_back(1 + static_cast<unsigned char>(c) % 47);
  }
  const std::string path = (dir.path / "text.bin").string();
  write_token_file(path, tokens);
  return path;
}

TrainOptions llama_job(const std::string& data) {
  TrainOptions o;
  o.model_type = "llama";
  o.llama_config = kFixture + "/config.json";
  o.init_from = kFixture;
  o.data = data;
  o.seq_len = 32;
  o.ep = 1;
  o.cp = 1;
  o.overlap = false;
  o.micro_batches = 2;
  o.batch = 4;
  o.lr = 3e-3;
  o.min_lr = 3e-4;
  o.warmup = 20;
  o.progress = "quiet";
  o.device = test::test_device().is_cuda() ? "cuda" : "cpu";
  return o;
}

struct Layout {
  int dp, cp, tp;
  const char* mode;
  bool balance;
};

TrainOptions with_layout(TrainOptions o, const Layout& l) {
  o.dp = l.dp;
  o.cp = l.cp;
  o.tp = l.tp;
  o.cp_mode = l.mode;
  o.load_balance = l.balance;
  o.ulysses_degree = 2;
  o.batch = 4 / l.dp;  // the same global batch
  return o;
}

}  // namespace

TEST_CASE("fine-tuning the Llama fixture lowers the loss alike under every layout",
          "[train][llama][finetune]") {
  TempDir dir("llama-finetune");
  TrainOptions base = llama_job(write_text_tokens(dir));
  base.steps = 200;
  const std::vector<double> ref = losses(run_training(base));
  REQUIRE(ref.size() == 200);
  const double drop = ref.front() - ref.back();
  CHECK(drop > 1.0);  // it learns the text
  for (Layout l : {Layout{1, 2, 1, "ulysses", false}, Layout{1, 2, 1, "ring", true},
                   Layout{1, 1, 2, "ulysses", false}, Layout{1, 2, 2, "allgather", true},
                   Layout{1, 4, 1, "hybrid", false}, Layout{2, 1, 1, "ulysses", false},
                   Layout{2, 2, 1, "ring", false}}) {
    INFO("dp " << l.dp << " cp " << l.cp << " tp " << l.tp << " " << l.mode
               << (l.balance ? " load-balanced" : ""));
    const std::vector<double> got = losses(run_training(with_layout(base, l)));
    REQUIRE(got.size() == 200);
    // The target: the same drop within 2%.
    CHECK(std::abs((got.front() - got.back()) - drop) <= 0.02 * drop);
    // The same global batch however it is split (Note [Token files]): the
    // same losses, up to the order of f32 sums in the sharded attention,
    // projections and gradient reductions.
    for (size_t i = 0; i < got.size(); i += 20)
      CHECK(got[i] == Approx(ref[i]).epsilon(1e-3));
  }
}

TEST_CASE(
    "fine-tuning the Mixtral fixture lowers the loss alike with experts placed and overlapped",
    "[train][llama][finetune]") {
  TempDir dir("mixtral-finetune");
  TrainOptions base = llama_job(write_text_tokens(dir));
  base.llama_config = std::string(TANDEM_HF_FIXTURES) + "/mixtral/config.json";
  base.init_from = std::string(TANDEM_HF_FIXTURES) + "/mixtral";
  base.steps = 200;
  const std::vector<double> ref = losses(run_training(base));
  const double drop = ref.front() - ref.back();
  CHECK(drop > 0.5);
  struct ExpertLayout {
    int dp, ep, cp, tp;
    bool overlap;
  };
  for (ExpertLayout l : {ExpertLayout{1, 2, 1, 1, true}, ExpertLayout{1, 2, 2, 1, true},
                         ExpertLayout{1, 1, 2, 2, false}, ExpertLayout{2, 2, 1, 1, true}}) {
    INFO("dp " << l.dp << " ep " << l.ep << " cp " << l.cp << " tp " << l.tp
               << (l.overlap ? " overlapped" : ""));
    TrainOptions o = base;
    o.dp = l.dp;
    o.ep = l.ep;
    o.cp = l.cp;
    o.tp = l.tp;
    o.overlap = l.overlap;
    o.batch = 4 / (l.dp * l.ep);  // the same global batch
    const std::vector<double> got = losses(run_training(o));
    REQUIRE(got.size() == 200);
    CHECK(std::abs((got.front() - got.back()) - drop) <= 0.02 * drop);
    // The first step's sequences and weights are the one rank's.
    CHECK(got[0] == Approx(ref[0]).epsilon(1e-4));
  }
}

TEST_CASE("tandem-train --model llama: async context parallelism trains as the sync collectives",
          "[train][llama]") {
  // The rotary embedding moves into the projection hooks (Note [Rotary
  // before the exchange]): --cp-async auto runs AsyncContextParallel for the
  // Llama model too, with the synchronous layer's losses.
  TempDir dir("llama-async");
  const TrainOptions o = llama_job(write_text_tokens(dir));
  for (Layout l : {Layout{1, 2, 1, "ulysses", false}, Layout{1, 2, 1, "allgather", true},
                   Layout{1, 4, 1, "hybrid", false}, Layout{1, 2, 2, "allgather", false}}) {
    INFO("cp " << l.cp << " tp " << l.tp << " " << l.mode << (l.balance ? " load-balanced" : ""));
    TrainOptions a = with_layout(o, l);
    a.steps = 4;
    const TrainResult async = run_training(a);
    CHECK_THAT(async.layout, Contains(", async)"));
    a.cp_async = "off";
    const TrainResult sync = run_training(a);
    CHECK_THAT(sync.layout, !Contains("async"));
    REQUIRE(async.steps.size() == sync.steps.size());
    if (std::string(l.mode) == "hybrid") {  // K/V gradients summed in another order
      for (size_t i = 0; i < async.steps.size(); ++i)
        CHECK(async.steps[i].loss == Approx(sync.steps[i].loss).epsilon(1e-5));
    } else {
      CHECK(losses(async) == losses(sync));
    }
  }
}

TEST_CASE("tandem-train --model llama: sharded steps, bit-exact resume, Hugging Face export",
          "[train][llama][checkpoint]") {
  TempDir dir("llama-train");
  TrainOptions o = llama_job(write_text_tokens(dir));
  o.steps = 4;
  const std::vector<double> one_rank = losses(run_training(o));

  // cp 2 (load-balanced ring) x tp 2 on the same sequences: the same losses.
  TrainOptions sharded = with_layout(o, Layout{1, 2, 2, "ring", true});
  sharded.save_dir = (dir.path / "ckpt").string();
  sharded.save_every = 2;
  const std::vector<double> full = losses(run_training(sharded));
  REQUIRE(full.size() == 4);
  for (size_t i = 0; i < 4; ++i)
    CHECK(full[i] == Approx(one_rank[i]).epsilon(1e-4));

  // Resumed at step 2 on the same layout: bit-exact.
  TrainOptions resumed = sharded;
  resumed.save_dir.clear();
  resumed.save_every = 0;
  resumed.resume = (dir.path / "ckpt" / "step-00000002").string();
  const std::vector<double> rest = losses(run_training(resumed));
  REQUIRE(rest.size() == 2);
  CHECK(rest[0] == full[2]);
  CHECK(rest[1] == full[3]);

  // A resume with another model config is refused.
  TrainOptions other = resumed;
  other.llama_config = std::string(TANDEM_HF_FIXTURES) + "/qwen2/config.json";
  other.init_from.clear();
  CHECK_THROWS_WITH(run_training(other), Contains("holds a different model"));

  // Export: a Hugging Face directory the model loads back, trained (not the
  // fixture's weights), and in bf16 the f32 export's rounding.
  const fs::path f32_dir = dir.path / "hf-f32", bf16_dir = dir.path / "hf-bf16";
  export_checkpoint((dir.path / "ckpt").string(), f32_dir.string());
  export_checkpoint((dir.path / "ckpt").string(), bf16_dir.string(), DType::BF16);
  REQUIRE(fs::exists(f32_dir / "config.json"));
  const LlamaConfig config = LlamaConfig::from_file((f32_dir / "config.json").string());
  CHECK(config.to_json() == LlamaConfig::from_file(kFixture + "/config.json").to_json());
  Generator g(3);
  LlamaForCausalLM exported(config, g), fixture(config, g);
  load_hf_checkpoint(exported, f32_dir.string());
  load_hf_checkpoint(fixture, kFixture);
  const auto fixture_params = fixture.named_parameters();
  const auto exported_params = exported.named_parameters();
  REQUIRE(exported_params.size() == fixture_params.size());
  int changed = 0;
  for (size_t i = 0; i < exported_params.size(); ++i) {
    REQUIRE(exported_params[i].first == fixture_params[i].first);
    if (!ops::equal(exported_params[i].second, fixture_params[i].second)) ++changed;
  }
  CHECK(changed == static_cast<int>(fixture_params.size()));  // every tensor trained
  SafetensorsFile f32 = load_safetensors((f32_dir / "model.safetensors").string());
  SafetensorsFile bf16 = load_safetensors((bf16_dir / "model.safetensors").string());
  CHECK(bf16.size() == f32.size());
  for (const auto& [name, t] : f32.tensors()) {
    INFO(name);
    REQUIRE(bf16.contains(name));
    CHECK(bf16.at(name).dtype() == DType::BF16);
    CHECK(ops::equal(bf16.at(name), ops::to(t, DType::BF16)));
  }
}

TEST_CASE("tandem-train --model llama refuses what a dense rotary model cannot do",
          "[train][llama]") {
  TempDir dir("llama-refusals");
  const TrainOptions o = llama_job(write_text_tokens(dir));
  auto refused = [&](TrainOptions bad, const std::string& message) {
    INFO(message);
    CHECK_THROWS_WITH(run_training(bad), Contains(message));
  };
  TrainOptions ep = o;
  ep.ep = 2;
  refused(ep, "with a dense config (llama) has no experts to place: expected --ep 1, got 2");
  TrainOptions overlap = o;
  overlap.overlap = true;
  refused(overlap, "this --model llama has no experts: expected --no-overlap");
  TrainOptions tp = with_layout(o, Layout{1, 1, 4, "ulysses", false});
  refused(tp, "expected --tp 4 to divide the config's 4 attention heads, 2 KV heads");
  TrainOptions no_config = o;
  no_config.llama_config.clear();
  refused(no_config, "--model llama expects --config CONFIG.JSON");
  TrainOptions no_data = o;
  no_data.data.clear();
  refused(no_data, "expected --data TOKENS.BIN");
  TrainOptions moe_with_config = o;
  moe_with_config.model_type = "moe";
  moe_with_config.data.clear();
  refused(moe_with_config, "--config and --init-from apply to --model llama");
  TrainOptions wrong_weights = o;
  wrong_weights.init_from = std::string(TANDEM_HF_FIXTURES) + "/qwen2";
  refused(wrong_weights, "[llama::load]");
}
