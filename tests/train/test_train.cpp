// tandem-train end to end, in-process on the threads backend: it learns,
// overlap and checkpoint/resume are bit-exact, a checkpoint resumes on
// another layout and exports whole tensors, and every bad input is a clear
// error that overwrites nothing. The rank threads train on test_device()
// (tests/support/test_device.h): the suite runs on the CPU and on cuda:0.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>

#include "tandem/parallel/checkpoint.h"
#include "tandem/runtime/allocator.h"
#include "tandem/runtime/config.h"
#include "tandem/tensor/io/safetensors.h"
#include "tandem/tensor/ops.h"
#include "tests/support/test_device.h"
#include "tests/support/test_util.h"
#include "tests/support/train_util.h"
#include "tools/train/model.h"
#include "tools/train/options.h"
#include "tools/train/progress.h"
#include "tools/train/trainer.h"

using namespace tandem;
using tandem::test::losses;
using tandem::test::on_layout;
using tandem::test::TempDir;
using tandem::test::tiny;
using namespace tandem::train;
namespace fs = std::filesystem;

namespace {

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

}  // namespace

TEST_CASE("tandem-train learns on the default layout", "[train]") {
  TrainOptions o = tiny();
  o.steps = 30;
  TrainResult r = run_training(o);
  REQUIRE(r.steps.size() == 30);
  CHECK_THAT(r.layout, Catch::Contains("4 ranks") && Catch::Contains("ep 2 x cp 2") &&
                           Catch::Contains("dual-pipe overlap"));
  const std::vector<double> l = losses(r);
  const double first = (l[0] + l[1] + l[2]) / 3, last = (l[27] + l[28] + l[29]) / 3;
  INFO("first " << first << " last " << last);
  CHECK(std::isfinite(last));
  CHECK(last < first - 0.3);
  for (const StepStats& s : r.steps) {
    CHECK(s.accuracy >= 0.0);
    CHECK(s.accuracy <= 1.0);
    CHECK(s.tokens_per_second > 0);
    CHECK(s.peak_bytes > 0);
    CHECK(s.grad_norm > 0);
  }
}

TEST_CASE("tandem-train on the test device follows the CPU's losses", "[train]") {
  // Different kernels (CUDA's, or the emulated device's OpenBLAS products)
  // round differently, so the losses agree to a tolerance, not in every bit.
  TrainOptions o = tiny();
  o.steps = 3;
  o.micro_batches = 2;
  const std::vector<double> here = losses(run_training(o));
  o.device = "cpu";
  const std::vector<double> on_cpu = losses(run_training(o));
  REQUIRE(here.size() == on_cpu.size());
  for (size_t i = 0; i < here.size(); ++i) {
    INFO("step " << i << " on " << test::test_device().str());
    CHECK(here[i] == Approx(on_cpu[i]).epsilon(1e-4));
  }
}

TEST_CASE("the overlapped schedule trains bit-identically to the sequential one", "[train]") {
  TrainOptions o = tiny();
  o.steps = 3;
  o.micro_batches = 3;
  const std::vector<double> overlapped = losses(run_training(o));
  o.overlap = false;
  CHECK(losses(run_training(o)) == overlapped);
}

TEST_CASE("every parallel layout trains", "[train]") {
  struct Layout {
    int dp, ep, cp, tp;
    const char* mode;
    bool balance;
  };
  for (Layout l : {Layout{4, 1, 1, 1, "ulysses", false}, Layout{1, 4, 1, 1, "ulysses", false},
                   Layout{1, 1, 2, 2, "ulysses", false}, Layout{1, 2, 2, 1, "allgather", true},
                   Layout{1, 1, 4, 1, "ring", true}, Layout{1, 1, 4, 1, "hybrid", false},
                   Layout{2, 2, 1, 1, "ulysses", false}}) {
    INFO("dp " << l.dp << " ep " << l.ep << " cp " << l.cp << " tp " << l.tp << " " << l.mode);
    TrainOptions o = on_layout(l.dp, l.ep, l.cp, l.tp);
    o.cp_mode = l.mode;
    o.load_balance = l.balance;
    o.ulysses_degree = 2;
    o.steps = 2;
    TrainResult r = run_training(o);
    REQUIRE(r.steps.size() == 2);
    CHECK(std::isfinite(r.steps[1].loss));
    // Every layout sees the same first loss up to rounding when the data
    // ranks match (the same sequences, the same initial weights).
    if (l.dp * l.ep == 2) {
      TrainOptions ref = tiny();
      ref.steps = 1;
      CHECK(r.steps[0].loss == Approx(run_training(ref).steps[0].loss).epsilon(1e-4));
    }
  }
}

