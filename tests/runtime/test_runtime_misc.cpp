// The smaller runtime pieces: error macros, devices, workers, tracing and
// the per-thread log context.
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tandem/runtime/device.h"
#include "tandem/runtime/error.h"
#include "tandem/runtime/logging.h"
#include "tandem/runtime/trace.h"
#include "tandem/runtime/worker.h"
#include "tandem/runtime/worker_pair.h"
#include "tests/support/test_util.h"

using namespace tandem;
using Catch::Matchers::Contains;
using Catch::Matchers::StartsWith;
using tandem::test::ScopedWaitTimeout;
using tandem::test::sleep_ms;

// ---- errors ----

namespace {
int format_calls = 0;
int counted(int v) {
  ++format_calls;
  return v;
}
}  // namespace

TEST_CASE("TANDEM_CHECK formats its values and names file:line", "[error]") {
  int got = 64, want = 128;
  int line = 0;
  try {
    // clang-format off
    line = __LINE__; TANDEM_CHECK(got == want, "[test::op] expected {} == {}, got {} vs {} (a={})", "a", "b", got, want, "[8,64]");
    // clang-format on
    FAIL("TANDEM_CHECK did not throw");
  } catch (const Error& e) {
    std::string msg = e.what();
    REQUIRE_THAT(msg, StartsWith("[test::op] expected a == b, got 64 vs 128 (a=[8,64])"));
    REQUIRE_THAT(msg, Contains("test_runtime_misc.cpp:" + std::to_string(line)));
    REQUIRE_THAT(msg, !Contains("/"));  // basename only, not the build path
  }
}

TEST_CASE("TANDEM_CHECK formats only when the check fails", "[error]") {
  format_calls = 0;
  TANDEM_CHECK(true, "[test::op] never shown {}", counted(1));
  REQUIRE(format_calls == 0);
  REQUIRE_THROWS_AS([] { TANDEM_CHECK(false, "[test::op] shown {}", counted(2)); }(), Error);
  REQUIRE(format_calls == 1);
}

TEST_CASE("error types derive from std::runtime_error", "[error]") {
  REQUIRE_THROWS_AS(TANDEM_FAIL("[test::op] failed with {}", 7), std::runtime_error);
  REQUIRE_THROWS_WITH(TANDEM_FAIL("[test::op] failed with {}", 7),
                      StartsWith("[test::op] failed with 7 (test_runtime_misc.cpp:"));
  try {
    throw TimeoutError("waited too long");
  } catch (const Error& e) {
    REQUIRE(std::string(e.what()) == "waited too long");
  }
}

TEST_CASE("TANDEM_INTERNAL_ASSERT names the condition as a tandem bug", "[error]") {
  int n = 3;
  REQUIRE_NOTHROW([n] { TANDEM_INTERNAL_ASSERT(n == 3); }());
  try {
    TANDEM_INTERNAL_ASSERT(n == 4, "n was {}", n);
    FAIL("TANDEM_INTERNAL_ASSERT did not throw");
  } catch (const Error& e) {
    std::string msg = e.what();
    REQUIRE_THAT(msg, StartsWith("[internal] invariant `n == 4` failed at test_runtime_misc.cpp:"));
    REQUIRE_THAT(msg, Contains(": n was 3"));
    REQUIRE_THAT(msg, Contains("tandem bug"));
  }
}

// ---- devices ----

