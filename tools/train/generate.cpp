#include "tools/train/generate.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <numeric>
#include <random>

#include <nlohmann/json.hpp>

#include "tandem/autograd/nn/attention.h"
#include "tandem/autograd/nn/rope.h"
#include "tandem/autograd/node.h"
#include "tandem/runtime/error.h"
#include "tandem/tensor/ops.h"

namespace tandem::train {

namespace {

using Json = nlohmann::json;

// The last position's logits of (1, S, V), as f32 on the host.
std::vector<float> last_logits(const Tensor& logits) {
  const int64_t S = logits.shape()[1];
  Tensor row = ops::contiguous(ops::narrow(logits, 1, S - 1, 1));
  return ops::to(ops::to(row, DType::F32), Device::cpu()).to_vector<float>();
}

int64_t argmax(const std::vector<float>& logits) {
  return std::max_element(logits.begin(), logits.end()) - logits.begin();  // first of ties
}

Tensor token_tensor(const std::vector<int64_t>& ids, Device device) {
  Tensor t = ops::from_vector(ids, Shape{1, static_cast<int64_t>(ids.size())});
  return device.is_cpu() ? t : ops::to(t, device);
}

// A uniform double in [0, 1) from 53 random bits: the same on every platform
// (std::uniform_real_distribution is not).
double uniform(std::mt19937_64& rng) {
  return static_cast<double>(rng() >> 11) * 0x1.0p-53;
}

}  // namespace

int64_t sample_top_p(const std::vector<float>& logits, double temperature, double top_p, double u) {
  TANDEM_CHECK(!logits.empty(), "[generate] expected logits over a non-empty vocabulary");
  TANDEM_CHECK(temperature > 0 && std::isfinite(temperature),
               "[generate] expected a positive temperature, got {}", temperature);
  TANDEM_CHECK(top_p > 0 && top_p <= 1, "[generate] expected 0 < top_p <= 1, got {}", top_p);
  TANDEM_CHECK(u >= 0 && u < 1, "[generate] expected u in [0, 1), got {}", u);
  const double top = *std::max_element(logits.begin(), logits.end());
  std::vector<double> p(logits.size());
  double total = 0;
  for (size_t i = 0; i < logits.size(); ++i) {
    p[i] = std::exp((static_cast<double>(logits[i]) - top) / temperature);
    total += p[i];
  }
  std::vector<int64_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return p[a] > p[b]; });
  size_t kept = 0;
  double mass = 0;
  while (kept < order.size() && (kept == 0 || mass < top_p * total))
    mass += p[order[kept++]];
  double target = u * mass, run = 0;
  for (size_t i = 0; i < kept; ++i) {
    run += p[order[i]];
    if (target < run) return order[i];
  }
  return order[kept - 1];  // u * mass rounded up to the whole mass
}

Generation generate(LlamaForCausalLM& model, const std::vector<int64_t>& prompt,
                    const GenerateOptions& o) {
  TANDEM_CHECK(!prompt.empty(), "[generate] expected a prompt of at least one token");
  TANDEM_CHECK(o.max_new_tokens >= 0, "[generate] expected max_new_tokens >= 0, got {}",
               o.max_new_tokens);
  const int64_t vocab = model.config().vocab_size;
  for (size_t i = 0; i < prompt.size(); ++i) {
    TANDEM_CHECK(prompt[i] >= 0 && prompt[i] < vocab,
                 "[generate] expected prompt token ids in [0, {}), got {} at position {}", vocab,
                 prompt[i], i);
  }
  if (!o.greedy) sample_top_p({0.0f}, o.temperature, o.top_p, 0.0);  // checks the options
  const Device device = model.named_parameters().front().second.device();
  NoGradGuard no_grad;
  auto cache = std::make_shared<nn::KVCache>();
  std::mt19937_64 rng(o.seed);
  std::vector<int64_t> sequence = prompt;
  Generation out;
  for (int64_t t = 0; t < o.max_new_tokens; ++t) {
    Tensor logits;
    if (o.kv_cache) {
      // The prompt once, then each new token against the cached prefix.
      const std::vector<int64_t> fresh = t == 0 ? prompt : std::vector<int64_t>{sequence.back()};
      nn::KVCacheScope scope(cache);
      nn::PositionScope positions(
          nn::position_range(cache->length(), static_cast<int64_t>(fresh.size())));
      logits = nn::call_with_aux(model, Args{token_tensor(fresh, device)}).out;
    } else {
      logits = nn::call_with_aux(model, Args{token_tensor(sequence, device)}).out;
    }
    std::vector<float> last = last_logits(logits);
    const int64_t next =
        o.greedy ? argmax(last) : sample_top_p(last, o.temperature, o.top_p, uniform(rng));
    out.logits.push_back(std::move(last));
    out.tokens.push_back(next);
    sequence.push_back(next);
    if (std::find(o.stop_tokens.begin(), o.stop_tokens.end(), next) != o.stop_tokens.end()) {
      out.stopped = true;
      break;
    }
  }
  return out;
}

