// Generation with the Llama family (tools/train/generate.h): greedy decoding
// with the KV cache gives the tokens transformers' generate gave for the
// fixtures (tools/hf_fixtures.py), the cache changes nothing but the work,
// top-p sampling keeps the nucleus it promises, and token ids decode to the
// text the Hugging Face tokenizers give.
#include <catch2/catch.hpp>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tandem/autograd/nn/attention.h"
#include "tandem/autograd/nn/rope.h"
#include "tandem/tensor/io/safetensors.h"
#include "tandem/tensor/ops.h"
#include "tools/train/generate.h"

using namespace tandem;
using namespace tandem::train;
using Catch::Matchers::Contains;

namespace {

const std::string kFixtures = TANDEM_HF_FIXTURES;

std::shared_ptr<LlamaForCausalLM> load(const std::string& name) {
  const std::string dir = kFixtures + "/" + name;
  Generator gen(1);
  auto model = nn::make<LlamaForCausalLM>(LlamaConfig::from_file(dir + "/config.json"), gen);
  load_hf_checkpoint(*model, dir);
  return model;
}

}  // namespace

TEST_CASE("greedy generation with the KV cache gives transformers' tokens", "[generate]") {
  for (const char* name : {"llama", "llama3-scaled", "qwen2", "mixtral"}) {
    INFO(name);
    auto model = load(name);
    SafetensorsFile ref = load_safetensors(kFixtures + "/" + name + "/reference.safetensors");
    const std::vector<int64_t> prompt = ref.at("generate.prompt").to_vector<int64_t>();
    const std::vector<int64_t> want = ref.at("generate.greedy").to_vector<int64_t>();
    GenerateOptions o;
    o.max_new_tokens = static_cast<int64_t>(want.size());
    const Generation g = generate(*model, prompt, o);
    CHECK(g.tokens == want);
    CHECK_FALSE(g.stopped);
  }
}

TEST_CASE("the KV cache changes the work, not the result", "[generate]") {
  auto model = load("qwen2");  // biases and tied embeddings on the cached path too
  const std::vector<int64_t> prompt = {3, 14, 15, 9};
  for (bool greedy : {true, false}) {
    INFO((greedy ? "greedy" : "top-p 0.8"));
    GenerateOptions o;
    o.max_new_tokens = 40;  // past the cache's first capacity: it grows
    o.greedy = greedy;
    o.top_p = 0.8;
    o.seed = 11;
    const Generation cached = generate(*model, prompt, o);
    o.kv_cache = false;
    const Generation whole = generate(*model, prompt, o);
    REQUIRE(cached.tokens.size() == 40);
    CHECK(cached.tokens == whole.tokens);
    double worst = 0;
    for (size_t t = 0; t < cached.logits.size(); ++t) {
      for (size_t v = 0; v < cached.logits[t].size(); ++v)
        worst = std::max(worst, std::abs(double(cached.logits[t][v]) - whole.logits[t][v]));
    }
    CHECK(worst < 1e-4);
  }
  // Stop tokens end the generation after the first one emitted.
  GenerateOptions o;
  o.max_new_tokens = 40;
  const Generation all = generate(*model, prompt, o);
  o.stop_tokens = {all.tokens[5]};
  const Generation stopped = generate(*model, prompt, o);
  CHECK(stopped.stopped);
  CHECK(stopped.tokens.back() == all.tokens[5]);
  CHECK(stopped.tokens.size() <= 6);
}

TEST_CASE("a KV cache is for inference and for plain attention", "[generate]") {
  auto model = load("llama");
  auto cache = std::make_shared<nn::KVCache>();
  nn::KVCacheScope scope(cache);
  Tensor tokens = ops::from_vector(std::vector<int64_t>{1, 2, 3}, Shape{1, 3});
  CHECK_THROWS_WITH((*model)(tokens), Contains("a KVCacheScope is for inference"));
  {
    NoGradGuard no_grad;
    (*model)(tokens);
    CHECK(cache->length() == 3);
    // A batch of another size does not extend what is cached.
    Tensor two = ops::from_vector(std::vector<int64_t>{1, 2, 3, 4}, Shape{2, 2});
    CHECK_THROWS_WITH((*model)(two), Contains("expected keys of shape (B 1"));
    cache->clear();
    CHECK(cache->length() == 0);
  }
}

