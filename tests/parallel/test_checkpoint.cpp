// Distributed checkpoints (parallel/checkpoint.h): pieces saved under one
// layout load bit-exactly under another, consolidate into whole tensors, and
// a save that dies at any stage leaves the previous checkpoint loadable.
//
// The ranks save pieces on test_device() (tests/support/test_device.h) and
// loads fill pieces there; the expected pieces are built on the CPU, and what
// was loaded must equal them bit for bit.
#include <catch2/catch.hpp>

#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iostream>

#include "tandem/comm/threads/threads_backend.h"
#include "tandem/parallel/checkpoint.h"
#include "tandem/parallel/placement.h"
#include "tandem/tensor/io/safetensors.h"
#include "tandem/tensor/ops.h"
#include "tests/support/rank_checks.h"
#include "tests/support/test_device.h"
#include "tests/support/test_util.h"

using namespace tandem;
using tandem::test::TempDir;
namespace fs = std::filesystem;

namespace {

// The whole tensors of the test state.
Tensor whole_a() {
  return ops::reshape(ops::arange(0, 6 * 10, 1, DType::F32), Shape{6, 10});
}
Tensor whole_b() {
  return ops::reshape(ops::arange(100, 100 + 4 * 3 * 5, 1, DType::F64), Shape{4, 3, 5});
}

// Rank r's pieces when `a` is split over `parts` ranks along `dim_a` and `b`
// along dim 2; `b` is replicated except for the split, `c` (a scalar) is a
// replica written only by rank 0.
std::vector<TensorPiece> pieces_for(int rank, int parts, int dim_a) {
  std::vector<TensorPiece> out;
  Tensor a = whole_a(), b = whole_b();
  auto [a0, a_len] = chunk_range(a.shape()[dim_a], parts, rank);
  std::vector<int64_t> offs_a = {0, 0};
  offs_a[dim_a] = a0;
  out.push_back({"a", ops::contiguous(ops::narrow(a, dim_a, a0, a_len)), a.shape(), offs_a});
  auto [b0, b_len] = chunk_range(5, parts, rank);
  out.push_back({"b", ops::contiguous(ops::narrow(b, 2, b0, b_len)), b.shape(), {0, 0, b0}});
  out.push_back({"c", ops::scalar_tensor(7.5, DType::F64), Shape{}, {}, rank == 0});
  return out;
}

// The same pieces with their blocks on `device`.
std::vector<TensorPiece> pieces_on(std::vector<TensorPiece> pieces, Device device) {
  for (TensorPiece& p : pieces)
    p.local = ops::to(p.local, device);
  return pieces;
}

// Empty pieces of the same layout, on test_device(), to load into.
std::vector<TensorPiece> empty_like_pieces(std::vector<TensorPiece> pieces) {
  for (TensorPiece& p : pieces) {
    p.local = ops::full(p.local.shape(), -1.0, p.local.dtype(), test::test_device());
    p.write = true;
  }
  return pieces;
}

// `got`, a loaded block, is still on test_device() and equals `want`, a CPU
// tensor, bit for bit.
bool loaded_equal(const Tensor& got, const Tensor& want) {
  return got.device() == test::test_device() && ops::equal(test::on_cpu(got), want);
}

void save_layout(const fs::path& root, int64_t step, int parts, int dim_a,
                 Device device = test::test_device()) {
  run_ranks(parts, [&](ProcessGroupPtr pg) {
    save_checkpoint(root.string(), step, pieces_on(pieces_for(pg->rank(), parts, dim_a), device),
                    {{"k", "v"}}, pg);
  });
}

}  // namespace