TEST_CASE("gradients reduced in many buckets during the backward train bit-identically to one",
          "[train]") {
  // dp 2 x ep 2 with the dual-pipe overlap: experts (reduced over dp only)
  // and dense weights (over dp and ep) in buckets of their own kinds.
  TrainOptions o = tiny();
  o.dp = 2;
  o.cp = 1;
  o.batch = 2;
  o.steps = 3;
  const std::vector<double> one_bucket = losses(run_training(o));
  o.grad_bucket_mb = 1e-6;  // one parameter per bucket
  const std::vector<double> many = losses(run_training(o));
  REQUIRE(many.size() == 3);
  CHECK(many == one_bucket);
}

TEST_CASE("async context parallelism trains bit-identically to the sync collectives", "[train]") {
  // --cp-async auto picks AsyncContextParallel for Ulysses, all-gather KV and
  // hybrid, under the dual-pipe schedule as well, and the layout says so.
  for (const char* mode : {"ulysses", "allgather", "hybrid"}) {
    INFO(mode);
    TrainOptions o = tiny();
    o.cp_mode = mode;
    if (std::string(mode) == "hybrid") {
      o.ep = 1;
      o.cp = 4;
      o.ulysses_degree = 2;
    }
    o.load_balance = std::string(mode) == "allgather";
    o.steps = 3;
    const TrainResult async = run_training(o);
    CHECK_THAT(async.layout, Catch::Contains(", async)"));
    o.cp_async = "off";
    const TrainResult sync = run_training(o);
    CHECK_THAT(sync.layout, !Catch::Contains("async"));
    if (std::string(mode) == "hybrid") {  // K/V gradients summed in another order
      for (size_t i = 0; i < async.steps.size(); ++i)
        CHECK(async.steps[i].loss == Approx(sync.steps[i].loss).epsilon(1e-5));
    } else {
      CHECK(losses(async) == losses(sync));
    }
  }
  TrainOptions o = tiny();
  o.cp_mode = "ring";
  CHECK_THAT(run_training(o).layout, Catch::Contains("(ring)"));  // ring overlaps on its own
  o.cp_async = "on";
  CHECK_THROWS_WITH(run_training(o), Catch::Contains("--cp-async on expects --cp-mode ulysses, "
                                                     "allgather or hybrid") &&
                                         Catch::Contains("'ring'"));
}

// Note [FSDP] through tandem-train (--dp-shard): the data ranks of DDP's
// layout, so the same sequences and, up to the order of the gradient sums
// (reduce-scatter instead of all-reduce), the same losses.
TEST_CASE("resume from a checkpoint is bit-exact", "[train][checkpoint]") {
  TempDir dir("train");
  TrainOptions o = tiny();
  o.save_dir = (dir.path / "ckpt").string();
  o.save_every = 3;
  const std::vector<double> full = losses(run_training(o));
  REQUIRE(full.size() == 6);
  CHECK(fs::exists(dir.path / "ckpt" / "step-00000003" / "checkpoint.json"));
  CHECK(read_file(dir.path / "ckpt" / "latest") == "step-00000006\n");

  TrainOptions again = tiny();
  again.resume = (dir.path / "ckpt" / "step-00000003").string();
  TrainResult resumed = run_training(again);
  CHECK(resumed.first_step == 3);
  CHECK(losses(resumed) == std::vector<double>(full.begin() + 3, full.end()));
}

