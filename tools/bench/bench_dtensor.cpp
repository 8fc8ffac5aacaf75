// `tandem-bench dtensor`: DTensor::redistribute against the raw collective its
// plan launches, called directly on the same group with the same tensors
// (Note [Benchmark timing]). A ratio near 1 says the planner adds no hidden
// copies, padding or per-call overhead around the collective.
//
//   Shard(0) -> Replicate    all_gather along dim 0
//   Shard(1) -> Replicate    all_gather of the local block along dim 0 + one
//                            interleave copy into the (rows, cols) result:
//                            the one copy any backend that moves contiguous
//                            blocks needs for a gather on a non-leading dim
//                            (target 0.95, Note [One copy per collective])
//   Partial  -> Replicate    all_reduce (sum)
//   Partial  -> Shard(0)     reduce_scatter along dim 0
//   Shard(0) -> Shard(1)     the column pack every such redistribution needs
//                            (each peer's columns copied once into a send
//                            buffer) + all_to_all_single of that buffer
//   Replicate -> Shard(0)    narrow + contiguous (no communication, no copy):
//                            reported for its per-call overhead, no target —
//                            a ratio against a zero-copy view measures only
//                            bookkeeping (microseconds)
//
// Four ranks run as threads of this process (threads backend), on a 16 MiB
// f32 global tensor. The rank threads start once and stay alive for every row:
// rank 0 runs the interleaved timer, and each call of a timed side becomes a
// command that every rank executes in lockstep (CommandLoop below), so thread
// start-up and mesh construction are never timed. Before timing, each row
// checks on every rank that redistribute computed what the raw collective
// (or, for Shard(0) -> Shard(1), a slice of the global tensor) gives.
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "tandem/comm/threads/threads_backend.h"
#include "tandem/parallel/dtensor.h"
#include "tandem/runtime/stream.h"
#include "tandem/tensor/ops.h"
#include "tools/bench/bench.h"

namespace tandem::bench {
namespace {

constexpr int kRanks = 4;
constexpr int64_t kRows = 2048, kCols = 2048;  // (2048, 2048) f32 = 16 MiB
constexpr double kTarget = 0.9;
constexpr double kInterleaveTarget = 0.95;

// Each timed side, and the one-time correctness check, as a command all ranks
// run together.
enum class Command : int { Tandem, Baseline, Check, Stop };

// Rank 0 issues commands; the other ranks serve them. Two lockstep phases per
// command, stop() included: one to publish it, one so that the issuing call
// returns only once every rank has finished (a timed trial covers the slowest
// rank) and has read the command (rank 0 may then write the next one). Errors
// are recorded per row, never thrown, so no rank leaves the lockstep early.
class CommandLoop {
 public:
  explicit CommandLoop(int ranks) : lockstep_(ranks) {}

  // Rank 0: runs `command` on every rank, `body` being this rank's part.
  template <class F>
  void issue(Command command, int reps, F&& body) {
    command_ = command;
    reps_ = reps;
    lockstep_.sync();
    body(command, reps);
    lockstep_.sync();
  }
  void stop() {
    command_ = Command::Stop;
    lockstep_.sync();
    lockstep_.sync();
  }
  // Other ranks: runs commands until stop().
  template <class F>
  void serve(F&& body) {
    for (;;) {
      lockstep_.sync();
      const Command command = command_;
      if (command != Command::Stop) body(command, reps_);
      lockstep_.sync();
      if (command == Command::Stop) return;
    }
  }

