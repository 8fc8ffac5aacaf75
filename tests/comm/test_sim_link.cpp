// Simulated links (Note [Simulated link timing]): completion is delayed by
// latency + bytes / bandwidth, values are those of the inner group, the host
// is free meanwhile and the wait burns no CPU.
//
// Timing bounds are generous (the machines here are small and shared): lower
// bounds are exact, since a deadline never fires early; upper bounds leave
// hundreds of milliseconds of slack. Rank functions record what they saw and
// the test thread asserts (Catch2's assertions are not thread-safe).
#include <catch2/catch.hpp>

#include <time.h>

#include <chrono>
#include <limits>
#include <string>
#include <vector>

#include "tandem/comm/sim_link.h"
#include "tandem/comm/threads/threads_backend.h"
#include "tandem/runtime/trace.h"
#include "tests/support/test_util.h"

namespace tandem {
namespace {

using Catch::Contains;
using Clock = std::chrono::steady_clock;
using test::values_of;

constexpr double kInfinite = std::numeric_limits<double>::infinity();

double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

double process_cpu_ms() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e3 + static_cast<double>(ts.tv_nsec) * 1e-6;
}

LinkModel latency_only(double latency_ms) {
  return LinkModel{latency_ms * 1e3, kInfinite, {}};
}

// Per-rank measurements, written by rank r only.
struct PerRank {
  explicit PerRank(int world)
      : elapsed_ms(static_cast<size_t>(world)), values(static_cast<size_t>(world)) {}
  std::vector<double> elapsed_ms;
  std::vector<std::vector<double>> values;
};

TEST_CASE("LinkModel: transfer time and presets", "[sim]") {
  LinkModel m{10.0, 100.0, {}};  // 10 us, 100 GB/s
  CHECK(m.transfer_us(CollectiveKind::AllReduce, 0) == Approx(10.0));
  CHECK(m.transfer_us(CollectiveKind::AllReduce, 1e9) == Approx(10.0 + 1e4));  // 1 GB: 10 ms
  m.overrides[CollectiveKind::AllToAll] = LinkCost{1.0, 10.0};
  CHECK(m.transfer_us(CollectiveKind::AllToAll, 1e6) == Approx(1.0 + 100.0));
  CHECK(m.transfer_us(CollectiveKind::AllGather, 1e6) == Approx(10.0 + 10.0));

  LinkModel nvlink = LinkModel::nvlink(), ib = LinkModel::infiniband();
  CHECK(nvlink.bandwidth_gbps == Approx(450.0));  // H100 NVLink4, one direction
  CHECK(ib.bandwidth_gbps == Approx(50.0));       // 400 Gb/s NDR
  CHECK(nvlink.latency_us < ib.latency_us);

  run_ranks(1, [](ProcessGroupPtr pg) {
    LinkModel bad{1.0, 0.0, {}};
    CHECK_THROWS_WITH(simulate_link(pg, bad), Contains("bandwidth > 0"));
  });
}

TEST_CASE("latency: a tiny all_reduce completes after the latency, with its value", "[sim]") {
  const int world = 2;
  PerRank seen(world);
  std::vector<std::string> names(world);
  run_ranks(world, [&](ProcessGroupPtr pg) {
    ProcessGroupPtr link = simulate_link(pg, latency_only(20));
    names[pg->rank()] = fmt::format("{} {}/{} {}", link->backend_name(), link->rank(), link->size(),
                                    link->options().name);
    Clock::time_point start = Clock::now();
    WorkPtr w = link->all_reduce(ops::full({4}, pg->rank() + 1));
    w->synchronize();
    seen.elapsed_ms[pg->rank()] = ms_since(start);
    seen.values[pg->rank()] = values_of(w->result());
  });
  for (int r = 0; r < world; ++r) {
    INFO("rank " << r);
    CHECK(names[r] == fmt::format("sim(threads) {}/2 world", r));
    CHECK(seen.elapsed_ms[r] >= 20.0);
    CHECK(seen.elapsed_ms[r] < 500.0);
    CHECK(seen.values[r] == std::vector<double>(4, 3.0));
  }
}

// Each case moves `bytes` per rank by the nccl-tests conventions; the
// bandwidth makes that take 100 ms.
TEST_CASE("bandwidth: time is bytes / bandwidth by the bus-bandwidth conventions", "[sim]") {
  const int world = 4;
  const int64_t n = 16384;       // f32 elements of the per-rank buffer S (64 KiB)
  const double s = 4.0 * n;      // bytes
  const double target_ms = 100;  // simulated time of every case
  struct Case {
    const char* name;
    double bytes;  // per rank
  };
  const Case cases[] = {
      {"all_reduce", 2.0 * (world - 1) / world * s},
      {"all_gather", (world - 1.0) / world * (s * world)},  // S of the gathered output
      {"reduce_scatter", (world - 1.0) / world * s},
      {"all_to_all", (world - 1.0) / world * s},
      {"send/recv", s},
  };
  for (const Case& c : cases) {
    DYNAMIC_SECTION(c.name) {
      PerRank seen(world);
      const double gbps = c.bytes / (target_ms * 1e-3) / 1e9;
      const std::string name = c.name;
      run_ranks(world, [&](ProcessGroupPtr pg) {
        ProcessGroupPtr link = simulate_link(pg, LinkModel{0.0, gbps, {}});
        const int rank = pg->rank();
        Tensor x = ops::full({n}, rank);
        Clock::time_point start = Clock::now();
        WorkPtr w;
        if (name == "all_reduce") {
          w = link->all_reduce(x);
        } else if (name == "all_gather") {
          w = link->all_gather(x);
        } else if (name == "reduce_scatter") {
          w = link->reduce_scatter(x);
        } else if (name == "all_to_all") {
          w = link->all_to_all_single(x);
        } else {
          P2POptions o;
          o.peer = rank ^ 1;  // pairs (0, 1) and (2, 3)
          w = rank % 2 == 0 ? link->send(x, o) : link->recv(x, o);
        }
        w->synchronize();
        seen.elapsed_ms[rank] = ms_since(start);
      });
      for (int r = 0; r < world; ++r) {
        INFO("rank " << r);
        CHECK(seen.elapsed_ms[r] >= target_ms - 0.01);
        CHECK(seen.elapsed_ms[r] < 1.5 * target_ms + 300.0);
      }
    }
  }
}

TEST_CASE("collectives of one group use the link one after another", "[sim]") {
  const int world = 2;
  PerRank seen(world);
  std::vector<double> first_ms(world);
  run_ranks(world, [&](ProcessGroupPtr pg) {
    ProcessGroupPtr link = simulate_link(pg, latency_only(50));
    Clock::time_point start = Clock::now();
    WorkPtr a = link->all_reduce(ops::ones({4}));
    WorkPtr b = link->all_reduce(ops::ones({4}));
    a->synchronize();
    first_ms[pg->rank()] = ms_since(start);
    b->synchronize();
    seen.elapsed_ms[pg->rank()] = ms_since(start);
  });
  for (int r = 0; r < world; ++r) {
    INFO("rank " << r);
    CHECK(first_ms[r] >= 50.0);
    CHECK(seen.elapsed_ms[r] >= 100.0);
    CHECK(seen.elapsed_ms[r] < 600.0);
  }
}

TEST_CASE("the host is free while a simulated transfer is in flight", "[sim]") {
  const int world = 2;
  const double delay_ms = 200, work_ms = 100;
  std::vector<double> total_ms(world);
  std::vector<int> completed_early(world, -1);
  run_ranks(world, [&](ProcessGroupPtr pg) {
    ProcessGroupPtr link = simulate_link(pg, latency_only(delay_ms));
    Clock::time_point start = Clock::now();
    WorkPtr w = link->all_reduce(ops::ones({16}));
    completed_early[pg->rank()] = w->is_completed() ? 1 : 0;
    if (pg->rank() == 0) {
      // Host work while the transfer is in flight.
      volatile double sink = 0;
      while (ms_since(start) < work_ms)
        sink = sink + 1.0;
    }
    w->synchronize();
    total_ms[pg->rank()] = ms_since(start);
  });
  CHECK(completed_early[0] == 0);
  CHECK(completed_early[1] == 0);
  // max(work, delay) = 200 ms, not the sum (300 ms).
  CHECK(total_ms[0] >= delay_ms);
  CHECK(total_ms[0] < delay_ms + 0.7 * work_ms);
}

TEST_CASE("the simulated delay uses no CPU", "[sim]") {
  const int world = 2;
  const double delay_ms = 200;
  double wall_ms = 0, cpu_ms = 0;
  run_ranks(world, [&](ProcessGroupPtr pg) {
    ProcessGroupPtr link = simulate_link(pg, latency_only(delay_ms));
    link->barrier()->synchronize();  // both ranks start together
    double cpu_start = process_cpu_ms();
    Clock::time_point start = Clock::now();
    link->all_reduce(ops::ones({16}))->synchronize();
    if (pg->rank() == 0) {
      wall_ms = ms_since(start);
      cpu_ms = process_cpu_ms() - cpu_start;  // every thread of the process
    }
  });
  INFO("wall " << wall_ms << " ms, process CPU " << cpu_ms << " ms");
  CHECK(wall_ms >= delay_ms);
  CHECK(cpu_ms < 0.2 * wall_ms);
}

TEST_CASE("sub-groups through the wrapper", "[sim]") {
  const int world = 4;
  std::vector<std::string> backends(world);
  PerRank seen(world);
  run_ranks(world, [&](ProcessGroupPtr pg) {
    ProcessGroupPtr link = simulate_link(pg, latency_only(20));
    ProcessGroupPtr pair01 = link->split({0, 1}, "pair01");
    ProcessGroupPtr pair23 = link->split({2, 3}, "pair23");
    ProcessGroupPtr mine = pg->rank() < 2 ? pair01 : pair23;
    ProcessGroupPtr other = pg->rank() < 2 ? pair23 : pair01;
    if (!mine || other) {
      backends[pg->rank()] = "wrong membership";
      return;
    }
    backends[pg->rank()] = fmt::format("{} {}/{} {}", mine->backend_name(), mine->rank(),
                                       mine->size(), mine->options().name);
    Clock::time_point start = Clock::now();
    WorkPtr w = mine->all_reduce(ops::full({3}, pg->rank()));
    w->synchronize();
    seen.elapsed_ms[pg->rank()] = ms_since(start);
    seen.values[pg->rank()] = values_of(w->result());
  });
  for (int r = 0; r < world; ++r) {
    INFO("rank " << r);
    CHECK(backends[r] == fmt::format("sim(threads) {}/2 {}", r % 2, r < 2 ? "pair01" : "pair23"));
    CHECK(seen.elapsed_ms[r] >= 20.0);
    double expected = r < 2 ? 0 + 1 : 2 + 3;
    CHECK(seen.values[r] == std::vector<double>(3, expected));
  }
}

TEST_CASE("an inner failure completes the wrapper's Work at once, with the error", "[sim]") {
  const int world = 2;
  std::vector<std::string> errors(world);
  std::vector<double> elapsed(world);
  // Kept until every thread has been joined, so that the error they share
  // with the inner group's Work is freed here: ThreadSanitizer cannot see the
  // reference count of an exception inside the uninstrumented libstdc++.
  std::vector<WorkPtr> works(world);
  run_ranks(world, [&](ProcessGroupPtr pg) {
    ProcessGroupPtr link = simulate_link(pg, latency_only(5000));
    Clock::time_point start = Clock::now();
    works[pg->rank()] = link->all_reduce(ops::ones({4 + pg->rank()}));  // a size mismatch
    try {
      works[pg->rank()]->synchronize();
    } catch (const std::exception& e) {
      errors[pg->rank()] = e.what();
    }
    elapsed[pg->rank()] = ms_since(start);
  });
  for (int r = 0; r < world; ++r) {
    INFO("rank " << r);
    CHECK_THAT(errors[r], Contains("[comm::checked]"));
    CHECK(elapsed[r] < 2500.0);  // not held back by the 5 s link
  }
}

TEST_CASE("tracing shows each simulated transfer on its link lane", "[sim]") {
  trace_start();
  run_ranks(2, [](ProcessGroupPtr pg) {
    ProcessGroupPtr link = simulate_link(pg, latency_only(5));
    link->all_reduce(ops::ones({4}))->synchronize();
  });
  trace_stop();
  std::string json = trace_json();
  CHECK_THAT(json,
             Contains("link r0 world") && Contains("link r1 world") && Contains("all_reduce #0"));
}

}  // namespace
}  // namespace tandem
