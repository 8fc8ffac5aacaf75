// `tandem-bench comm`: collective bandwidth of tandem's comm backends against
// baselines measured in the same run (Note [Benchmark timing]).
//
//   threads  all_reduce, all_gather, reduce_scatter and all_to_all on 4 rank
//            threads (run_ranks), 4 KiB to 64 MiB, against a naive
//            shared-memory reference on the same kind of threads: every rank
//            reads its peers' buffers between two barriers (memcpy of the
//            shards for all_gather and all_to_all; one loop adding the ranks
//            in rank order for all_reduce and reduce_scatter)
//   mpi      under `mpirun -n N` (N > 1): the MPI backend against the same
//            nonblocking MPI calls made directly (MPI_Iallreduce, ... then
//            MPI_Wait) on a duplicate of MPI_COMM_WORLD; the threads rows
//            are not run then (N processes of 4 threads would oversubscribe)
//
// Note [Collective sizes]
// ~~~~~~~~~~~~~~~~~~~~~~~
// As in nccl-tests, the size S of a row is the largest buffer of one rank:
// all_reduce the buffer, all_gather the gathered output, reduce_scatter the
// full input, all_to_all the send buffer. algbw = S / t; busbw = algbw times
// 2(n-1)/n for all_reduce and (n-1)/n for the others, the fraction of S that
// crosses each rank's link, so busbw is comparable across collectives.
//
// Each side is checked against the other before it is timed: the values are
// small integers, so every reduction order gives the same bits and the
// outputs must be equal.
//
// Note [Comm benchmark method]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Both sides of a row run on the same rank threads (or processes), on the
// same input buffers, interleaved trial by trial (Note [Benchmark timing]);
// the ratio is the median of the per-pair ratios. What still differs, and
// is tandem's real cost rather than the method's:
// - tandem allocates its output at every call (the API returns a new
//   tensor; the caching allocator hands back a recently freed block, not
//   necessarily the one this rank wrote last), while the baselines write
//   into one fixed buffer per rank that stays in that core's cache;
// - tandem validates, records the call in the ledger and, in checked mode
//   (the default, and what the MPI rows measure), compares fingerprints
//   across ranks before the data moves: one small extra collective per call
//   for MPI, which the "unchecked" MPI rows leave out to show its share.
// Noise: on the small shared machines these rows were tuned on (2 cores, 4
// ranks, other jobs running), whole runs land in one of two regimes, one in
// which the baseline's threads hand each other the cores almost without
// sleeping (1 MiB all_gather ~40 us) and one about twice as slow; a run's
// ratios are stable within a regime (within ~5% between runs) and differ
// between them (up to ~20% at 1-4 MiB). Interleaving cannot remove a
// regime that lasts a whole row: compare several runs, and read the regime
// from the baseline times.
//
// Note [Core round trip]
// ~~~~~~~~~~~~~~~~~~~~~~
// One regime has a cause that can be measured: the virtual machines these
// rows were tuned on have 2 vCPUs that the host places on one L3 (a cache
// line goes from one core to the other and back in ~85 ns) or, for minutes
// at a time, on two dies (~390 ns, and each die has an L3 of its own). With
// two L3s every line a rank writes and another reads crosses the dies: the
// naive version of a 1 MiB all_to_all went from 41 to 45 us, tandem's from
// 41 to 56 us (its rounds hand jobs, claims and counters between threads:
// more shared lines than two barriers). So the threads rows start by
// timing that round trip between CPUs 0 and 1 (2,000 round trips, median of
// 5 runs) and print it next to the table; compare runs of the same
// topology.
#include <fmt/format.h>

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

// Direct MPI calls need <mpi.h>, which the build provides exactly when
// tandem's comm library was built with MPI (comm_dep carries the MPI
// dependency). This file cannot pick a stub source in Meson, so the MPI rows
// are selected here, once, at file scope (TANDEM_BENCH_HAVE_MPI).
#if __has_include(<mpi.h>)
#include <mpi.h>
#define TANDEM_BENCH_HAVE_MPI 1
#else
#define TANDEM_BENCH_HAVE_MPI 0
#endif

#include "tandem/comm/backend.h"
#include "tandem/comm/threads/threads_backend.h"
#include "tandem/runtime/error.h"
#include "tandem/tensor/ops.h"
#include "tools/bench/bench.h"