TEST_CASE("top-p sampling draws from the nucleus it promises", "[generate]") {
  const std::vector<float> logits = {std::log(0.5f), std::log(0.3f), std::log(0.15f),
                                     std::log(0.05f)};
  // top_p 1: the cumulative distribution 0.5, 0.8, 0.95, 1.
  CHECK(sample_top_p(logits, 1.0, 1.0, 0.0) == 0);
  CHECK(sample_top_p(logits, 1.0, 1.0, 0.49) == 0);
  CHECK(sample_top_p(logits, 1.0, 1.0, 0.51) == 1);
  CHECK(sample_top_p(logits, 1.0, 1.0, 0.9) == 2);
  CHECK(sample_top_p(logits, 1.0, 1.0, 0.97) == 3);
  // top_p 0.75: tokens 0 and 1 (0.8 >= 0.75), renormalised to 0.625, 0.375.
  CHECK(sample_top_p(logits, 1.0, 0.75, 0.6) == 0);
  CHECK(sample_top_p(logits, 1.0, 0.75, 0.64) == 1);
  CHECK(sample_top_p(logits, 1.0, 0.75, 0.999) == 1);
  // A tiny top_p keeps the most probable token only: greedy.
  CHECK(sample_top_p(logits, 1.0, 1e-6, 0.999) == 0);
  // A low temperature sharpens: p0 ~ 0.5^10 / (0.5^10 + 0.3^10 + ...) > 0.99.
  CHECK(sample_top_p(logits, 0.1, 1.0, 0.99) == 0);
  // Ties go to the lower id first.
  CHECK(sample_top_p({1.0f, 1.0f}, 1.0, 1.0, 0.4) == 0);
  CHECK(sample_top_p({1.0f, 1.0f}, 1.0, 1.0, 0.6) == 1);
  CHECK_THROWS_WITH(sample_top_p(logits, 0.0, 1.0, 0.5), Contains("positive temperature, got 0"));
  CHECK_THROWS_WITH(sample_top_p(logits, 1.0, 1.5, 0.5), Contains("0 < top_p <= 1, got 1.5"));
  CHECK_THROWS_WITH(sample_top_p({}, 1.0, 1.0, 0.5), Contains("non-empty vocabulary"));

  auto model = load("llama");
  GenerateOptions o;
  o.greedy = false;
  o.seed = 5;
  o.max_new_tokens = 12;
  const std::vector<int64_t> prompt = {7, 8};
  const Generation a = generate(*model, prompt, o), b = generate(*model, prompt, o);
  CHECK(a.tokens == b.tokens);  // a pure function of the seed
  o.seed = 6;
  CHECK(generate(*model, prompt, o).tokens != a.tokens);
  o.top_p = 1e-6;  // the nucleus is the argmax: greedy
  GenerateOptions greedy;
  greedy.max_new_tokens = 12;
  CHECK(generate(*model, prompt, o).tokens == generate(*model, prompt, greedy).tokens);
  CHECK_THROWS_WITH(generate(*model, {48}, greedy),
                    Contains("prompt token ids in [0, 48), got 48 at position 0"));
  CHECK_THROWS_WITH(generate(*model, {}, greedy), Contains("a prompt of at least one token"));
}

TEST_CASE("token ids decode to the text the Hugging Face tokenizers give", "[generate]") {
  for (const char* name : {"byte-level", "metaspace"}) {
    INFO(name);
    const std::string dir = kFixtures + "/tokenizers/" + name;
    const TokenDecoder decoder = TokenDecoder::from_file(dir + "/tokenizer.json");
    CHECK(decoder.byte_level() == (std::string(name) == "byte-level"));
    std::ifstream in(dir + "/decode.json");
    const nlohmann::json cases = nlohmann::json::parse(in);
    REQUIRE(cases.size() == 4);
    for (const auto& c : cases) {
      const std::string want = c["text"].get<std::string>();
      INFO(want);
      CHECK(decoder.decode(c["ids"].get<std::vector<int64_t>>()) == want);
    }
    CHECK_THROWS_WITH(decoder.decode({100000}), Contains("token id 100000 is not in the"));
  }
  CHECK_THROWS_WITH(TokenDecoder::from_file(kFixtures + "/llama/config.json"),
                    Contains("to be a tokenizer.json with model.vocab"));
}