TEST_CASE("Device::parse accepts cpu and rejects garbage", "[device]") {
  REQUIRE(Device::parse("cpu") == Device::cpu());
  REQUIRE(Device::cpu().is_cpu());
  REQUIRE_FALSE(Device::cpu().is_cuda());
  REQUIRE(Device::cpu().str() == "cpu");
  REQUIRE(fmt::format("on {}", Device::cpu()) == "on cpu");
  REQUIRE(Device() == Device::cpu());

  for (const char* text : {"gpu", "CPU", "cuda:", "cuda:x", "cuda:1x", "cuda:-", "", " cpu"}) {
    INFO("text = \"" << text << "\"");
    try {
      Device::parse(text);
      FAIL("parse accepted garbage");
    } catch (const Error& e) {
      std::string msg = e.what();
      REQUIRE_THAT(msg, StartsWith("[runtime::Device] expected \"cpu\", \"cuda\" or \"cuda:N\""));
      REQUIRE_THAT(msg, Contains(std::string("got \"") + text + "\""));
    }
  }
}

TEST_CASE("CUDA devices are checked against the GPUs present", "[device]") {
  const int count = cuda_device_count();
  REQUIRE(count >= 0);
  REQUIRE(cuda_available() == (count > 0));
  REQUIRE(default_device() == (count > 0 ? Device::cuda(0) : Device::cpu()));
  if (!std::filesystem::exists("/dev/nvidiactl") && !cuda_emulated()) {
    // No driver on this machine: the count must be 0 whether or not the binary
    // has CUDA, unless the device is the emulated one (TANDEM_CUDA=emulated).
    REQUIRE(count == 0);
  }
  if (!built_with_cuda()) REQUIRE(count == 0);

  // One past the last GPU is always invalid, and the message says how many exist.
  REQUIRE_THROWS_WITH(Device::cuda(count),
                      Contains("expected a CUDA device index in [0, " + std::to_string(count) +
                               "), got " + std::to_string(count)));
  REQUIRE_THROWS_AS(Device::cuda(-1), Error);
  REQUIRE_THROWS_AS(Device::parse("cuda:" + std::to_string(count)), Error);
  if (count == 0) {
    REQUIRE_THROWS_AS(Device::parse("cuda"), Error);
    REQUIRE_THROWS_WITH(Device::parse("cuda:0"),
                        Contains(built_with_cuda() ? "no GPU" : "built without CUDA"));
  } else {
    Device d = Device::parse("cuda:0");
    REQUIRE(d.is_cuda());
    REQUIRE(d.index() == 0);
    REQUIRE(d.str() == "cuda:0");
    REQUIRE(Device::parse("cuda") == d);
    REQUIRE_FALSE(d == Device::cpu());
  }
}

// ---- workers ----

TEST_CASE("Worker runs closures in order on one thread with its own stream", "[worker]") {
  const Stream caller_stream = current_stream(Device::cpu());
  Worker w("fwd-worker");
  REQUIRE(w.name() == "fwd-worker");
  REQUIRE(w.stream().defined());
  // The worker's stream follows the mode of default streams.
  REQUIRE(w.stream().is_inline() == (default_cpu_stream_mode() == CpuStreamMode::Inline));
  REQUIRE_FALSE(w.stream() == caller_stream);

  std::vector<int> order;
  std::set<std::thread::id> threads;
  bool stream_is_workers = false;
  std::string name_seen;
  constexpr int kClosures = 200;
  for (int i = 0; i < kClosures; ++i) {
    w.submit([&, i] {
      if (i % 50 == 0) sleep_ms(2);
      order.push_back(i);
      threads.insert(std::this_thread::get_id());
      if (i == 0) {
        stream_is_workers = current_stream(Device::cpu()) == w.stream();
        name_seen = thread_name();
      }
    });
  }
  w.synchronize();
  REQUIRE(order.size() == static_cast<size_t>(kClosures));
  for (int i = 0; i < kClosures; ++i)
    REQUIRE(order[i] == i);
  REQUIRE(threads.size() == 1);
  REQUIRE(*threads.begin() != std::this_thread::get_id());
  REQUIRE(stream_is_workers);
  REQUIRE(name_seen == "fwd-worker");
  // The caller's current stream is untouched.
  REQUIRE(current_stream(Device::cpu()) == caller_stream);
}