TEST_CASE("a checkpoint resumes on another layout and exports whole tensors",
          "[train][checkpoint]") {
  TempDir dir("train");
  TrainOptions o = tiny();
  o.steps = 4;
  o.save_dir = (dir.path / "ckpt").string();
  o.save_every = 2;
  const std::vector<double> full = losses(run_training(o));  // ep 2 x cp 2

  // The same data ranks (ep 2) with tp 2 instead of cp 2: the same sequences,
  // so the losses agree up to rounding.
  TrainOptions other = tiny();
  other.steps = 4;
  other.cp = 1;
  other.tp = 2;
  other.resume = (dir.path / "ckpt" / "step-00000002").string();
  const std::vector<double> resharded = losses(run_training(other));
  REQUIRE(resharded.size() == 2);
  CHECK(resharded[0] == Approx(full[2]).epsilon(1e-4));
  CHECK(resharded[1] == Approx(full[3]).epsilon(1e-3));

  // Export: every parameter of the one-rank model, whole.
  const std::string out = (dir.path / "model.safetensors").string();
  export_checkpoint((dir.path / "ckpt").string(), out);
  SafetensorsFile f = load_safetensors(out);
  Generator g(1);
  ModelConfig mc = o.model;
  mc.vocab = make_task(o)->vocab();
  mc.max_seq = 16;
  MoELanguageModel reference(mc, g);
  auto params = reference.named_parameters();
  CHECK(f.size() == params.size());
  for (auto& [name, p] : params) {
    INFO(name);
    REQUIRE(f.contains(name));
    CHECK(f.at(name).shape() == p.shape());
  }
}

TEST_CASE("bad input is a clear error and overwrites nothing", "[train]") {
  TempDir dir("train");
  TrainOptions o = tiny();
  o.ranks = 4;
  o.dp = 2;
  CHECK_THROWS_WITH(run_training(o),
                    Catch::Contains("dp x ep x cp x tp to equal the world size 4") &&
                        Catch::Contains("2 x 2 x 2 x 1 = 8"));
  o = tiny();
  o.model.experts = 3;
  CHECK_THROWS_WITH(run_training(o), Catch::Contains("--ep 2 to divide --experts 3"));
  o = tiny();
  o.model.heads = 2;
  o.cp = 4;
  o.ep = 1;
  CHECK_THROWS_WITH(run_training(o), Catch::Contains("ulysses") && Catch::Contains("--cp 4"));
  o = tiny();
  o.micro_batches = 1;
  CHECK_THROWS_WITH(run_training(o), Catch::Contains("--micro-batches >= 2"));
  o = tiny();
  o.data = (dir.path / "missing.txt").string();
  CHECK_THROWS_WITH(run_training(o),
                    Catch::Contains("cannot open the data file") && Catch::Contains("missing.txt"));
  {
    std::ofstream small(dir.path / "small.txt");
    small << "tiny";
  }
  o.data = (dir.path / "small.txt").string();
  CHECK_THROWS_WITH(run_training(o), Catch::Contains("more than 128 bytes"));
  o = tiny();
  o.resume = (dir.path / "nowhere").string();
  o.save_dir = (dir.path / "out").string();
  CHECK_THROWS_WITH(run_training(o), Catch::Contains("expected a checkpoint directory"));
  CHECK_FALSE(fs::exists(dir.path / "out"));

  // A corrupt checkpoint: the error names the file; the checkpoint stays.
  o = tiny();
  o.steps = 1;
  o.save_dir = (dir.path / "ckpt").string();
  run_training(o);
  const fs::path file = dir.path / "ckpt" / "step-00000001" / "rank-00002-of-00004.safetensors";
  const auto size = fs::file_size(file);
  fs::resize_file(file, size - 1);
  o.resume = o.save_dir;
  o.steps = 2;
  CHECK_THROWS_WITH(run_training(o), Catch::Contains("rank-00002-of-00004.safetensors"));
  CHECK(fs::file_size(file) == size - 1);
  CHECK(read_file(dir.path / "ckpt" / "latest") == "step-00000001\n");

  // A checkpoint of another model.
  fs::resize_file(file, size);  // (still corrupt: the byte is gone, zeros appended)
  o = tiny();
  o.model.d_model = 16;
  o.resume = (dir.path / "ckpt").string();
  CHECK_THROWS_WITH(run_training(o), Catch::Contains("different model"));
}