namespace tandem::bench {
namespace {

using Json = nlohmann::ordered_json;

constexpr int kRanks = 4;
constexpr int64_t kKiB = 1024, kMiB = 1024 * 1024;
// Targets (baseline time / tandem time) from this size up; smaller rows are
// reported without a target (per-call overheads dominate there).
constexpr int64_t kTargetFromBytes = kMiB;
constexpr double kThreadsTarget = 1.0;  // all_gather and all_to_all vs the reference
constexpr double kMpiTarget = 0.9;      // every collective vs direct MPI calls

enum class Op { AllReduce, AllGather, ReduceScatter, AllToAll };
constexpr Op kOps[] = {Op::AllReduce, Op::AllGather, Op::ReduceScatter, Op::AllToAll};

const char* op_name(Op op) {
  switch (op) {
    case Op::AllReduce:
      return "all_reduce";
    case Op::AllGather:
      return "all_gather";
    case Op::ReduceScatter:
      return "reduce_scatter";
    case Op::AllToAll:
      return "all_to_all";
  }
  return "?";
}

// Note [Collective sizes].
double bus_factor(Op op, int n) {
  return op == Op::AllReduce ? 2.0 * (n - 1) / n : static_cast<double>(n - 1) / n;
}

// f32 elements of one rank's input and output for a row of S bytes, S
// rounded down to a multiple of n elements.
struct Counts {
  int64_t in = 0, out = 0;
};
Counts counts_of(Op op, int64_t bytes, int n) {
  const int64_t s = bytes / static_cast<int64_t>(sizeof(float)) / n * n;
  switch (op) {
    case Op::AllReduce:
      return {s, s};
    case Op::AllGather:
      return {s / n, s};
    case Op::ReduceScatter:
      return {s, s / n};
    case Op::AllToAll:
      return {s, s};
  }
  return {};
}

std::vector<int64_t> row_sizes(bool quick) {
  if (quick) return {4 * kKiB, kMiB, 16 * kMiB};
  std::vector<int64_t> sizes;
  for (int64_t s = 4 * kKiB; s <= 64 * kMiB; s *= 4)
    sizes.push_back(s);
  return sizes;
}

std::string size_name(int64_t bytes) {
  return bytes >= kMiB ? fmt::format("{} MiB", bytes / kMiB) : fmt::format("{} KiB", bytes / kKiB);
}

// Element i of rank r's input: small integers, exact in f32 and in any sum.
float input_value(int rank, int64_t i) {
  return static_cast<float>(rank * 4096 + i % 4093);
}

Tensor make_input(int rank, int64_t count) {
  std::vector<float> values(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i)
    values[static_cast<size_t>(i)] = input_value(rank, i);
  return ops::from_vector<float>(values, {count});
}

WorkPtr launch(Op op, ProcessGroup& pg, const Tensor& x) {
  switch (op) {
    case Op::AllReduce:
      return pg.all_reduce(x);
    case Op::AllGather:
      return pg.all_gather(x);
    case Op::ReduceScatter:
      return pg.reduce_scatter(x);
    case Op::AllToAll:
      return pg.all_to_all_single(x);
  }
  TANDEM_FAIL("[bench::comm] unknown collective");
}

// Empty when `got` equals `want`, else where they first differ.
std::string mismatch(const std::vector<float>& got, const std::vector<float>& want) {
  if (got.size() != want.size()) {
    return fmt::format("expected {} elements, got {}", want.size(), got.size());
  }
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] != want[i])
      return fmt::format("expected {} at element {}, got {}", want[i], i, got[i]);
  }
  return {};
}

// One measured row, kept for the bandwidth table.
struct Measured {
  std::string backend;
  Op op;
  int64_t bytes;
  int ranks;
  PairTiming timing;
};

template <class F>
void add_row(Report& report, Row row, std::vector<Measured>& measured, Measured m, F&& measure) {
  if (!report.wants(row)) return;
  try {
    row.timing = measure();
    m.timing = row.timing;
    measured.push_back(m);
  } catch (const std::exception& e) {
    row.error = e.what();
  }
  report.add(std::move(row));
}

// ---- threads backend ----

using RankJob = std::function<void(ProcessGroup&)>;