// Note [Thread hand-off]: what the caller's stream still has to write before
// submit() is written before the closure's stream reads it, whichever mode
// the worker's stream has. The caller's write is held by a gate; the read is
// given 200 ms to run early, which it does at once when nothing orders it (a
// bound that could only hide that bug, never fail a correct runtime).
TEST_CASE("a Worker's closure runs after what the caller's stream had queued", "[worker]") {
  const CpuStreamMode saved = default_cpu_stream_mode();
  for (CpuStreamMode mode : {CpuStreamMode::Inline, CpuStreamMode::Async}) {
    INFO((mode == CpuStreamMode::Inline ? "inline" : "async") << " worker stream");
    int value = 0, seen = -1;
    std::atomic<bool> read{false};
    set_default_cpu_stream_mode(mode);
    Worker w("hand-off-worker");
    set_default_cpu_stream_mode(saved);
    Stream caller = Stream::create(Device::cpu(), CpuStreamMode::Async, "caller");
    test::Gate gate;  // after the worker and the stream: opened before they are joined
    {
      StreamGuard guard(caller);
      caller.enqueue(gate.waiter());
      caller.enqueue([&value] { value = 42; });
      w.submit([&] {
        current_stream(Device::cpu()).enqueue([&] {
          seen = value;
          read = true;
        });
      });
    }
    for (int i = 0; i < 200 && !read; ++i)
      sleep_ms(1);
    CHECK_FALSE(read);
    gate.open();
    w.synchronize();
    REQUIRE(read);
    REQUIRE(seen == 42);
  }
}

TEST_CASE("two workers run concurrently", "[worker]") {
  Worker a("a"), b("b");
  // Each waits for the other: completes only if both threads run at once.
  std::atomic<bool> a_in{false}, b_in{false};
  bool a_saw = false, b_saw = false;
  auto spin_until = [](std::atomic<bool>& flag) {
    for (int i = 0; i < 5000 && !flag; ++i)
      sleep_ms(1);
    return flag.load();
  };
  a.submit([&] {
    a_in = true;
    a_saw = spin_until(b_in);
  });
  b.submit([&] {
    b_in = true;
    b_saw = spin_until(a_in);
  });
  a.synchronize();
  b.synchronize();
  REQUIRE(a_saw);
  REQUIRE(b_saw);
}

TEST_CASE("Worker::synchronize rethrows the first error and the worker stays usable", "[worker]") {
  Worker w("failing-worker");
  bool skipped_ran = false;
  w.submit([] { throw Error("[test::worker] expected success, got first"); });
  w.submit([] { throw Error("[test::worker] expected success, got second"); });
  w.submit([&skipped_ran] { skipped_ran = true; });
  try {
    w.synchronize();
    FAIL("Worker::synchronize did not rethrow");
  } catch (const Error& e) {
    REQUIRE_THAT(std::string(e.what()), Contains("got first"));
  }
  REQUIRE_FALSE(skipped_ran);

  int value = 0;
  w.submit([&value] { value = 7; });
  REQUIRE_NOTHROW(w.synchronize());
  REQUIRE(value == 7);
  // Non-tandem exceptions travel too.
  w.submit([] { throw std::logic_error("plain logic error"); });
  REQUIRE_THROWS_AS(w.synchronize(), std::logic_error);
  REQUIRE_NOTHROW(w.synchronize());
}