TEST_CASE("the command line parses and rejects bad flags", "[train]") {
  Command c = parse_command_line({"tandem-train", "--dp", "2", "--cp", "1", "--cp-mode", "ring",
                                  "--no-overlap", "--steps", "7", "--save", "x"});
  CHECK(c.kind == Command::Kind::Train);
  CHECK(c.options.dp == 2);
  CHECK(c.options.cp == 1);
  CHECK(c.options.cp_mode == "ring");
  CHECK_FALSE(c.options.overlap);
  CHECK(c.options.steps == 7);
  CHECK(c.options.save_dir == "x");
  Command d = parse_command_line({"tandem-train"});
  CHECK(d.options.overlap);
  CHECK(d.options.ep == 2);
  CHECK(d.options.cp == 2);
  Command e = parse_command_line({"tandem-train", "export", "ckpt", "out.safetensors"});
  CHECK(e.kind == Command::Kind::Export);
  CHECK(e.export_from == "ckpt");
  CHECK(e.export_to == "out.safetensors");
  CHECK(parse_command_line({"tandem-train", "--help"}).kind == Command::Kind::Help);
  CHECK(d.options.cp_async == "auto");
  CHECK(parse_command_line({"tandem-train", "--cp-async", "off"}).options.cp_async == "off");
  CHECK_THROWS_WITH(parse_command_line({"tandem-train", "--cp-async", "maybe"}),
                    Catch::Contains("--cp-async") && Catch::Contains("maybe"));
  CHECK_THROWS_WITH(parse_command_line({"tandem-train", "--cp-mode", "spiral"}),
                    Catch::Contains("--cp-mode") && Catch::Contains("spiral"));
  CHECK_THROWS_WITH(parse_command_line({"tandem-train", "--dp", "0"}), Catch::Contains("--dp"));
  CHECK_THROWS_WITH(parse_command_line({"tandem-train", "--bogus"}), Catch::Contains("--bogus"));
  CHECK_THROWS_WITH(parse_command_line({"tandem-train", "--steps", "ten"}),
                    Catch::Contains("--steps"));
  CHECK_THROWS_WITH(parse_command_line({"tandem-train", "export", "only-one"}),
                    Catch::Contains("out"));
}

TEST_CASE("progress lines: in place on a terminal, plain lines otherwise", "[train]") {
  StepStats s;
  s.step = 9;
  s.loss = 1.25;
  s.accuracy = 0.5;
  s.tokens_per_second = 1234;
  s.comm_wait = 0.125;
  s.peak_bytes = 3 << 20;
  s.lr = 1e-3;
  const std::string line = Progress::format(s, 100);
  CHECK_THAT(line, Catch::Contains("step  10/100") && Catch::Contains("loss 1.2500") &&
                       Catch::Contains("acc  50.0%") && Catch::Contains("1234 tok/s") &&
                       Catch::Contains("comm wait 12.5%") && Catch::Contains("peak 3.0 MiB"));
  for (const char* mode : {"plain", "line"}) {
    std::FILE* f = std::tmpfile();
    {
      Progress p(f, mode, 20, 5);
      p.message("hello");
      for (int i = 0; i < 20; ++i) {
        s.step = i;
        p.step(s);
      }
    }
    std::rewind(f);
    std::string text;
    for (int ch; (ch = std::fgetc(f)) != EOF;)
      text.push_back(static_cast<char>(ch));
    std::fclose(f);
    const auto lines = std::count(text.begin(), text.end(), '\n');
    // hello + steps 1, 5, 10, 15, 20.
    CHECK(lines == 6);
    if (std::string(mode) == "plain") {
      CHECK(text.find('\r') == std::string::npos);
    } else {
      CHECK(std::count(text.begin(), text.end(), '\r') >= 14);  // every step redrawn
    }
  }
}

