// Shared pieces of tandem-bench (DESIGN §9): the interleaved timer, the row
// type every sub-benchmark reports, and the report that prints them as a table
// or as one JSON object.
//
// Note [Benchmark timing]
// ~~~~~~~~~~~~~~~~~~~~~~~
// The machines here are small and shared, so absolute times drift by tens of
// percent from one second to the next. Every figure is therefore a ratio
// against a baseline measured in the same run, and the two sides are measured
// the same way, alternately: after a warm-up, each side gets a repetition count
// that makes one trial last at least `min_trial_s`; then trial i of one side
// runs right next to trial i of the other (tandem, baseline, baseline, tandem,
// … — the side that goes first alternates, so neither always inherits the
// caches or clock state the other left). The ratio of a row is the median over
// i of the ratio of those adjacent trials, so a slow drift of the machine
// cancels within each pair and a burst of noise spoils one pair that the
// median drops. Shown times are the median per-call time of each side.
#pragma once

#include <barrier>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace tandem::bench {

struct Options {
  bool json = false;   // one JSON object on stdout instead of the table
  bool quick = false;  // fewer and shorter trials (a smoke run)
  std::string filter;  // run only rows whose "group name" contains this
  // `cp` only: the attention layer's size; 0 = the subcommand's default.
  int64_t seq = 0, dim = 0, heads = 0;
  // `overlap` only: ep rank threads and micro-batches (0 = the default), and
  // where to write the Chrome trace of one overlapped step (empty: nowhere).
  int ranks = 0, micro_batches = 0;
  std::string trace;
  // `autograd`, `cp` and `overlap`: "cpu" (the default) or "cuda", the GPU
  // mode.
  std::string device = "cpu";
  // `cp` only: "threads" (the default: rank threads, simulated link and
  // plain) or "mpi" (one process per rank under mpirun -n 4, plain only).
  std::string backend = "threads";
  // `all`: when set, Report::finish() stores its JSON object here and
  // nothing is printed (the table is off too). Not owned: run_all's.
  nlohmann::ordered_json* collect = nullptr;
};

struct TimingConfig {
  int trials = 21;            // per side
  double min_trial_s = 0.02;  // one trial lasts at least this long
};
TimingConfig timing_config(const Options& options);

// Runs the measured operation `reps` times and returns once all of it has
// finished (a side that enqueues work synchronises its stream before returning).
using Kernel = std::function<void(int reps)>;

struct Timing {
  double median_s = 0;  // per call
  double min_s = 0;     // per call
  int reps = 0;         // calls per trial
  int trials = 0;
};
struct PairTiming {
  Timing tandem;
  Timing baseline;
  double ratio = 0;  // median over trials of baseline_i / tandem_i
};
// Note [Benchmark timing].
PairTiming time_interleaved(const Kernel& tandem, const Kernel& baseline,
                            const TimingConfig& config);

// The median of `v` (0 when empty).
double sample_median(std::vector<double> v);
// Whole steps timed one call per trial (`cp`, `overlap`: not time_interleaved).
Timing timing_of_steps(const std::vector<double>& per_step);

// A barrier of the rank threads of a multi-rank benchmark (run_ranks): each
// rank calls sync() at the same points. A rank that fails inside guard()
// drops out of the barrier (so its peers never wait for it) before its error
// reaches run_ranks.
class Lockstep {
 public:
  explicit Lockstep(int ranks) : barrier_(ranks) {}
  void sync() { barrier_.arrive_and_wait(); }
  void guard(const std::function<void()>& body);

 private:
  std::barrier<> barrier_;
};

// The error of a GPU row where no CUDA device exists: "[bench::<component>]
// expected a CUDA device, got …", saying how to get an emulated one.
std::string no_cuda_device_error(const std::string& component);

// Compares `got` (tandem) with `want` (baseline) elementwise:
// |got - want| <= atol + rtol * |want|. Returns an empty string when they
// agree, else a message naming the worst element.
std::string compare(const std::vector<float>& got, const std::vector<float>& want, double rtol,
                    double atol);

struct Row {
  std::string group;     // "matmul", "elementwise", "gpu-matmul"
  std::string name;      // "f32 1024x1024x1024", "gelu 16M"
  std::string device;    // "cpu", "cuda:0"
  int threads = 1;       // CPU threads of both sides; 0 on a GPU
  std::string baseline;  // what the baseline is ("cblas_sgemm", "loop", …)
  double flops = 0;      // per call; when > 0 the table shows rates, not times
  // A memory row: timing's median_s and min_s hold bytes, not seconds, and
  // the ratio is baseline bytes / tandem bytes (> 1: tandem holds less).
  bool memory = false;
  double target = 0;  // the row passes when ratio() >= target
  PairTiming timing;
  std::string error;  // set when the row could not be measured
  // Set, with the reason, when the row was not measured for a reason that is
  // no failure (a baseline without a GPU): neither passed nor an error.
  std::string skipped;