// Note [Stuck worker]: a side that outlives its synchronize() gets another
// wait_timeout(); ending in it, its own error is the one rethrown.
TEST_CASE("WorkerPair: a side that ends after its synchronize timed out", "[worker]") {
  using namespace std::chrono;
  ScopedWaitTimeout timeout(milliseconds(300));
  WorkerPair pair;
  auto start = steady_clock::now();
  try {
    pair.run(
        [] {
          sleep_ms(400);
          throw Error("the forward side's own error");
        },
        [] {});
    FAIL("run returned");
  } catch (const Error& e) {
    CHECK_THAT(e.what(), Catch::Matchers::Contains("the forward side's own error"));
  }
  auto waited = duration_cast<milliseconds>(steady_clock::now() - start).count();
  CHECK(waited >= 390);
  CHECK(waited < 550);  // not the whole grace period (600 ms)

  // Ending late without an error: the timeout is what the caller sees.
  CHECK_THROWS_AS(pair.run([] {}, [] { sleep_ms(400); }), TimeoutError);
  // Both sides usable again (they run at the same time: an atomic count).
  std::atomic<int> ran{0};
  pair.run([&] { ++ran; }, [&] { ++ran; });
  CHECK(ran.load() == 2);
}

TEST_CASE("WorkerPair: a side stuck past the grace period aborts the process with a report",
          "[worker]") {
#if defined(__SANITIZE_THREAD__)
  // ThreadSanitizer kills a child that starts threads after a multi-threaded
  // fork (die_after_fork).
  WARN("SKIP: fork under ThreadSanitizer");
  std::cout << "SKIP: fork under ThreadSanitizer" << std::endl;
  return;
#endif
  int err[2];
  REQUIRE(::pipe(err) == 0);
  const pid_t child = ::fork();
  if (child == 0) {
    // Catch2's handler would report the abort into this test run's report
    // (the child shares its open files): let it kill the child instead.
    std::signal(SIGABRT, SIG_DFL);
    ::dup2(err[1], STDERR_FILENO);
    ::close(err[0]);
    set_wait_timeout(std::chrono::milliseconds(100));
    int local = 0;  // what the stuck closure uses: freed if run() unwound
    WorkerPair pair;
    try {
      pair.run(
          [&] {
            sleep_ms(5000);
            ++local;
          },
          [] {});
    } catch (...) {
    }
    ::_exit(0);  // not reached: run() aborts
  }
  ::close(err[1]);
  std::string report;
  char buf[4096];
  for (ssize_t n; (n = ::read(err[0], buf, sizeof(buf))) > 0;)
    report.append(buf, static_cast<size_t>(n));
  ::close(err[0]);
  int status = 0;
  ::waitpid(child, &status, 0);
  REQUIRE(WIFSIGNALED(status));
  CHECK(WTERMSIG(status) == SIGABRT);
  CHECK_THAT(report, Catch::Matchers::Contains("[runtime::WorkerPair] the forward-worker is still "
                                               "running a closure"));
  CHECK_THAT(report, Catch::Matchers::Contains("Note [Stuck worker]"));
}

TEST_CASE("a Worker inherits the creating thread's log context", "[worker][log]") {
  const LogContext saved = current_log_context();
  set_log_context(LogContext{3, 8});
  LogContext seen;
  {
    Worker w("ranked");
    w.submit([&seen] { seen = current_log_context(); });
    w.synchronize();
  }
  set_log_context(saved);
  REQUIRE(seen.rank == 3);
  REQUIRE(seen.world == 8);
}

// ---- tracing ----

TEST_CASE("TraceSpan records nothing while tracing is off", "[trace]") {
  trace_stop();
  REQUIRE_FALSE(trace_enabled());
  size_t before = trace_event_count();
  { TraceSpan span("test", "off-span"); }
  trace_complete("test", "off-complete", 0, 1);
  trace_instant("test", "off-instant");
  REQUIRE(trace_event_count() == before);
}