TEST_CASE("--trace writes one trace of every rank", "[train]") {
  TempDir dir("train");
  TrainOptions o = tiny();
  o.steps = 3;
  o.trace = (dir.path / "trace.json").string();
  run_training(o);
  nlohmann::json doc = nlohmann::json::parse(read_file(o.trace));
  std::set<int> pids;
  std::set<std::string> categories;
  for (const auto& e : doc["traceEvents"]) {
    pids.insert(e["pid"].get<int>());
    if (e.contains("cat")) categories.insert(e["cat"].get<std::string>());
  }
  CHECK(pids == std::set<int>{0, 1, 2, 3});
  INFO(fmt::format("{}", fmt::join(categories, ",")));
  // Collectives and the coordinator's rendezvous, from every rank.
  CHECK(categories.count("comm") == 1);
  CHECK(categories.count("coordinator") == 1);
}

TEST_CASE("a soak run of many short steps keeps memory constant", "[train][soak]") {
  // Thousands of short overlapped steps on 4 rank threads must not leak
  // (tapes, works, coordinator windows). Only what does not depend on how the
  // eight worker threads interleave is compared exactly:
  // - settled bytes (settle_memory: every rank has finished the step) hold
  //   what outlives a step; any per-step leak makes them grow, by any amount;
  // - the peak is settled bytes plus what the workers hold at the step's
  //   busiest moment, which depends on how their steps overlap: the maximum
  //   over a window is set by the rarest overlap (comparing two windows'
  //   maxima failed under load). The median over 1300 steps is set by the
  //   common overlaps, the same idle or with both cores busy, so the halves'
  //   medians must agree within 5%;
  // - the allocator's cache grows whenever an overlap keeps more blocks of a
  //   size live at once than any before; all live blocks at one moment total
  //   at most a peak, so without a leak the second half adds less than one
  //   peak to the cache, where a per-step leak of cached blocks would add
  //   1500 steps' worth;
  // - the resident set, with a margin for the allocator's arenas.
  TrainOptions o = tiny();
  o.model.layers = 1;
  o.model.d_model = 16;
  o.model.hidden = 16;
  o.batch = 2;
  o.steps = 3000;
  o.settle_memory = true;
  TrainResult r = run_training(o);
  REQUIRE(r.steps.size() == 3000);
  const int64_t settled = r.steps[0].settled_bytes;
  CHECK(settled > 0);
  int64_t settled_differs = -1;
  for (const StepStats& s : r.steps) {
    if (s.settled_bytes != settled && settled_differs < 0) settled_differs = s.step;
  }
  INFO("settled bytes " << settled << "; first step that differs: " << settled_differs);
  CHECK(settled_differs == -1);
  auto field = [&](size_t from, size_t to, int64_t StepStats::*f) {
    std::vector<int64_t> v;
    for (size_t i = from; i < to; ++i)
      v.push_back(r.steps[i].*f);
    return v;
  };
  auto median = [](std::vector<int64_t> v) {
    std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
    return v[v.size() / 2];
  };
  auto max_of = [](const std::vector<int64_t>& v) { return *std::max_element(v.begin(), v.end()); };
  // Steps before 200 warm the caches up.
  const int64_t early_peak = median(field(200, 1500, &StepStats::peak_bytes));
  const int64_t late_peak = median(field(1500, 3000, &StepStats::peak_bytes));
  const int64_t max_peak = max_of(field(0, 3000, &StepStats::peak_bytes));
  const int64_t early_reserved = r.steps[1499].reserved_bytes;
  const int64_t late_reserved = r.steps[2999].reserved_bytes;
  const int64_t early_rss = max_of(field(200, 500, &StepStats::resident_bytes));
  const int64_t late_rss = max_of(field(2700, 3000, &StepStats::resident_bytes));
  INFO("median peak " << early_peak << " -> " << late_peak << " (max " << max_peak << "), reserved "
                      << early_reserved << " -> " << late_reserved << ", rss " << early_rss
                      << " -> " << late_rss);
  CHECK(late_peak <= early_peak + early_peak / 20);
  CHECK(late_reserved <= early_reserved + max_peak);
  CHECK(late_rss <= early_rss + early_rss / 10 + (4 << 20));
  CHECK(std::isfinite(r.steps.back().loss));
}