TEST_CASE("checkpoint pieces reshard on load", "[checkpoint]") {
  TempDir dir("ckpt");
  save_layout(dir.path, 3, 4, 0);  // a split by rows over 4 ranks (uneven: 6 rows)
  CheckpointInfo info = find_checkpoint(dir.path.string());
  CHECK(info.step == 3);
  CHECK(info.world_size == 4);
  CHECK(info.meta.at("k") == "v");
  CHECK(fs::path(info.path).filename() == "step-00000003");
  for (int parts : {1, 2, 3}) {
    for (int dim_a : {0, 1}) {
      INFO("load with " << parts << " parts along dim " << dim_a);
      for (int rank = 0; rank < parts; ++rank) {
        std::vector<TensorPiece> want = pieces_for(rank, parts, dim_a);
        std::vector<TensorPiece> got = empty_like_pieces(want);
        load_checkpoint(info, got);
        for (size_t i = 0; i < want.size(); ++i)
          CHECK(loaded_equal(got[i].local, want[i].local));
      }
    }
  }
}

TEST_CASE("checkpoint consolidates into whole tensors that reload", "[checkpoint]") {
  TempDir dir("ckpt");
  save_layout(dir.path, 1, 3, 1);
  const std::string out = (dir.path / "whole.safetensors").string();
  consolidate_checkpoint(find_checkpoint(dir.path.string()), out);
  SafetensorsFile f = load_safetensors(out);
  CHECK(f.checksum_verified());
  CHECK(f.size() == 3);
  CHECK(ops::equal(f.at("a"), whole_a()));
  CHECK(ops::equal(f.at("b"), whole_b()));
  CHECK(f.at("c").item_double() == 7.5);
  CHECK(f.metadata().at("format") == "pt");
  // A prefix selects and strips.
  consolidate_checkpoint(find_checkpoint(dir.path.string()), out, "b");
  CHECK(load_safetensors(out).size() == 1);
  CHECK(load_safetensors(out).contains(""));
}

TEST_CASE("checkpoint errors name what is wrong", "[checkpoint]") {
  TempDir dir("ckpt");
  CHECK_THROWS_WITH(
      find_checkpoint((dir.path / "nope").string()),
      Catch::Contains("expected a checkpoint directory") && Catch::Contains("got nothing"));
  CHECK_THROWS_WITH(find_checkpoint(dir.path.string()),
                    Catch::Contains("checkpoint.json") && Catch::Contains("'latest'"));
  save_layout(dir.path, 2, 2, 0);
  CheckpointInfo info = find_checkpoint(dir.path.string());

  // A tensor the checkpoint lacks, and a global shape that differs.
  std::vector<TensorPiece> missing = {
      {"zzz", ops::zeros({2}, DType::F32, test::test_device()), Shape{2}, {0}}};
  CHECK_THROWS_WITH(load_checkpoint(info, missing), Catch::Contains("expected tensor 'zzz'"));
  std::vector<TensorPiece> reshaped = {
      {"a", ops::zeros({6, 11}, DType::F32, test::test_device()), Shape{6, 11}, {0, 0}}};
  CHECK_THROWS_WITH(load_checkpoint(info, reshaped),
                    Catch::Contains("expected global shape") && Catch::Contains("'a'"));

  // A bit flipped in a rank file: the checksum catches it.
  const fs::path file = fs::path(info.path) / info.files[1];
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-3, std::ios::end);
    char byte = 0;
    f.read(&byte, 1);
    byte ^= 0x10;
    f.seekp(-3, std::ios::end);
    f.write(&byte, 1);
  }
  std::vector<TensorPiece> p = empty_like_pieces(pieces_for(0, 1, 0));
  CHECK_THROWS_WITH(load_checkpoint(info, p), Catch::Contains("checksum"));
  // Truncated.
  fs::resize_file(file, fs::file_size(file) / 2);
  CHECK_THROWS_WITH(load_checkpoint(info, p), Catch::Contains(info.files[1]));
  // A rank file gone.
  fs::remove(file);
  CHECK_THROWS_WITH(find_checkpoint(dir.path.string()), Catch::Contains("missing"));
}