// The rank threads of one run_ranks() call, kept waiting for jobs so that
// thread start-up is never timed: run(job) has every rank run `job` once on
// its world group and returns when all have.
class RankPool {
 public:
  explicit RankPool(int world) : world_(world), driver_([this] { drive(); }) {}
  ~RankPool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    wake_.notify_all();
    driver_.join();
  }
  RankPool(const RankPool&) = delete;
  RankPool& operator=(const RankPool&) = delete;

  // Rethrows the first error of a rank; the pool is unusable afterwards.
  void run(const RankJob& job) {
    std::unique_lock<std::mutex> lock(mu_);
    TANDEM_CHECK(error_ == nullptr,
                 "[bench::comm] expected live rank threads, got threads that "
                 "stopped after an earlier error");
    job_ = &job;
    done_ = 0;
    ++generation_;
    wake_.notify_all();
    done_cv_.wait(lock, [&] { return done_ == world_; });
    job_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void drive() {
    try {
      run_ranks(world_, [this](ProcessGroupPtr pg) { serve(*pg); });
    } catch (...) {
      // run() has already rethrown the rank's error.
    }
  }

  void serve(ProcessGroup& pg) {
    uint64_t seen = 0;
    for (;;) {
      const RankJob* job = nullptr;
      {
        std::unique_lock<std::mutex> lock(mu_);
        wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
        job = job_;
      }
      std::exception_ptr error;
      try {
        (*job)(pg);
      } catch (...) {
        error = std::current_exception();
      }
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (error && !error_) error_ = error;
        ++done_;
      }
      done_cv_.notify_all();
      if (error) std::rethrow_exception(error);  // run_ranks aborts the peers' collectives
    }
  }

  const int world_;
  std::mutex mu_;
  std::condition_variable wake_, done_cv_;
  const RankJob* job_ = nullptr;  // owned by the caller of run(), which waits
  uint64_t generation_ = 0;
  int done_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
  std::thread driver_;  // last: starts after the members above exist
};

// The buffers of one threads row: each rank's input tensor (which the
// reference reads too, through its raw data) and the reference's outputs.
struct SharedRow {
  SharedRow(Op op_, int64_t bytes)
      : op(op_), counts(counts_of(op_, bytes, kRanks)), inputs(kRanks), reference_out(kRanks) {}
  Op op;
  Counts counts;
  std::vector<Tensor> inputs;
  std::vector<std::vector<float>> reference_out;
  std::barrier<> barrier{kRanks};
};

// out[i] = in_0[base + i] + ... + in_{n-1}[base + i], in rank order.
void reduce_in_rank_order(const SharedRow& row, int64_t base, int64_t count, float* out) {
  const float* in[kRanks];
  for (int r = 0; r < kRanks; ++r)
    in[r] = static_cast<const float*>(row.inputs[r].raw_data()) + base;
  for (int64_t i = 0; i < count; ++i) {
    float acc = in[0][i];
    for (int r = 1; r < kRanks; ++r)
      acc += in[r][i];
    out[i] = acc;
  }
}

// The naive shared-memory collective of rank `rank`: reads its peers' inputs
// (posted before the first barrier of the caller) into its output.
void reference_step(SharedRow& row, int rank) {
  float* out = row.reference_out[rank].data();
  auto input = [&](int r) { return static_cast<const float*>(row.inputs[r].raw_data()); };
  switch (row.op) {
    case Op::AllGather: {
      const int64_t chunk = row.counts.in;
      for (int r = 0; r < kRanks; ++r) {
        std::memcpy(out + r * chunk, input(r), static_cast<size_t>(chunk) * sizeof(float));
      }
      return;
    }
    case Op::AllToAll: {
      const int64_t chunk = row.counts.in / kRanks;
      for (int r = 0; r < kRanks; ++r) {
        std::memcpy(out + r * chunk, input(r) + rank * chunk,
                    static_cast<size_t>(chunk) * sizeof(float));
      }
      return;
    }
    case Op::AllReduce:
      reduce_in_rank_order(row, 0, row.counts.out, out);
      return;
    case Op::ReduceScatter:
      reduce_in_rank_order(row, rank * row.counts.out, row.counts.out, out);
      return;
  }
}

