// tandem-generate: what a Llama-family checkpoint says. Reads a Hugging Face
// checkpoint directory (one that `tandem-train export` wrote, or a
// transformers save_pretrained), continues a prompt greedily or with top-p
// sampling and a KV cache (tools/train/generate.h), and prints the text when
// the directory (or --tokenizer) has a tokenizer.json, else the token ids.
//
//   python3 tools/tokenize_text.py --tokenizer DIR --prompt "Once upon a time" -o prompt.bin
//   tandem-generate DIR --prompt-file prompt.bin --max-new-tokens 64 --top-p 0.9
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tandem/runtime/device.h"
#include "tools/train/data.h"
#include "tools/train/generate.h"

namespace {

using namespace tandem;
using namespace tandem::train;
namespace fs = std::filesystem;

// The config's eos_token_id: one id or a list.
std::vector<int64_t> eos_tokens(const std::string& config_path) {
  std::ifstream in(config_path);
  const nlohmann::json j = nlohmann::json::parse(in, nullptr, false);
  std::vector<int64_t> out;
  if (j.is_discarded() || !j.contains("eos_token_id")) return out;
  const nlohmann::json& e = j["eos_token_id"];
  if (e.is_number_integer()) out.push_back(e.get<int64_t>());
  if (e.is_array()) {
    for (const auto& id : e) {
      if (id.is_number_integer()) out.push_back(id.get<int64_t>());
    }
  }
  return out;
}

int run(int argc, char** argv) {
  std::string dir, prompt_tokens, prompt_file, tokenizer, device = "cpu", dtype = "f32";
  GenerateOptions o;
  bool sample = false, no_cache = false, ignore_eos = false;
  CLI::App app{
      "tandem-generate: continues a prompt with a Llama-family checkpoint (greedy, or "
      "top-p sampling), with a KV cache",
      "tandem-generate"};
  app.add_option("model", dir, "Hugging Face checkpoint directory (config.json, safetensors)")
      ->required();
  app.add_option("--prompt-tokens", prompt_tokens, "the prompt as token ids: 1,15,27");
  app.add_option("--prompt-file", prompt_file,
                 "the prompt as a token file (tools/tokenize_text.py writes one)");
  app.add_option("--max-new-tokens", o.max_new_tokens, "tokens to generate")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 20));
  app.add_flag("--sample", sample, "sample (top-p) instead of greedy decoding");
  app.add_option("--temperature", o.temperature, "sampling temperature")
      ->check(CLI::PositiveNumber);
  app.add_option("--top-p", o.top_p, "sampling: nucleus mass (implies --sample)")
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--seed", o.seed, "sampling seed");
  app.add_flag("--no-cache", no_cache, "recompute the whole sequence for every token");
  app.add_flag("--ignore-eos", ignore_eos, "do not stop at the config's eos_token_id");
  app.add_option("--tokenizer", tokenizer, "tokenizer.json (default: the model directory's)");
  app.add_option("--device", device, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--dtype", dtype, "compute in f32 or bf16")->check(CLI::IsMember({"f32", "bf16"}));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  if (app.count("--top-p") || app.count("--temperature")) sample = true;
  o.greedy = !sample;
  o.kv_cache = !no_cache;

  std::vector<int64_t> prompt;
  if (!prompt_file.empty()) {
    TokenFile f(prompt_file);
    for (int64_t i = 0; i < f.size(); ++i)
      prompt.push_back(f[i]);
  }
  for (size_t start = 0; start < prompt_tokens.size();) {
    size_t end = prompt_tokens.find(',', start);
    if (end == std::string::npos) end = prompt_tokens.size();
    const std::string id = prompt_tokens.substr(start, end - start);
    size_t used = 0;
    int64_t value = -1;
    try {
      value = std::stoll(id, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    TANDEM_CHECK(used == id.size() && !id.empty(),
                 "[generate] expected --prompt-tokens as comma-separated ids, got '{}'",
                 prompt_tokens);
    prompt.push_back(value);
    start = end + 1;
  }
  TANDEM_CHECK(!prompt.empty(),
               "[generate] expected a prompt: --prompt-tokens IDS or --prompt-file TOKENS.BIN");

  const std::string config_path = (fs::path(dir) / "config.json").string();
  const LlamaConfig config = LlamaConfig::from_file(config_path);
  Generator gen(0);
  auto model = nn::make<LlamaForCausalLM>(config, gen);
  load_hf_checkpoint(*model, dir);
  if (dtype == "bf16") model->to(DType::BF16);
  if (device == "cuda") model->to(Device::cuda(0));
  if (!ignore_eos) o.stop_tokens = eos_tokens(config_path);
  if (tokenizer.empty() && fs::exists(fs::path(dir) / "tokenizer.json"))
    tokenizer = (fs::path(dir) / "tokenizer.json").string();

  const auto start = std::chrono::steady_clock::now();
  const Generation g = generate(*model, prompt, o);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (!tokenizer.empty()) {
    const TokenDecoder decoder = TokenDecoder::from_file(tokenizer);
    fmt::print("{}{}\n", decoder.decode(prompt), decoder.decode(g.tokens));
  } else {
    fmt::print("prompt: {}\ngenerated: {}\n", fmt::join(prompt, " "), fmt::join(g.tokens, " "));
  }
  fmt::print(
      stderr, "tandem-generate: {} tokens in {:.2f} s ({:.1f} tokens/s, {}, {}{})\n",
      g.tokens.size(), seconds, static_cast<double>(g.tokens.size()) / seconds,
      o.greedy ? "greedy" : fmt::format("top-p {} at temperature {}", o.top_p, o.temperature),
      o.kv_cache ? "KV cache" : "no cache", g.stopped ? ", stopped at eos" : "");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    fmt::print(stderr, "tandem-generate: error: {}\n", e.what());
    return 1;
  }
}
