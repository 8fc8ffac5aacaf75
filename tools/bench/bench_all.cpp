// `tandem-bench all`: the --quick run of every sub-benchmark, one after the
// other in this process, collected into one JSON document:
//
//   {"tandem-bench": version, "machine": {...}, "quick": true,
//    "benchmarks": {"tensor": <what `tandem-bench tensor --quick --json`
//                   prints>, "autograd": ..., ...},
//    "runs": {"tensor": {"exit_status", "seconds", "rows", ...}, ...},
//    "total_seconds": ...}
//
// Each sub-benchmark keeps its own process-wide settings (BLAS threads,
// tracing, allocator cache); the thread count is restored between them so
// that each starts as it would in a fresh process. `comm` runs its threads
// rows (its MPI rows need `mpirun -n 4 tandem-bench comm`). A sub-benchmark
// that throws is recorded with its error and the others still run; the exit
// status is non-zero when one failed to run (missed targets are not failures).
#include <fmt/format.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <cblas.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <exception>
#include <fstream>
#include <string>
#include <thread>

#include "tandem/comm/backend.h"
#include "tandem/runtime/device.h"
#include "tandem/runtime/error.h"
#include "tandem/tensor/ops.h"
#include "tools/bench/bench.h"

#ifndef TANDEM_VERSION
#define TANDEM_VERSION "unknown"
#endif

namespace tandem::bench {
namespace {

using Json = nlohmann::ordered_json;

struct Sub {
  const char* name;
  int (*run)(const Options&);
};

const Sub kSubs[] = {
    {"tensor", run_tensor}, {"autograd", run_autograd},
    {"comm", run_comm},     {"dtensor", run_dtensor},
    {"cp", run_cp},         {"overlap", run_overlap},
    {"fsdp", run_fsdp},
};

// The first "key : value" line of a /proc file whose key starts with `key`.
std::string proc_field(const char* path, const std::string& key) {
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(key, 0) != 0) continue;
    const size_t colon = line.find(':');
    if (colon == std::string::npos) continue;
    const size_t start = line.find_first_not_of(" \t", colon + 1);
    return start == std::string::npos ? std::string() : line.substr(start);
  }
  return {};
}

std::string utc_now() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

Json machine() {
  char host[256] = {};
  if (gethostname(host, sizeof host - 1) != 0) host[0] = '\0';
  utsname u{};
  const bool have_uname = uname(&u) == 0;
  Json m = {
    {"hostname", host},
    {"cpu", proc_field("/proc/cpuinfo", "model name")},
    {"hardware_threads", std::thread::hardware_concurrency()},
    {"memory", proc_field("/proc/meminfo", "MemTotal")},
    {"os", have_uname ? fmt::format("{} {} {}", u.sysname, u.release, u.machine) : ""},
#if defined(__clang__)
    {"compiler", fmt::format("clang {}", __clang_version__)},
#elif defined(__GNUC__)
    {"compiler", fmt::format("gcc {}", __VERSION__)},
#else
    {"compiler", "unknown"},
#endif
#ifdef NDEBUG
    {"assertions", false},
#else
    {"assertions", true},
#endif
    {"openblas", openblas_get_config()},
    {"cuda_devices", cuda_device_count()},
    {"mpi_backend", backend_available("mpi")},
  };
  return m;
}

// The process count of an mpirun launch (Open MPI or a PMI launcher), 1 without.
int launched_ranks() {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE"}) {
    if (const char* value = std::getenv(name)) return std::atoi(value);
  }
  return 1;
}

void write_document(const Json& doc, const std::string& path) {
  if (path.empty()) {
    fmt::print("{}\n", doc.dump(2));
    std::fflush(stdout);
    return;
  }
  std::ofstream out(path, std::ios::binary);
  TANDEM_CHECK(out.good(), "[bench::all] expected a writable --json file, got \"{}\"", path);
  out << doc.dump(2) << "\n";
  out.close();
  TANDEM_CHECK(out.good(), "[bench::all] writing \"{}\" failed", path);
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

int run_all(const std::string& json_path) {
  TANDEM_CHECK(launched_ranks() <= 1,
               "[bench::all] expected a single process, got an mpirun launch of {} (for the MPI "
               "rows run `mpirun -n 4 tandem-bench comm --json`)",
               launched_ranks());
  const auto start = std::chrono::steady_clock::now();
  Json doc = {{"tandem-bench", TANDEM_VERSION},
              {"machine", machine()},
              {"started", utc_now()},
              {"quick", true},
              {"benchmarks", Json::object()},
              {"runs", Json::object()},
              {"total_seconds", 0.0}};
  if (!json_path.empty()) write_document(doc, json_path);  // fail early when unwritable
  const int threads = ops::num_threads();
  int status = 0;
  const int n = static_cast<int>(std::size(kSubs));
  for (int i = 0; i < n; ++i) {
    const Sub& sub = kSubs[i];
    fmt::print(stderr, "tandem-bench all: [{}/{}] {} --quick ...\n", i + 1, n, sub.name);
    const auto sub_start = std::chrono::steady_clock::now();
    Json result;
    Options options;
    options.quick = true;
    options.json = true;
    options.collect = &result;
    Json run;
    try {
      ops::set_num_threads(threads);
      const int rc = sub.run(options);
      run["exit_status"] = rc;
      if (rc != 0) status = 1;
    } catch (const std::exception& e) {
      run["exit_status"] = 1;
      run["error"] = e.what();
      result = {{"benchmark", sub.name}, {"error", e.what()}};
      status = 1;
    }
    const double seconds = seconds_since(sub_start);
    run["seconds"] = seconds;
    std::string rows;
    if (result.contains("summary")) {
      const Json& s = result["summary"];
      run["rows"] = s["rows"];
      run["passed"] = s["passed"];
      run["failed"] = s["failed"];
      run["errors"] = s["errors"];
      rows = fmt::format("{} rows: {} passed, {} below target, {} errors", s["rows"].dump(),
                         s["passed"].dump(), s["failed"].dump(), s["errors"].dump());
    } else {
      rows = run.contains("error") ? "ERROR: " + run["error"].get<std::string>() : "no report";
    }
    fmt::print(stderr, "tandem-bench all: [{}/{}] {} done in {:.1f} s: {}\n", i + 1, n, sub.name,
               seconds, rows);
    doc["benchmarks"][sub.name] = std::move(result);
    doc["runs"][sub.name] = std::move(run);
    doc["total_seconds"] = seconds_since(start);
    // Rewritten after each sub-benchmark, so an interrupted run keeps what finished.
    if (!json_path.empty()) write_document(doc, json_path);
  }
  ops::set_num_threads(threads);
  if (json_path.empty()) write_document(doc, json_path);
  fmt::print(stderr, "tandem-bench all: {} sub-benchmarks in {:.1f} s{}\n", n, seconds_since(start),
             json_path.empty() ? "" : ", written to " + json_path);
  return status;
}

}  // namespace tandem::bench