 private:
  Lockstep lockstep_;
  // Written by rank 0 before the first phase, read between the two.
  Command command_ = Command::Stop;
  int reps_ = 0;
};

// The collective (or local op) a redistribution plans to, called directly.
enum class Raw { AllGather, AllGatherInterleave, AllReduce, ReduceScatter, AllToAll, Narrow };

struct Case {
  const char* name;
  Placements from, to;
  Raw raw;
  const char* baseline;
};

const Case kCases[] = {
    {"Shard(0)->Replicate", {Shard(0)}, {Replicate()}, Raw::AllGather, "all_gather dim 0"},
    {"Shard(1)->Replicate",
     {Shard(1)},
     {Replicate()},
     Raw::AllGatherInterleave,
     "all_gather dim 0 + one interleave copy"},
    {"Partial->Replicate", {Partial()}, {Replicate()}, Raw::AllReduce, "all_reduce sum"},
    {"Partial->Shard(0)", {Partial()}, {Shard(0)}, Raw::ReduceScatter, "reduce_scatter dim 0"},
    {"Shard(0)->Shard(1)", {Shard(0)}, {Shard(1)}, Raw::AllToAll, "column pack + all_to_all"},
    {"Replicate->Shard(0)", {Replicate()}, {Shard(0)}, Raw::Narrow, "narrow + contiguous"},
};

// Options with one field set (brace-initialising only some fields warns).
AllGatherOptions gather_along(int64_t dim) {
  AllGatherOptions o;
  o.dim = dim;
  return o;
}
ReduceScatterOptions scatter_along(int64_t dim) {
  ReduceScatterOptions o;
  o.dim = dim;
  return o;
}

// One rank's two sides of a row. Both return the result of one call.
struct Sides {
  std::function<Tensor()> tandem, baseline;
  // What the tandem result must equal exactly; empty: the baseline's result.
  std::function<Tensor()> expected;
};

Sides make_sides(const Case& c, const Tensor& global, const DeviceMesh& mesh) {
  ProcessGroupPtr group = mesh.get_group();
  const int64_t k = mesh.size(), me = mesh.coordinate()[0];
  auto chunk = [k, me](const Tensor& t, int64_t dim) {
    auto [start, len] = chunk_range(t.shape()[static_cast<int>(dim)], k, me);
    return ops::contiguous(ops::narrow(t, dim, start, len));
  };
  // Partial and Replicate sources hold the whole tensor on every rank (the
  // pending sum of a Partial is then k * global: the values do not matter).
  Tensor local = c.from[0].is_shard() ? chunk(global, c.from[0].dim) : global;
  DTensor source = DTensor::from_local(local, mesh, c.from, global.shape());
  const Placements to = c.to;
  Sides s;
  s.tandem = [source, to] { return source.redistribute(to).to_local(); };
  auto finished = [](const WorkPtr& w) {
    w->wait();
    return w->result();
  };
  switch (c.raw) {
    case Raw::AllGather:
      s.baseline = [=] { return finished(group->all_gather(local, gather_along(0))); };
      break;
    case Raw::AllGatherInterleave:
      s.baseline = [=] {
        Tensor gathered =
            finished(group->all_gather(ops::reshape(local, Shape{local.numel()}), gather_along(0)));
        const int64_t k = group->size(), cols = local.shape()[1], block = local.numel();
        Tensor out = empty(global.shape(), local.dtype(), local.device());
        for (int64_t r = 0; r < k; ++r)
          ops::copy_(ops::narrow(out, 1, r * cols, cols),
                     ops::reshape(ops::narrow(gathered, 0, r * block, block), local.shape()));
        return out;
      };
      break;
    case Raw::AllReduce:
      s.baseline = [=] { return finished(group->all_reduce(local)); };
      break;
    case Raw::ReduceScatter:
      s.baseline = [=] { return finished(group->reduce_scatter(local, scatter_along(0))); };
      break;
    case Raw::AllToAll: {
      // The same bytes to the same peers (rows / k of the local rows each),
      // left in the order they arrive: the result is not Shard(1)'s layout,
      // so the tandem side is checked against the global tensor instead.
      s.baseline = [=] {
        // Pack: peer r's columns, copied once, row-major, into one buffer.
        const int64_t k = group->size(), cols = local.shape()[1];
        Tensor send = empty(Shape{local.numel()}, local.dtype(), local.device());
        int64_t at = 0;
        for (int64_t r = 0; r < k; ++r) {
          Tensor part = ops::narrow(local, 1, r * cols / k, cols / k);
          ops::copy_(ops::reshape(ops::narrow(send, 0, at, part.numel()), part.shape()), part);
          at += part.numel();
        }
        return finished(group->all_to_all_single(send));
      };
      Tensor want = chunk(global, 1);
      s.expected = [want] { return want; };
      break;
    }
    case Raw::Narrow:
      s.baseline = [=] { return chunk(local, 0); };
      break;
  }
  return s;
}

// The first error of a row on any rank (each row has its own, so a rank that
// starts the next row never races with rank 0 reading this one).
struct RowError {
  std::mutex mu;
  std::string what;