// Note [Core round trip]: ns for a cache line to go from CPU 0 to CPU 1 and
// back; 0 when this process may not run on both.
double core_round_trip_ns() {
  cpu_set_t allowed;
  if (sched_getaffinity(0, sizeof allowed, &allowed) != 0 || !CPU_ISSET(0, &allowed) ||
      !CPU_ISSET(1, &allowed)) {
    return 0.0;
  }
  auto pin = [](int cpu) {
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(cpu, &one);
    return sched_setaffinity(0, sizeof one, &one) == 0;
  };
  constexpr int kTrips = 2000;
  std::vector<double> runs;
  for (int run = 0; run < 5; ++run) {
    alignas(64) std::atomic<int> ball{0};
    std::atomic<bool> pinned{true};
    double ns = 0.0;
    std::thread a([&] {
      if (!pin(0)) pinned = false;
      while (ball.load() == 0) {  // the other side is pinned and waiting
      }
      const auto start = std::chrono::steady_clock::now();
      for (int i = 1; i <= kTrips; ++i) {
        ball.store(2 * i);
        while (ball.load() != 2 * i + 1) {
        }
      }
      ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start)
               .count() /
           kTrips;
    });
    std::thread b([&] {
      if (!pin(1)) pinned = false;
      ball.store(1);
      for (int i = 1; i <= kTrips; ++i) {
        while (ball.load() != 2 * i) {
        }
        ball.store(2 * i + 1);
      }
    });
    a.join();
    b.join();
    if (!pinned) return 0.0;
    runs.push_back(ns);
  }
  std::sort(runs.begin(), runs.end());
  return runs[runs.size() / 2];
}

PairTiming time_threads_row(Op op, int64_t bytes, const TimingConfig& config) {
  SharedRow row(op, bytes);
  RankPool pool(kRanks);
  pool.run([&](ProcessGroup& pg) {
    row.inputs[pg.rank()] = make_input(pg.rank(), row.counts.in);
    row.reference_out[pg.rank()].assign(static_cast<size_t>(row.counts.out), 0.0f);
  });

  std::vector<std::vector<float>> results(kRanks);
  pool.run([&](ProcessGroup& pg) {
    WorkPtr w = launch(op, pg, row.inputs[pg.rank()]);
    w->synchronize();
    results[pg.rank()] = w->result().to_vector<float>();
  });
  RankJob reference_once = [&](ProcessGroup& pg) {
    row.barrier.arrive_and_wait();
    reference_step(row, pg.rank());
    row.barrier.arrive_and_wait();
  };
  pool.run(reference_once);
  for (int r = 0; r < kRanks; ++r) {
    std::string m = mismatch(results[r], row.reference_out[r]);
    TANDEM_CHECK(m.empty(),
                 "[bench::comm] {} {}: rank {} of tandem disagrees with the reference: {}",
                 op_name(op), size_name(bytes), r, m);
  }

  Kernel tandem = [&](int reps) {
    pool.run([&](ProcessGroup& pg) {
      const Tensor& x = row.inputs[pg.rank()];
      for (int i = 0; i < reps; ++i)
        launch(op, pg, x)->synchronize();
    });
  };
  Kernel baseline = [&](int reps) {
    pool.run([&](ProcessGroup& pg) {
      for (int i = 0; i < reps; ++i)
        reference_once(pg);
    });
  };
  return time_interleaved(tandem, baseline, config);
}

void bench_threads(Report& report, const Options& options, const TimingConfig& config,
                   std::vector<Measured>& measured) {
  for (Op op : kOps) {
    for (int64_t bytes : row_sizes(options.quick)) {
      Row row;
      row.group = op_name(op);
      row.name = size_name(bytes);
      row.device = "cpu";
      row.threads = kRanks;
      row.baseline = op == Op::AllGather || op == Op::AllToAll
                         ? "memcpy of peer shards between barriers"
                         : "rank-order sum loop between barriers";
      bool targeted = (op == Op::AllGather || op == Op::AllToAll) && bytes >= kTargetFromBytes;
      row.target = targeted ? kThreadsTarget : 0.0;
      add_row(report, std::move(row), measured, Measured{"threads", op, bytes, kRanks, {}},
              [&] { return time_threads_row(op, bytes, config); });
    }
  }
}

// ---- the bandwidth table ----