namespace {

int thread_count() {
  int n = 0;
  for (const auto& e : fs::directory_iterator("/proc/self/task")) {
    (void)e;
    ++n;
  }
  return n;
}

// The thread count once it has come down to `want`, or after 2 s. A joined
// thread can still be listed in /proc/self/task for a moment after join()
// returns (the kernel wakes the joiner when the thread releases its memory,
// before the task leaves the list), so a count read right after a job can be
// one too high without any thread outliving it; one that is still high after
// 2 s did outlive it.
int settled_thread_count(int want) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  int n = thread_count();
  while (n > want && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    n = thread_count();
  }
  return n;
}

}  // namespace

TEST_CASE("a failing rank ends the job at once with an error naming it", "[train][faults]") {
  // Note [Injected faults]: rank 2 throws in a forward (its peers are in, or
  // about to enter, collectives with it), inside a backward, or between the
  // schedule and the gradient reduction. The peers are aborted, not left to
  // time out; the checkpoint saved before the fault stays intact; no thread
  // or allocation outlives the failed job.
  tandem::test::ScopedWaitTimeout bound(std::chrono::seconds(20));
  run_training(tiny());  // warm the process-wide singletons first
  const int threads_before = thread_count();
  const int64_t allocated_before = memory_stats(Device::cpu()).allocated_bytes;
  for (const char* kind : {"forward", "backward", "step-end"}) {
    INFO(kind);
    TempDir dir("train");
    TrainOptions o = tiny();
    o.steps = 4;
    o.fault = std::string("2:2:") + kind;
    o.save_dir = (dir.path / "ckpt").string();
    o.save_every = 1;
    const auto start = std::chrono::steady_clock::now();
    CHECK_THROWS_WITH(run_training(o), Catch::Contains(std::string("injected fault '") + kind +
                                                       "' on rank 2 at step 2"));
    CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(10));
    CheckpointInfo info = find_checkpoint(o.save_dir);
    CHECK(info.step == 2);
    TrainOptions resumed = tiny();
    resumed.steps = 3;
    resumed.resume = o.save_dir;
    CHECK(run_training(resumed).steps.size() == 1);
    CHECK(settled_thread_count(threads_before) == threads_before);
    CHECK(memory_stats(Device::cpu()).allocated_bytes == allocated_before);
  }
}

TEST_CASE("a bad --inject-fault is a clear error", "[train][faults]") {
  for (const char* bad : {"1:2", "x:1:forward", "1:1:explode", "-1:0:exit", "1:1:forward:x"}) {
    CHECK_THROWS_WITH(parse_fault(bad), Catch::Contains("RANK:STEP:KIND"));
  }
  CHECK(parse_fault("3:7:hang").step == 7);
  TrainOptions o = tiny();
  o.fault = "9:0:forward";
  CHECK_THROWS_WITH(run_training(o), Catch::Contains("names rank 9 of a world of 4"));
  // A rank that never arrives is simulated across processes only (train_mpi.py).
  o.fault = "1:0:hang";
  CHECK_THROWS_WITH(run_training(o), Catch::Contains("needs one process per rank"));
}