TEST_CASE("a save that dies at any stage leaves the previous checkpoint", "[checkpoint]") {
  for (const char* stage : {"files", "barrier", "meta", "renamed"}) {
    INFO("failure at " << stage);
    TempDir dir("ckpt");
    save_layout(dir.path, 1, 2, 0);
    set_checkpoint_fault_hook([stage](const std::string& at) {
      if (at == stage) throw Error(std::string("injected failure at ") + at);
    });
    CHECK_THROWS_WITH(save_layout(dir.path, 2, 2, 0), Catch::Contains("injected failure"));
    set_checkpoint_fault_hook({});
    // `latest` still names step 1 (after "renamed" the new directory exists,
    // complete, but latest was not yet replaced) and step 1 loads intact.
    CheckpointInfo info = find_checkpoint(dir.path.string());
    CHECK(info.step == 1);
    std::vector<TensorPiece> got = empty_like_pieces(pieces_for(0, 1, 0));
    load_checkpoint(info, got);
    CHECK(loaded_equal(got[0].local, whole_a()));
    // The next save succeeds and clears what the dead one left behind.
    save_layout(dir.path, 3, 2, 0);
    CHECK(find_checkpoint(dir.path.string()).step == 3);
    for (const auto& e : fs::directory_iterator(dir.path))
      CHECK(e.path().extension() != ".tmp");
  }
}

TEST_CASE("a save killed mid-way in a child process leaves the previous checkpoint",
          "[checkpoint]") {
  // A real crash: the child process exits abruptly (no unwinding, no cleanup)
  // at each stage; the parent then loads what is on disk.
#if defined(__SANITIZE_THREAD__)
  // ThreadSanitizer kills a child that starts threads after a multi-threaded
  // fork (die_after_fork); the in-process variant above still runs under it.
  WARN("SKIP: fork under ThreadSanitizer");
  std::cout << "SKIP: fork under ThreadSanitizer" << std::endl;
  return;
#endif
  for (const char* stage : {"files", "barrier", "meta", "renamed", "latest"}) {
    INFO("killed at " << stage);
    TempDir dir("ckpt");
    save_layout(dir.path, 1, 1, 0);
    const pid_t child = ::fork();
    if (child == 0) {
      // Only this thread survives fork: not the executor of an async stream.
      set_current_stream(Stream::create(Device::cpu(), CpuStreamMode::Inline));
      set_checkpoint_fault_hook([stage](const std::string& at) {
        if (at == stage) ::_exit(3);
      });
      try {
        // CPU only: CUDA cannot be used in a child forked after the parent used it.
        save_layout(dir.path, 2, 1, 0, Device::cpu());
      } catch (...) {
      }
      ::_exit(0);
    }
    int status = 0;
    ::waitpid(child, &status, 0);
    REQUIRE(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == 3);
    CheckpointInfo info = find_checkpoint(dir.path.string());
    CHECK(info.step == (std::string(stage) == "latest" ? 2 : 1));
    std::vector<TensorPiece> got = empty_like_pieces(pieces_for(0, 1, 0));
    load_checkpoint(info, got);
    CHECK(loaded_equal(got[1].local, whole_b()));
  }
}

TEST_CASE("checkpoints beyond keep are pruned", "[checkpoint]") {
  TempDir dir("ckpt");
  for (int64_t step : {1, 2, 3, 4}) {
    run_ranks(2, [&](ProcessGroupPtr pg) {
      save_checkpoint(dir.path.string(), step,
                      pieces_on(pieces_for(pg->rank(), 2, 0), test::test_device()), {}, pg, 2);
    });
  }
  CHECK_FALSE(fs::exists(dir.path / "step-00000001"));
  CHECK_FALSE(fs::exists(dir.path / "step-00000002"));
  CHECK(fs::exists(dir.path / "step-00000003"));
  CHECK(find_checkpoint(dir.path.string()).step == 4);
  CHECK(find_checkpoint((dir.path / "step-00000003").string()).step == 3);
}