void report_bandwidth(Report& report, const std::vector<Measured>& measured) {
  if (measured.empty()) return;
  Json rows = Json::array();
  std::string text = fmt::format(
      "\nbandwidth in GB/s (Note [Collective sizes]: algbw = S / t, busbw = algbw * "
      "2(n-1)/n for all_reduce, (n-1)/n otherwise)\n{:<8} {:<15} {:>7} {:>5}  {:>12} {:>12}  "
      "{:>12} "
      "{:>12}\n",
      "backend", "collective", "size", "ranks", "tandem alg", "tandem bus", "baseline alg",
      "baseline bus");
  for (const Measured& m : measured) {
    auto gbps = [&](double seconds) { return static_cast<double>(m.bytes) / seconds / 1e9; };
    double tandem_alg = gbps(m.timing.tandem.median_s);
    double baseline_alg = gbps(m.timing.baseline.median_s);
    double factor = bus_factor(m.op, m.ranks);
    rows.push_back({{"backend", m.backend},
                    {"collective", op_name(m.op)},
                    {"bytes", m.bytes},
                    {"ranks", m.ranks},
                    {"tandem_algbw_gbps", tandem_alg},
                    {"tandem_busbw_gbps", tandem_alg * factor},
                    {"baseline_algbw_gbps", baseline_alg},
                    {"baseline_busbw_gbps", baseline_alg * factor}});
    text += fmt::format("{:<8} {:<15} {:>7} {:>5}  {:>12.3f} {:>12.3f}  {:>12.3f} {:>12.3f}\n",
                        m.backend, op_name(m.op), size_name(m.bytes), m.ranks, tandem_alg,
                        tandem_alg * factor, baseline_alg, baseline_alg * factor);
  }
  text.pop_back();
  report.set("bandwidth", std::move(rows), text);
}

// The process count of an `mpirun` launch (Open MPI or an MPICH-style PMI),
// 1 when not launched by one.
int mpirun_size() {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE"}) {
    const char* value = std::getenv(name);
    if (value != nullptr && *value != '\0') return std::atoi(value);
  }
  return 1;
}

// ---- MPI backend ----

#if TANDEM_BENCH_HAVE_MPI

#define TANDEM_BENCH_MPI_CHECK(expr)                                                         \
  do {                                                                                       \
    int tandem_bench_mpi_rc_ = (expr);                                                       \
    TANDEM_CHECK(tandem_bench_mpi_rc_ == MPI_SUCCESS, "[bench::comm] {} returned {}", #expr, \
                 tandem_bench_mpi_rc_);                                                      \
  } while (0)

// Note [MPI lockstep]
// ~~~~~~~~~~~~~~~~~~~
// time_interleaved calibrates its repetition counts on its own clock, which
// differs between processes: run everywhere, the processes would issue
// different numbers of collectives and hang. So only rank 0 runs it; each of
// its kernel calls first broadcasts a Command (which side, how many calls) on
// a control communicator, and the other ranks run exactly the commands they
// receive until rank 0 ends the row. The broadcast is inside the timed
// region of both sides alike.
struct Command {
  int32_t side = 0;  // kDone, kTandem or kBaseline
  int32_t reps = 0;
};
constexpr int32_t kDone = 0, kTandem = 1, kBaseline = 2;

struct MpiRow {
  Op op;
  Counts counts;
  int size;
  Tensor input;  // tandem's input; the direct calls read the same memory
  std::vector<float> out;

  MpiRow(Op op_, int64_t bytes, int rank, int size_)
      : op(op_),
        counts(counts_of(op_, bytes, size_)),
        size(size_),
        input(make_input(rank, counts.in)),
        out(static_cast<size_t>(counts.out)) {}

