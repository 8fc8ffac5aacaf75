#include "tandem/parallel/checkpoint.h"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>

#include "tandem/runtime/error.h"
#include "tandem/tensor/io/file_io.h"
#include "tandem/tensor/io/safetensors.h"
#include "tandem/tensor/ops.h"

namespace tandem {

namespace fs = std::filesystem;
using Json = nlohmann::json;

namespace {

constexpr const char* kFormat = "tandem-checkpoint-1";
constexpr const char* kPiecesKey = "tandem.pieces";

std::mutex g_hook_mu;
std::function<void(const std::string&)> g_fault_hook;

void fault_point(const std::string& stage) {
  std::function<void(const std::string&)> hook;
  {
    std::lock_guard<std::mutex> lock(g_hook_mu);
    hook = g_fault_hook;
  }
  if (hook) hook(stage);
}

std::string step_dir_name(int64_t step) {
  return fmt::format("step-{:08d}", step);
}

void write_text_atomically(const std::string& path, const std::string& text) {
  write_file_atomically(path, [&](FileWriter& w) { w.write(text.data(), text.size()); });
}

std::string read_text(const fs::path& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  TANDEM_CHECK(in.good(), "[checkpoint] expected {} at '{}', cannot open it: {}", what,
               path.string(), std::strerror(errno));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void barrier(const ProcessGroupPtr& world, const char* tag) {
  world->barrier({std::string("checkpoint ") + tag})->synchronize();
}

// Complete checkpoints under root, by step.
std::vector<std::pair<int64_t, fs::path>> complete_checkpoints(const fs::path& root) {
  std::vector<std::pair<int64_t, fs::path>> out;
  for (const auto& entry : fs::directory_iterator(root)) {
    const std::string name = entry.path().filename().string();
    if (!entry.is_directory() || name.rfind("step-", 0) != 0 || name.size() != 13) continue;
    if (!fs::exists(entry.path() / "checkpoint.json")) continue;
    try {
      out.emplace_back(std::stoll(name.substr(5)), entry.path());
    } catch (const std::exception&) {
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

// A saved block of a tensor in one file.
struct SavedBlock {
  const Tensor* data = nullptr;
  std::vector<int64_t> offsets;
};
struct SavedTensor {
  Shape global_shape;
  std::vector<SavedBlock> blocks;
  std::string first_file;
};

struct Index {
  std::vector<SafetensorsFile> files;
  std::map<std::string, SavedTensor> tensors;
};

Index read_index(const CheckpointInfo& info) {
  Index index;
  index.files.reserve(info.files.size());
  for (const std::string& file : info.files) {
    const std::string path = (fs::path(info.path) / file).string();
    index.files.push_back(load_safetensors(path));
    const SafetensorsFile& f = index.files.back();
    auto it = f.metadata().find(kPiecesKey);
    TANDEM_CHECK(it != f.metadata().end(),
                 "[checkpoint] expected '{}' metadata in '{}' (a tandem checkpoint file), got "
                 "none",
                 kPiecesKey, path);
    Json pieces;
    try {
      pieces = Json::parse(it->second);
    } catch (const Json::exception& e) {
      TANDEM_FAIL("[checkpoint] expected JSON in the '{}' metadata of '{}', got a parse error: {}",
                  kPiecesKey, path, e.what());
    }
    for (const auto& [name, t] : f.tensors()) {
      TANDEM_CHECK(pieces.is_object() && pieces.contains(name),
                   "[checkpoint] expected a piece description of '{}' in '{}', got none", name,
                   path);
      const Json& p = pieces[name];
      Shape global;
      std::vector<int64_t> offsets;
      try {
        global = Shape(p.at("global_shape").get<std::vector<int64_t>>());
        offsets = p.at("offsets").get<std::vector<int64_t>>();
      } catch (const Json::exception& e) {
        TANDEM_FAIL("[checkpoint] bad piece description of '{}' in '{}': {}", name, path, e.what());
      }
      TANDEM_CHECK(static_cast<int64_t>(offsets.size()) == t.dim() && global.size() == t.dim(),
                   "[checkpoint] piece '{}' in '{}': expected offsets and a global shape of rank "
                   "{}, got {} offsets and {}",
                   name, path, t.dim(), offsets.size(), global);
      for (int64_t d = 0; d < t.dim(); ++d) {
        TANDEM_CHECK(offsets[d] >= 0 && offsets[d] + t.shape()[d] <= global[d],
                     "[checkpoint] piece '{}' in '{}': block {} at offsets {} lies outside the "
                     "global shape {}",
                     name, path, t.shape(), fmt::join(offsets, ","), global);
      }
      auto [slot, fresh] = index.tensors.try_emplace(name);
      if (fresh) {
        slot->second.global_shape = global;
        slot->second.first_file = file;
      }
      TANDEM_CHECK(slot->second.global_shape == global,
                   "[checkpoint] tensor '{}': expected the same global shape in every file, got "
                   "{} in '{}' and {} in '{}'",
                   name, slot->second.global_shape, slot->second.first_file, global, file);
      slot->second.blocks.push_back({&t, offsets});
    }
  }
  return index;
}

// Copies the parts of `saved` that fall inside the block of `dst` at
// `dst_offsets`; marks the covered elements in `covered` (row-major over dst).
void copy_overlap(const SavedBlock& saved, Tensor& dst, const std::vector<int64_t>& dst_offsets,
                  std::vector<uint8_t>& covered) {
  const int64_t nd = dst.dim();
  std::vector<int64_t> lo(static_cast<size_t>(nd)), len(static_cast<size_t>(nd));
  for (int64_t d = 0; d < nd; ++d) {
    const int64_t a = std::max(dst_offsets[d], saved.offsets[d]);
    const int64_t b =
        std::min(dst_offsets[d] + dst.shape()[d], saved.offsets[d] + saved.data->shape()[d]);
    if (b <= a) return;
    lo[d] = a;
    len[d] = b - a;
  }
  Tensor src = *saved.data, view = dst;
  for (int64_t d = 0; d < nd; ++d) {
    src = ops::narrow(src, d, lo[d] - saved.offsets[d], len[d]);
    view = ops::narrow(view, d, lo[d] - dst_offsets[d], len[d]);
  }
  ops::copy_(view, src.dtype() == dst.dtype() ? src : ops::to(src, dst.dtype()));
  // Mark the region (an odometer over it).
  if (nd == 0) {
    covered[0] = 1;
    return;
  }
  std::vector<int64_t> idx(static_cast<size_t>(nd), 0);
  while (true) {
    int64_t flat = 0;
    for (int64_t d = 0; d < nd; ++d)
      flat = flat * dst.shape()[d] + (lo[d] - dst_offsets[d] + idx[d]);
    covered[static_cast<size_t>(flat)] = 1;
    int64_t d = nd - 1;
    while (d >= 0 && ++idx[d] == len[d]) {
      idx[d] = 0;
      --d;
    }
    if (d < 0) break;
  }
}

void fill_from(const SavedTensor& saved, const std::string& name, Tensor& dst,
               const std::vector<int64_t>& offsets, const std::string& where) {
  std::vector<uint8_t> covered(static_cast<size_t>(std::max<int64_t>(dst.numel(), 1)), 0);
  for (const SavedBlock& b : saved.blocks)
    copy_overlap(b, dst, offsets, covered);
  const int64_t missing =
      dst.numel() - std::count(covered.begin(), covered.begin() + dst.numel(), uint8_t{1});
  TANDEM_CHECK(missing == 0,
               "[checkpoint] tensor '{}': expected the saved blocks to cover the requested block "
               "{} at offsets ({}), got {} elements missing in {}",
               name, dst.shape(), fmt::join(offsets, ","), missing, where);
}

}  // namespace

void set_checkpoint_fault_hook(std::function<void(const std::string& stage)> hook) {
  std::lock_guard<std::mutex> lock(g_hook_mu);
  g_fault_hook = std::move(hook);
}

std::string save_checkpoint(const std::string& root_path, int64_t step,
                            const std::vector<TensorPiece>& pieces,
                            const std::map<std::string, std::string>& meta,
                            const ProcessGroupPtr& world, int keep) {
  TANDEM_CHECK(step >= 0 && keep >= 1,
               "[checkpoint] expected step >= 0 and keep >= 1, got step {} and keep {}", step,
               keep);
  const fs::path root(root_path);
  const fs::path final_dir = root / step_dir_name(step);
  const fs::path tmp_dir = root / (step_dir_name(step) + ".tmp");
  const int rank = world->rank(), size = world->size();
  if (rank == 0) {
    std::error_code ec;
    fs::create_directories(root, ec);
    TANDEM_CHECK(!ec && fs::is_directory(root),
                 "[checkpoint] cannot create the checkpoint directory '{}': {}", root.string(),
                 ec.message());
    for (const auto& entry : fs::directory_iterator(root)) {  // left by a crashed save
      const std::string name = entry.path().filename().string();
      if (name.rfind("step-", 0) == 0 && name.size() > 4 && name.substr(name.size() - 4) == ".tmp")
        fs::remove_all(entry.path());
    }
    fs::create_directories(tmp_dir);
  }
  barrier(world, "directory");

  const std::string file = fmt::format("rank-{:05d}-of-{:05d}.safetensors", rank, size);
  std::vector<std::pair<std::string, Tensor>> tensors;
  Json described = Json::object();
  for (const TensorPiece& p : pieces) {
    if (!p.write) continue;
    std::vector<int64_t> offsets =
        p.offsets.empty() ? std::vector<int64_t>(static_cast<size_t>(p.local.dim()), 0) : p.offsets;
    TANDEM_CHECK(static_cast<int64_t>(offsets.size()) == p.local.dim() &&
                     p.global_shape.size() == p.local.dim(),
                 "[checkpoint] piece '{}': expected offsets and a global shape of rank {}, got {} "
                 "offsets and {}",
                 p.name, p.local.dim(), offsets.size(), p.global_shape);
    described[p.name] = {{"global_shape", p.global_shape.vec()}, {"offsets", offsets}};
    tensors.emplace_back(p.name, p.local);
  }
  save_safetensors((tmp_dir / file).string(), tensors, {{kPiecesKey, described.dump()}});
  fault_point("files");
  barrier(world, "files");
  fault_point("barrier");

  if (rank == 0) {
    Json files = Json::array();
    for (int r = 0; r < size; ++r)
      files.push_back(fmt::format("rank-{:05d}-of-{:05d}.safetensors", r, size));
    Json doc = {{"format", kFormat},
                {"step", step},
                {"world_size", size},
                {"files", files},
                {"meta", meta}};
    write_text_atomically((tmp_dir / "checkpoint.json").string(), doc.dump(2) + "\n");
    fault_point("meta");
    if (fs::exists(final_dir)) fs::remove_all(final_dir);  // the same step saved again
    fs::rename(tmp_dir, final_dir);
    sync_directory(root.string(), "checkpoint::save");
    fault_point("renamed");
    write_text_atomically((root / "latest").string(), step_dir_name(step) + "\n");
    fault_point("latest");
    auto done = complete_checkpoints(root);
    for (size_t i = 0; i + static_cast<size_t>(keep) < done.size(); ++i)
      fs::remove_all(done[i].second);
  }
  barrier(world, "done");
  return final_dir.string();
}

CheckpointInfo find_checkpoint(const std::string& path) {
  fs::path dir(path);
  TANDEM_CHECK(fs::is_directory(dir),
               "[checkpoint] expected a checkpoint directory at '{}', got {}", path,
               fs::exists(dir) ? "something that is not a directory" : "nothing");
  if (!fs::exists(dir / "checkpoint.json")) {
    TANDEM_CHECK(fs::exists(dir / "latest"),
                 "[checkpoint] expected '{}' to hold checkpoint.json (a step directory) or "
                 "'latest' (a checkpoint root), got neither",
                 path);
    std::string name = read_text(dir / "latest", "the name of the latest checkpoint");
    name.erase(name.find_last_not_of(" \n\r\t") + 1);
    TANDEM_CHECK(!name.empty() && name.find('/') == std::string::npos,
                 "[checkpoint] expected '{}' to name a step directory, got '{}'",
                 (dir / "latest").string(), name);
    dir /= name;
    TANDEM_CHECK(fs::exists(dir / "checkpoint.json"),
                 "[checkpoint] '{}' names '{}', which holds no checkpoint.json",
                 (fs::path(path) / "latest").string(), dir.string());
  }
  const std::string text = read_text(dir / "checkpoint.json", "checkpoint.json");
  CheckpointInfo info;
  info.path = dir.string();
  try {
    Json doc = Json::parse(text);
    TANDEM_CHECK(doc.at("format").get<std::string>() == kFormat,
                 "[checkpoint] expected format '{}' in '{}', got '{}'", kFormat,
                 (dir / "checkpoint.json").string(), doc.at("format").get<std::string>());
    info.step = doc.at("step").get<int64_t>();
    info.world_size = doc.at("world_size").get<int>();
    info.files = doc.at("files").get<std::vector<std::string>>();
    info.meta = doc.at("meta").get<std::map<std::string, std::string>>();
  } catch (const Json::exception& e) {
    TANDEM_FAIL("[checkpoint] expected a valid checkpoint.json in '{}', got: {}", dir.string(),
                e.what());
  }
  TANDEM_CHECK(!info.files.empty() && static_cast<int>(info.files.size()) == info.world_size,
               "[checkpoint] '{}': expected one file per rank ({}), got {}", dir.string(),
               info.world_size, info.files.size());
  for (const std::string& f : info.files) {
    TANDEM_CHECK(f.find('/') == std::string::npos && fs::exists(dir / f),
                 "[checkpoint] '{}' lists '{}', which is missing", dir.string(), f);
  }
  return info;
}

void load_checkpoint(const CheckpointInfo& info, std::vector<TensorPiece>& pieces) {
  Index index = read_index(info);
  for (TensorPiece& p : pieces) {
    auto it = index.tensors.find(p.name);
    TANDEM_CHECK(it != index.tensors.end(), "[checkpoint] expected tensor '{}' in '{}', got none",
                 p.name, info.path);
    TANDEM_CHECK(it->second.global_shape == p.global_shape,
                 "[checkpoint] tensor '{}': expected global shape {}, the checkpoint has {}",
                 p.name, p.global_shape, it->second.global_shape);
    std::vector<int64_t> offsets =
        p.offsets.empty() ? std::vector<int64_t>(static_cast<size_t>(p.local.dim()), 0) : p.offsets;
    fill_from(it->second, p.name, p.local, offsets, info.path);
  }
}

void consolidate_checkpoint(const CheckpointInfo& info, const std::string& out_path,
                            const std::string& prefix) {
  Index index = read_index(info);
  std::vector<std::pair<std::string, Tensor>> whole;
  for (auto& [name, saved] : index.tensors) {
    if (name.rfind(prefix, 0) != 0) continue;
    Tensor t = ops::zeros(saved.global_shape, saved.blocks[0].data->dtype());
    fill_from(saved, name, t, std::vector<int64_t>(static_cast<size_t>(t.dim()), 0), info.path);
    whole.emplace_back(name.substr(prefix.size()), t);
  }
  TANDEM_CHECK(!whole.empty(), "[checkpoint] expected tensors named '{}…' in '{}', got none",
               prefix, info.path);
  save_safetensors(out_path, whole, {{"format", "pt"}, {"tandem.source", info.path}});
}

}  // namespace tandem