TEST_CASE("trace spans become Chrome trace events", "[trace]") {
  trace_start();
  REQUIRE(trace_enabled());
  REQUIRE(trace_event_count() == 0);  // start clears earlier events
  {
    TraceSpan span("test", "main-span");
    sleep_ms(3);
  }
  std::thread t([] {
    set_thread_name("trace-helper");
    TraceSpan span("test", "helper-span");
    sleep_ms(1);
  });
  t.join();
  trace_complete("comm", "all_gather", 10, 25, "\"seq\":17", "link \"0\"");
  trace_instant("test", "marker", "\"k\":1");
  trace_stop();
  { TraceSpan span("test", "after-stop"); }
  REQUIRE(trace_event_count() == 4);

  const std::string text = trace_json();
  nlohmann::json doc;
  REQUIRE_NOTHROW(doc = nlohmann::json::parse(text));
  REQUIRE(doc.contains("traceEvents"));
  const auto& events = doc["traceEvents"];
  REQUIRE(events.is_array());

  auto find = [&](const std::string& name) -> nlohmann::json {
    for (const auto& e : events) {
      if (e.value("name", "") == name) return e;
    }
    return nullptr;
  };
  auto lane_of = [&](int pid, int tid) -> std::string {
    for (const auto& e : events) {
      if (e["ph"] == "M" && e["name"] == "thread_name" && e["pid"] == pid && e["tid"] == tid) {
        return e["args"]["name"].get<std::string>();
      }
    }
    return "";
  };

  nlohmann::json main_span = find("main-span");
  REQUIRE(main_span.is_object());
  REQUIRE(main_span["ph"] == "X");
  REQUIRE(main_span["cat"] == "test");
  REQUIRE(main_span["ts"].is_number_integer());
  REQUIRE(main_span["ts"].get<int64_t>() >= 0);
  REQUIRE(main_span["dur"].get<int64_t>() >= 3000);  // slept 3 ms inside the span
  REQUIRE(main_span["pid"].is_number_integer());
  REQUIRE(main_span["tid"].is_number_integer());

  nlohmann::json helper = find("helper-span");
  REQUIRE(helper.is_object());
  REQUIRE(helper["ph"] == "X");
  REQUIRE(helper["dur"].get<int64_t>() >= 1000);
  REQUIRE(helper["ts"].get<int64_t>() >=
          main_span["ts"].get<int64_t>() + main_span["dur"].get<int64_t>());
  REQUIRE(helper["tid"] != main_span["tid"]);
  REQUIRE(lane_of(helper["pid"], helper["tid"]) == "trace-helper");

  nlohmann::json gather = find("all_gather");
  REQUIRE(gather.is_object());
  REQUIRE(gather["ts"] == 10);
  REQUIRE(gather["dur"] == 25);
  REQUIRE(gather["args"]["seq"] == 17);
  REQUIRE(lane_of(gather["pid"], gather["tid"]) == "link \"0\"");  // escaped and round-tripped

  nlohmann::json marker = find("marker");
  REQUIRE(marker.is_object());
  REQUIRE(marker["ph"] == "i");
  REQUIRE(marker["args"]["k"] == 1);
  REQUIRE_FALSE(marker.contains("dur"));

  REQUIRE(find("after-stop").is_null());

  // trace_write writes the same document.
  std::string path = (std::filesystem::temp_directory_path() /
                      ("tandem_trace_test_" + std::to_string(::getpid()) + ".json"))
                         .string();
  trace_write(path);
  std::ifstream in(path);
  std::stringstream file;
  file << in.rdbuf();
  std::filesystem::remove(path);
  REQUIRE(file.str() == text);
  REQUIRE_THROWS_AS(trace_write("/nonexistent-dir/trace.json"), Error);
}

TEST_CASE("trace pid is the rank of the recording thread", "[trace][log]") {
  trace_start();
  std::thread t([] {
    set_log_context(LogContext{5, 8});
    TraceSpan span("test", "rank-span");
  });
  t.join();
  trace_stop();
  nlohmann::json doc = nlohmann::json::parse(trace_json());
  bool found = false;
  for (const auto& e : doc["traceEvents"]) {
    if (e.value("name", "") == "rank-span") {
      found = true;
      REQUIRE(e["pid"] == 5);
    }
  }
  REQUIRE(found);
}

// ---- logging ----