  void direct(MPI_Comm comm) {
    const float* in = static_cast<const float*>(input.raw_data());
    MPI_Request request = MPI_REQUEST_NULL;
    switch (op) {
      case Op::AllReduce:
        TANDEM_BENCH_MPI_CHECK(MPI_Iallreduce(in, out.data(), static_cast<int>(counts.in),
                                              MPI_FLOAT, MPI_SUM, comm, &request));
        break;
      case Op::AllGather:
        TANDEM_BENCH_MPI_CHECK(MPI_Iallgather(in, static_cast<int>(counts.in), MPI_FLOAT,
                                              out.data(), static_cast<int>(counts.in), MPI_FLOAT,
                                              comm, &request));
        break;
      case Op::ReduceScatter:
        TANDEM_BENCH_MPI_CHECK(MPI_Ireduce_scatter_block(
            in, out.data(), static_cast<int>(counts.out), MPI_FLOAT, MPI_SUM, comm, &request));
        break;
      case Op::AllToAll: {
        const int chunk = static_cast<int>(counts.in / size);
        TANDEM_BENCH_MPI_CHECK(
            MPI_Ialltoall(in, chunk, MPI_FLOAT, out.data(), chunk, MPI_FLOAT, comm, &request));
        break;
      }
    }
    TANDEM_BENCH_MPI_CHECK(MPI_Wait(&request, MPI_STATUS_IGNORE));
  }

  void run(int32_t side, int reps, ProcessGroup& pg, MPI_Comm comm) {
    for (int i = 0; i < reps; ++i) {
      if (side == kTandem) {
        launch(op, pg, input)->synchronize();
      } else {
        direct(comm);
      }
    }
  }
};

// Every rank: builds the row, checks tandem against the direct calls (all
// ranks agree on the outcome), then times it in lockstep. Returns the timing
// on rank 0.
PairTiming time_mpi_row(Op op, int64_t bytes, ProcessGroup& pg, MPI_Comm control, MPI_Comm data,
                        const TimingConfig& config) {
  MpiRow row(op, bytes, pg.rank(), pg.size());
  WorkPtr w = launch(op, pg, row.input);
  w->synchronize();
  std::vector<float> tandem_out = w->result().to_vector<float>();
  row.direct(data);
  std::string m = mismatch(tandem_out, row.out);
  int bad = m.empty() ? 0 : 1, any_bad = 0;
  TANDEM_BENCH_MPI_CHECK(MPI_Allreduce(&bad, &any_bad, 1, MPI_INT, MPI_MAX, control));
  TANDEM_CHECK(any_bad == 0,
               "[bench::comm] {} {}: the MPI backend disagrees with direct MPI "
               "calls on some rank{}",
               op_name(op), size_name(bytes), m.empty() ? "" : fmt::format(" (here: {})", m));

  if (pg.rank() != 0) {
    for (;;) {
      Command c;
      TANDEM_BENCH_MPI_CHECK(MPI_Bcast(&c, 2, MPI_INT32_T, 0, control));
      if (c.side == kDone) return {};
      row.run(c.side, c.reps, pg, data);
    }
  }
  auto side_kernel = [&](int32_t side) -> Kernel {
    return [&, side](int reps) {
      Command c{side, reps};
      TANDEM_BENCH_MPI_CHECK(MPI_Bcast(&c, 2, MPI_INT32_T, 0, control));
      row.run(side, reps, pg, data);
    };
  };
  PairTiming timing = time_interleaved(side_kernel(kTandem), side_kernel(kBaseline), config);
  Command done{kDone, 0};
  TANDEM_BENCH_MPI_CHECK(MPI_Bcast(&done, 2, MPI_INT32_T, 0, control));
  return timing;
}