  void record(int rank, const std::exception& e) {
    std::lock_guard<std::mutex> lock(mu);
    if (what.empty()) what = fmt::format("rank {}: {}", rank, e.what());
  }
  std::string get() {
    std::lock_guard<std::mutex> lock(mu);
    return what;
  }
};

// Runs `row` on every rank; rank 0 times it and adds it to the report.
// Failures are recorded, never thrown: every rank must keep meeting the
// barriers of the lockstep.
void run_row(Report& report, const TimingConfig& config, const Case& c, const Tensor& global,
             const DeviceMesh& mesh, CommandLoop& lockstep, RowError& error) {
  const int rank = static_cast<int>(mesh.coordinate()[0]);
  Sides sides;
  try {
    sides = make_sides(c, global, mesh);
  } catch (const std::exception& e) {
    error.record(rank, e);
  }
  Tensor sink;  // keeps the last result alive so no call is optimised away
  auto body = [&](Command command, int reps) {
    if (!sides.tandem) return;  // set-up failed on this rank
    try {
      if (command == Command::Check) {
        Tensor got = sides.tandem();
        Tensor want = sides.expected ? sides.expected() : sides.baseline();
        TANDEM_CHECK(got.shape() == want.shape(),
                     "[bench::dtensor] {}: expected a result of shape {}, got {}", c.name,
                     want.shape(), got.shape());
        std::string mismatch = compare(got.to_vector<float>(), want.to_vector<float>(), 0, 0);
        TANDEM_CHECK(mismatch.empty(), "[bench::dtensor] {}: {}", c.name, mismatch);
        return;
      }
      const std::function<Tensor()>& side =
          command == Command::Tandem ? sides.tandem : sides.baseline;
      for (int i = 0; i < reps; ++i)
        sink = side();
      current_stream(Device::cpu()).synchronize();
    } catch (const std::exception& e) {
      error.record(rank, e);
    }
  };
  if (rank != 0) {
    lockstep.serve(body);
    return;
  }
  Row row;
  row.group = "redistribute";
  row.name = fmt::format("{} 16MiB", c.name);
  row.device = "cpu";
  row.threads = 1;
  row.baseline = c.baseline;
  // See the header comment.
  row.target = c.raw == Raw::Narrow                ? 0.0
               : c.raw == Raw::AllGatherInterleave ? kInterleaveTarget
                                                   : kTarget;
  lockstep.issue(Command::Check, 1, body);
  if (error.get().empty()) {
    Kernel tandem = [&](int reps) { lockstep.issue(Command::Tandem, reps, body); };
    Kernel baseline = [&](int reps) { lockstep.issue(Command::Baseline, reps, body); };
    row.timing = time_interleaved(tandem, baseline, config);
  }
  lockstep.stop();
  row.error = error.get();
  report.add(std::move(row));
}

}  // namespace

int run_dtensor(const Options& options) {
  TimingConfig config = timing_config(options);
  Report report("dtensor", options, config);
  report.set("setup",
             {{"ranks", kRanks},
              {"backend", "threads"},
              {"global_shape", {kRows, kCols}},
              {"dtype", "f32"}},
             fmt::format("{} ranks (threads backend, one op thread each), global f32 ({}, {}) = "
                         "16 MiB; rank threads stay alive across trials",
                         kRanks, kRows, kCols));
  // Every rank reads the same global tensor (inputs are never written).
  Generator gen(7);
  Tensor global = ops::randn({kRows, kCols}, gen);
  ops::set_num_threads(1);
  std::vector<const Case*> cases;
  for (const Case& c : kCases) {
    Row probe;
    probe.group = "redistribute";
    probe.name = fmt::format("{} 16MiB", c.name);
    if (report.wants(probe)) cases.push_back(&c);
  }
  CommandLoop lockstep(kRanks);
  std::vector<RowError> errors(cases.size());
  run_ranks(kRanks, [&](ProcessGroupPtr world) {
    DeviceMesh mesh(world, {kRanks}, {"x"});
    for (size_t i = 0; i < cases.size(); ++i) {
      run_row(report, config, *cases[i], global, mesh, lockstep, errors[i]);
    }
  });
  return report.finish();
}

}  // namespace tandem::bench