  // baseline time / tandem time (PairTiming::ratio): > 1 means tandem is faster.
  double ratio() const { return error.empty() && skipped.empty() ? timing.ratio : 0; }
  bool passed() const { return error.empty() && skipped.empty() && ratio() >= target; }
};

// Collects rows; in table mode prints each as it arrives, so a long run shows
// progress. finish() prints the summary (or the JSON object, or hands it to
// Options::collect).
class Report {
 public:
  Report(std::string benchmark, const Options& options, const TimingConfig& config);

  // Whether `row` passes Options::filter (checked before measuring it).
  bool wants(const Row& row) const;
  // A line of text above the table rows (table mode only).
  void note(const std::string& line);
  void add(Row row);
  // A top-level JSON field (e.g. "memory"); `text` is what the table shows.
  void set(const std::string& key, nlohmann::ordered_json value, const std::string& text);

  // Exit status: 0 when every row ran or was skipped (missed targets
  // included), 1 when a row failed with an error.
  int finish();

 private:
  std::string benchmark_;
  Options options_;
  nlohmann::ordered_json json_;
  std::vector<Row> rows_;
  bool header_printed_ = false;
};

// Note [Baselines on the kernels' instructions]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The baselines run the vector instructions tandem's CPU kernels were built
// for (ops::cpu_vector_isa(), from -Dcpu_arch), whatever the machine:
// - OpenBLAS (cblas_sgemm rows, LibTorch) with its kernels for that ISA,
//   SkylakeX for AVX-512 and Haswell for AVX2, through OPENBLAS_CORETYPE
//   (read when the library loads, hence the re-exec). Debian's OpenBLAS 0.3.21
//   otherwise picks by CPU model and falls back to far weaker kernels on CPUs
//   newer than it (Prescott, SSE3, on Intel's 2023 Xeons; Haswell on AMD Zen
//   4/5), which would flatter tandem.
// - PyTorch, on an AVX2 build of a machine with AVX-512, through
//   ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA and MKL_ENABLE_INSTRUCTIONS (Note
//   [Autograd baselines] in bench_autograd_baselines.cpp), as on an AVX2-only
//   machine.
// A user's own OPENBLAS_CORETYPE is kept; the reports name the kernels used.
//
// Note [Idle BLAS threads]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// After each call OpenBLAS's worker threads keep polling for the next one for
// 2^28 cycles (about 0.1 s) before they sleep. The rows alternate the two
// sides trial by trial (Note [Benchmark timing]), so those polling threads ran
// into the next tandem trial and took a core from tandem's kernel threads,
// whose split of a product (Note [GEMM split over threads] in
// tensor/cpu/gemm.cpp) then waits for the slowed one: a 2-thread row read
// anywhere from 0.5x to 1.1x from one run to the next. The re-exec sets
// OPENBLAS_THREAD_TIMEOUT=4 (2^4 cycles) unless the user set it, so that each
// side's trials run on cores the other side left idle; OpenBLAS then wakes its
// workers once per call, which its back-to-back calls within a trial barely
// notice (the rows' baseline GFLOP/s are those of the default).
// Whether this build's kernels target less than this CPU runs.
bool kernels_below_machine();
// OpenBLAS's core type for the kernels' ISA, or null (plain SSE2 builds).
const char* openblas_core_for_kernels();
// Sets OPENBLAS_CORETYPE to openblas_core_for_kernels() and
// OPENBLAS_THREAD_TIMEOUT (Note [Idle BLAS threads]) where they are unset, and
// re-executes this program with `argv` when it set either (returns when
// nothing is to be done or the exec failed).
void hold_blas_to_kernel_isa(char** argv);

// Sub-benchmarks. Each returns the process exit status.
int run_tensor(const Options& options);
int run_autograd(const Options& options);  // bench_autograd.cpp
// `autograd --device cuda` (run_autograd dispatches to it).
int run_autograd_cuda(const Options& options);  // bench_autograd_cuda.cpp
// The llama-block rows of `tandem-bench autograd` (bench_autograd_llama.cpp).
void bench_llama_block(Report& report, const Options& options);
// The attention rows of `autograd --device cuda` (bench_autograd_attention.cpp).
void bench_attention_cuda(Report& report, const Options& options);
int run_comm(const Options& options);     // bench_comm.cpp
int run_dtensor(const Options& options);  // bench_dtensor.cpp
int run_cp(const Options& options);       // bench_cp.cpp (--backend mpi: bench_cp_plain.cpp)
int run_overlap(const Options& options);  // bench_overlap.cpp
int run_fsdp(const Options& options);     // bench_fsdp.cpp
// The FSDP rows of `fsdp` (bench_fsdp_sharded.cpp).
void bench_fsdp_sharded(Report& report, const Options& options);
// Every sub-benchmark's --quick run in this process, as one JSON document
// written to `json_path` (stdout when empty); progress on stderr.
int run_all(const std::string& json_path);  // bench_all.cpp

}  // namespace tandem::bench