// Runs the MPI rows; false (with a note) when MPI cannot be used here.
bool bench_mpi(Report& report, const Options& options, const TimingConfig& config,
               std::vector<Measured>& measured) {
  // The bench thread calls MPI next to the backend's executor thread, so it
  // initialises MPI itself and needs MPI_THREAD_MULTIPLE.
  int initialized = 0, provided = MPI_THREAD_SINGLE;
  TANDEM_BENCH_MPI_CHECK(MPI_Initialized(&initialized));
  if (initialized == 0) {
    TANDEM_BENCH_MPI_CHECK(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided));
  } else {
    TANDEM_BENCH_MPI_CHECK(MPI_Query_thread(&provided));
  }
  if (provided != MPI_THREAD_MULTIPLE) {
    report.set("mpi", {{"skipped", true}, {"reason", "MPI_THREAD_MULTIPLE not granted"}},
               "MPI rows skipped: MPI did not grant MPI_THREAD_MULTIPLE (the benchmark calls MPI "
               "directly next to the backend's executor thread)");
    finalize_backend("mpi");
    return false;
  }
  ProcessGroupPtr world = create_world("mpi");
  ProcessGroupOptions unchecked_options;
  unchecked_options.checked = false;
  unchecked_options.name = "unchecked";
  ProcessGroupPtr unchecked = create_world("mpi", unchecked_options);
  MPI_Comm control = MPI_COMM_NULL, data = MPI_COMM_NULL;
  TANDEM_BENCH_MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &control));
  TANDEM_BENCH_MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &data));
  report.set("mpi", {{"skipped", false}, {"ranks", world->size()}},
             fmt::format("MPI rows: {} processes, the MPI backend (checked mode; the rows marked "
                         "unchecked without it) against direct nonblocking MPI calls + MPI_Wait",
                         world->size()));
  for (Op op : kOps) {
    for (int64_t bytes : row_sizes(options.quick)) {
      Row row;
      row.group = op_name(op);
      row.name = size_name(bytes);
      row.device = "cpu";
      row.threads = world->size();
      row.baseline = "direct MPI_I* + MPI_Wait";
      row.target = bytes >= kTargetFromBytes ? kMpiTarget : 0.0;
      add_row(report, std::move(row), measured, Measured{"mpi", op, bytes, world->size(), {}},
              [&] { return time_mpi_row(op, bytes, *world, control, data, config); });
    }
    // The same calls without checked mode's fingerprint exchange (Note [Comm
    // benchmark method]); informative, no target.
    for (int64_t bytes : row_sizes(options.quick)) {
      if (bytes < kTargetFromBytes) continue;
      Row row;
      row.group = op_name(op);
      row.name = size_name(bytes) + " unchecked";
      row.device = "cpu";
      row.threads = world->size();
      row.baseline = "direct MPI_I* + MPI_Wait";
      add_row(report, std::move(row), measured, Measured{"mpi-unch", op, bytes, world->size(), {}},
              [&] { return time_mpi_row(op, bytes, *unchecked, control, data, config); });
    }
  }
  TANDEM_BENCH_MPI_CHECK(MPI_Comm_free(&control));
  TANDEM_BENCH_MPI_CHECK(MPI_Comm_free(&data));
  world.reset();
  unchecked.reset();
  finalize_backend("mpi");
  return true;
}

#else
// Built without MPI: never reached (backend_available("mpi") is false).
bool bench_mpi(Report&, const Options&, const TimingConfig&, std::vector<Measured>&) {
  return false;
}
#endif

}  // namespace

int run_comm(const Options& options) {
  TimingConfig config = timing_config(options);
  std::vector<Measured> measured;
  const int launched = mpirun_size();
  if (launched > 1 && backend_available("mpi")) {
    // Every process measures; rank 0 alone prints (Note [MPI lockstep]):
    // the others keep a silent report (JSON mode, never finished). MPI is not
    // initialised yet, so the rank comes from the launcher's environment.
    const char* rank_env = std::getenv("OMPI_COMM_WORLD_RANK");
    if (rank_env == nullptr) rank_env = std::getenv("PMI_RANK");
    const bool zero = rank_env == nullptr || std::atoi(rank_env) == 0;
    Options mine = options;
    if (!zero) mine.json = true;
    Report report("comm", mine, config);
    report.note("threads rows skipped: launched by mpirun (run without it for the threads rows)");
    bench_mpi(report, options, config, measured);
    if (!zero) return 0;
    report_bandwidth(report, measured);
    return report.finish();
  }
  Report report("comm", options, config);
  const double trip = core_round_trip_ns();
  report.set("core_round_trip_ns", trip,
             trip > 0 ? fmt::format("cache-line round trip CPU 0 -> 1 -> 0: {:.0f} ns (Note [Core "
                                    "round trip]: ~85 one L3, ~390 two)",
                                    trip)
                      : "cache-line round trip: not measured (CPUs 0 and 1 not both available)");
  bench_threads(report, options, config, measured);
  report_bandwidth(report, measured);
  if (launched > 1) {
    report.set("mpi", {{"skipped", true}, {"reason", "built without MPI"}},
               "MPI rows skipped: tandem was built without MPI");
  } else {
    std::string reason = backend_available("mpi")
                             ? "not launched by mpirun (run `mpirun -n 4 tandem-bench comm`)"
                             : "tandem was built without MPI";
    report.set("mpi", {{"skipped", true}, {"reason", reason}}, "MPI rows skipped: " + reason);
  }
  return report.finish();
}

}  // namespace tandem::bench