TEST_CASE("log context is per thread with a process-wide default", "[log]") {
  const LogContext saved_thread = current_log_context();
  set_process_log_context(LogContext{0, 2});

  LogContext fresh;
  std::thread([&fresh] { fresh = current_log_context(); }).join();
  REQUIRE(fresh.rank == 0);
  REQUIRE(fresh.world == 2);

  set_log_context(LogContext{1, 4});
  REQUIRE(current_log_context().rank == 1);
  REQUIRE(current_log_context().world == 4);

  LogContext other_before, other_after;
  std::thread([&] {
    other_before = current_log_context();
    set_log_context(LogContext{6, 7});
    other_after = current_log_context();
  }).join();
  REQUIRE(other_before.rank == 0);  // the process default, not this thread's
  REQUIRE(other_after.rank == 6);
  REQUIRE(other_after.world == 7);
  REQUIRE(current_log_context().rank == 1);  // untouched by the other thread

  set_process_log_context(LogContext{});
  set_log_context(saved_thread);
}

TEST_CASE("LogCapture keeps the lines at its level from every thread, one capture at a time",
          "[log]") {
  const LogLevel before = log_level();
  {
    LogCapture log(LogLevel::Info);
    REQUIRE(log_level() == LogLevel::Info);
    log_debug("below the level {}", 1);
    log_info("kept {}", 2);
    std::thread([] { log_warn("from another thread"); }).join();
    REQUIRE(log.lines().size() == 2);
    REQUIRE(log.matching("kept 2").size() == 1);
    REQUIRE(log.matching("kept 2")[0].find(" I] kept 2") != std::string::npos);
    REQUIRE(log.matching("another thread").size() == 1);
    REQUIRE(log.matching("below the level").empty());
    REQUIRE_THROWS_WITH(LogCapture(), Catch::Contains("one capture at a time"));
  }
  REQUIRE(log_level() == before);
}

TEST_CASE("thread names are per thread", "[log]") {
  const std::string saved = thread_name();
  set_thread_name("main-test");
  std::string other = "unset";
  std::thread([&other] { other = thread_name(); }).join();
  REQUIRE(thread_name() == "main-test");
  REQUIRE(other.empty());
  set_thread_name(saved);
}

namespace {

// Runs fn with stderr redirected to a temporary file and returns what it wrote.
template <class F>
std::string capture_stderr(F&& fn) {
  std::fflush(stderr);
  std::FILE* tmp = std::tmpfile();
  REQUIRE(tmp != nullptr);
  int saved = ::dup(2);
  ::dup2(::fileno(tmp), 2);
  fn();
  std::fflush(stderr);
  ::dup2(saved, 2);
  ::close(saved);
  std::rewind(tmp);
  std::string out;
  char buf[512];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, tmp)) > 0)
    out.append(buf, n);
  std::fclose(tmp);
  return out;
}

}  // namespace

TEST_CASE("log lines carry the rank prefix and respect the level", "[log]") {
  const LogContext saved = current_log_context();
  const LogLevel saved_level = log_level();
  set_log_level(LogLevel::Info);
  REQUIRE(log_level() == LogLevel::Info);

  set_log_context(LogContext{2, 4});
  std::string ranked = capture_stderr([] {
    log_info("hello {}", 42);
    log_debug("hidden {}", 1);  // below the level
    log_warn("careful");
  });
  REQUIRE(ranked == "[tandem r2/4 I] hello 42\n[tandem r2/4 W] careful\n");

  set_log_context(LogContext{});
  std::string plain = capture_stderr([] { log_error("bad {}", "thing"); });
  REQUIRE(plain == "[tandem E] bad thing\n");

  set_log_level(LogLevel::Error);
  std::string quiet = capture_stderr([] {
    log_info("not shown");
    log_warn("not shown");
    log_error("shown");
  });
  REQUIRE(quiet == "[tandem E] shown\n");

  set_log_level(saved_level);
  set_log_context(saved);
}