// ---- decoding ----

namespace {

// GPT-2's byte-level alphabet: printable bytes stand for themselves, the
// others for the code points 256, 257, … in byte order.
std::map<uint32_t, uint8_t> unicode_to_byte() {
  std::map<uint32_t, uint8_t> out;
  uint32_t next = 256;
  for (uint32_t b = 0; b < 256; ++b) {
    const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174;
    out[printable ? b : next++] = static_cast<uint8_t>(b);
  }
  return out;
}

// The code points of UTF-8 text (invalid bytes are taken as Latin-1).
std::vector<uint32_t> code_points(const std::string& s) {
  std::vector<uint32_t> out;
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    const int n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (n == 0 || i + n > s.size()) {
      out.push_back(c);
      ++i;
      continue;
    }
    uint32_t cp = n == 1 ? c : c & (0x7f >> n);
    for (int k = 1; k < n; ++k)
      cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3f);
    out.push_back(cp);
    i += n;
  }
  return out;
}

bool names_byte_level(const Json& j) {
  if (!j.is_object()) return false;
  if (j.value("type", "") == "ByteLevel") return true;
  for (const char* list : {"decoders", "pretokenizers"}) {
    if (j.contains(list) && j[list].is_array()) {
      for (const Json& d : j[list]) {
        if (names_byte_level(d)) return true;
      }
    }
  }
  return false;
}

}  // namespace

TokenDecoder TokenDecoder::from_file(const std::string& path) {
  std::ifstream in(path);
  TANDEM_CHECK(in.good(), "[generate] cannot read tokenizer file '{}'", path);
  const Json j = Json::parse(in, nullptr, false);
  TANDEM_CHECK(!j.is_discarded() && j.contains("model") && j["model"].contains("vocab"),
               "[generate] expected '{}' to be a tokenizer.json with model.vocab", path);
  TokenDecoder d;
  const Json& vocab = j["model"]["vocab"];
  if (vocab.is_object()) {  // BPE, WordPiece: token → id
    for (const auto& [piece, id] : vocab.items())
      d.pieces_[id.get<int64_t>()] = piece;
  } else {
    TANDEM_CHECK(vocab.is_array(),
                 "[generate] expected model.vocab in '{}' to be an object "
                 "or an array",
                 path);
    for (size_t id = 0; id < vocab.size(); ++id)  // Unigram: [piece, score] by id
      d.pieces_[static_cast<int64_t>(id)] = vocab[id][0].get<std::string>();
  }
  if (j.contains("added_tokens") && j["added_tokens"].is_array()) {
    for (const Json& t : j["added_tokens"]) {
      const int64_t id = t.at("id").get<int64_t>();
      d.pieces_[id] = t.at("content").get<std::string>();
      d.special_[id] = t.value("special", false);
    }
  }
  d.byte_level_ = names_byte_level(j.value("decoder", Json())) ||
                  names_byte_level(j.value("pre_tokenizer", Json()));
  return d;
}

std::string TokenDecoder::decode(const std::vector<int64_t>& ids) const {
  static const std::map<uint32_t, uint8_t> bytes_of = unicode_to_byte();
  std::string out;
  for (int64_t id : ids) {
    auto it = pieces_.find(id);
    TANDEM_CHECK(it != pieces_.end(), "[generate] token id {} is not in the tokenizer's vocabulary",
                 id);
    auto special = special_.find(id);
    if (special != special_.end()) {
      if (!special->second) out += it->second;  // added, not special: as written
      continue;
    }
    const std::string& piece = it->second;
    if (byte_level_) {
      for (uint32_t cp : code_points(piece)) {
        auto b = bytes_of.find(cp);
        TANDEM_CHECK(b != bytes_of.end(),
                     "[generate] token {} ('{}') holds a character outside the byte-level "
                     "alphabet",
                     id, piece);
        out.push_back(static_cast<char>(b->second));
      }
    } else if (piece.size() == 6 && piece.starts_with("<0x") && piece.back() == '>') {
      out.push_back(
          static_cast<char>(std::stoi(piece.substr(3, 2), nullptr, 16)));  // byte fallback
    } else {
      for (size_t i = 0; i < piece.size();) {
        if (piece.compare(i, 3, "\xe2\x96\x81") == 0) {  // "▁"
          out.push_back(' ');
          i += 3;
        } else {
          out.push_back(piece[i++]);
        }
      }
    }
  }
  if (!byte_level_ && !out.empty() && out.front() == ' ') out.erase(0, 1);
  return out;
}

}  // namespace tandem::train
