// HookCoordinator (Note [Hook coordinator]): ordering observed with
// timestamps, alternation of the two threads' collectives under the MoE
// sync-hook role tables of DESIGN §8, and the disable / depart / recompute /
// gate / timeout / role-check rules.
//
// Catch2 is not thread-safe: worker threads only record (timestamps, messages,
// logs); every assertion runs on the test thread after the join.
#include <fmt/format.h>
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <atomic>
#include <chrono>
#include <exception>
#include <functional>
#include <future>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "runtime/error.h"
#include "runtime/hook_coordinator.h"
#include "runtime/recompute_flag.h"
#include "runtime/trace.h"
#include "runtime/worker_pair.h"

using namespace tandem;
using namespace std::chrono_literals;
using Catch::Matchers::Contains;

namespace {

using Clock = std::chrono::steady_clock;

HookInfo fwd(const std::string& name, int layer, int micro_batch) {
  return HookInfo{name, layer, /*backward=*/false, micro_batch};
}
HookInfo bwd(const std::string& name, int layer, int micro_batch) {
  return HookInfo{name, layer, /*backward=*/true, micro_batch};
}

HookCoordinatorOptions with_timeout(std::chrono::milliseconds timeout, bool gate = false) {
  HookCoordinatorOptions options;
  options.timeout = timeout;
  options.recompute_gate = gate;
  return options;
}

// What a side thread did: whether it threw, what, and how long it ran.
struct Outcome {
  bool threw = false;
  bool timeout = false;  // the exception was a TimeoutError
  std::string message;
  std::chrono::milliseconds elapsed{0};
};

// Runs `fn` on a thread, recording its outcome. The jthread joins on scope
// exit, so a failing REQUIRE never leaves a thread running.
std::jthread side_thread(Outcome& out, std::function<void()> fn) {
  return std::jthread([&out, fn = std::move(fn)] {
    Clock::time_point start = Clock::now();
    try {
      fn();
    } catch (const TimeoutError& e) {
      out.threw = out.timeout = true;
      out.message = e.what();
    } catch (const std::exception& e) {
      out.threw = true;
      out.message = e.what();
    }
    out.elapsed = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start);
  });
}

// Polls describe() until it contains `text` (a side has reached a wait).
bool wait_for_state(const HookCoordinator& coord, const std::string& text) {
  Clock::time_point deadline = Clock::now() + 20s;
  while (Clock::now() < deadline) {
    if (coord.describe().find(text) != std::string::npos) return true;
    std::this_thread::sleep_for(1ms);
  }
  return false;
}

// ---- a synthetic dual-pipe step: MoE layers through the sync hooks ----

// One barrier round as a side saw it.
struct Round {
  HookRole role;
  Clock::time_point returned;    // rendezvous returned: the op may start
  Clock::time_point dispatched;  // Comm only: the collective was enqueued
};

// Collectives in the order the two threads enqueued them.
class CommLog {
 public:
  void push(std::string what) {
    std::lock_guard<std::mutex> lock(mu_);
    order_.push_back(std::move(what));
  }
  std::vector<std::string> take() {
    std::lock_guard<std::mutex> lock(mu_);
    return std::move(order_);
  }

 private:
  std::mutex mu_;
  std::vector<std::string> order_;
};

// Fires the hook of DESIGN §8: notify_dispatched(prev), then rendezvous(next).
class HookDriver {
 public:
  HookDriver(HookCoordinator& coord, bool backward, int micro_batch, uint32_t seed)
      : coord_(coord), backward_(backward), micro_batch_(micro_batch), rng_(seed) {}

  void hook(const char* name, int layer, std::optional<HookRole> prev,
            std::optional<HookRole> next) {
    HookInfo info{name, layer, backward_, micro_batch_};
    if (prev) {
      if (*prev == HookRole::Comm && !rounds.empty() && rounds.back().role == HookRole::Comm) {
        rounds.back().dispatched = Clock::now();
      }
      coord_.notify_dispatched(*prev, info);
    }
    if (next) {
      coord_.rendezvous(*next, info);
      rounds.push_back(Round{*next, Clock::now(), {}});
    }
  }
  void comm(CommLog& log, const std::string& what) {
    log.push(fmt::format("{}:{}", backward_ ? "B" : "F", what));
    jitter();
  }
  void compute() { jitter(); }

  std::vector<Round> rounds;

 private:
  void jitter() { std::this_thread::sleep_for(std::chrono::microseconds(rng_() % 2000)); }

  HookCoordinator& coord_;
  bool backward_;
  int micro_batch_;
  std::mt19937 rng_;
};

constexpr int kLayers = 3;

// Forward of kLayers MoE layers: [A] dispatch [B] experts [C] combine [D] attention.
void forward_step(HookDriver& d, CommLog& log) {
  using R = HookRole;
  d.compute();  // embedding
  for (int l = 0; l < kLayers; ++l) {
    d.hook("A", l, R::Compute, R::Comm);
    d.comm(log, fmt::format("dispatch{}", l));
    d.hook("B", l, R::Comm, R::Compute);
    d.compute();  // experts
    d.hook("C", l, R::Compute, R::Comm);
    d.comm(log, fmt::format("combine{}", l));
    if (l + 1 < kLayers) {
      d.hook("D", l, R::Comm, R::Compute);
    } else {
      d.hook("D_LAST", l, R::Comm, std::nullopt);  // forward only notifies
    }
    d.compute();  // attention
  }
}

// Backward of the same layers, in reverse; the last layer's D is skipped.
void backward_step(HookDriver& d, CommLog& log) {
  using R = HookRole;
  for (int l = kLayers - 1; l >= 0; --l) {
    d.compute();  // attention backward
    if (l + 1 < kLayers) d.hook("D", l, R::Compute, R::Comm);
    d.comm(log, fmt::format("combine_bwd{}", l));
    d.hook("C", l, R::Comm, R::Compute);
    d.compute();  // experts backward
    d.hook("B", l, R::Compute, R::Comm);
    d.comm(log, fmt::format("dispatch_bwd{}", l));
    d.hook("A", l, R::Comm, R::Compute);
  }
  d.compute();
}

// Worked out by hand from the role tables: the backward's first collective
// precedes every rendezvous; then the barrier rounds alternate F, B, F, ...
const std::vector<std::string> kExpectedComms = {
    "B:combine_bwd2", "F:dispatch0", "B:dispatch_bwd2", "F:combine0",
    "B:combine_bwd1", "F:dispatch1", "B:dispatch_bwd1", "F:combine1",
    "B:combine_bwd0", "F:dispatch2", "B:dispatch_bwd0", "F:combine2",
};
constexpr int kRounds = 4 * kLayers - 1;

// Each round pairs one Comm with one Compute, and the Compute side's op
// started after the Comm side enqueued its collective. Returns "" or the
// first violation.
std::string check_rounds(const std::vector<Round>& f, const std::vector<Round>& b) {
  if (f.size() != b.size())
    return fmt::format("{} forward vs {} backward rounds", f.size(), b.size());
  for (size_t r = 0; r < f.size(); ++r) {
    if (f[r].role == b[r].role)
      return fmt::format("round {}: both sides {}", r + 1, to_string(f[r].role));
    const Round& comm = f[r].role == HookRole::Comm ? f[r] : b[r];
    const Round& compute = f[r].role == HookRole::Comm ? b[r] : f[r];
    if (comm.dispatched == Clock::time_point{}) return fmt::format("round {}: no dispatch", r + 1);
    if (compute.returned < comm.dispatched) {
      return fmt::format(
          "round {}: compute started {} us before the collective was enqueued", r + 1,
          std::chrono::duration_cast<std::chrono::microseconds>(comm.dispatched - compute.returned)
              .count());
    }
  }
  return {};
}

}  // namespace

TEST_CASE("coordinator: the compute op starts after the paired collective is dispatched",
          "[coordinator]") {
  HookCoordinator coord(with_timeout(30s));
  coord.enable();
  Clock::time_point comm_returned, dispatched, compute_started;
  Outcome f, b;
  {
    std::jthread ft = side_thread(f, [&] {
      coord.rendezvous(HookRole::Comm, fwd("A", 0, 1));
      comm_returned = Clock::now();
      std::this_thread::sleep_for(50ms);  // enqueueing the collective
      dispatched = Clock::now();
      coord.notify_dispatched(HookRole::Comm, fwd("B", 0, 1));
    });
    std::jthread bt = side_thread(b, [&] {
      coord.rendezvous(HookRole::Compute, bwd("C", 1, 0));
      compute_started = Clock::now();
    });
  }
  INFO(f.message << " / " << b.message);
  REQUIRE_FALSE(f.threw);
  REQUIRE_FALSE(b.threw);
  CHECK(compute_started >= dispatched);
  CHECK(compute_started - comm_returned >= 50ms);
  CHECK(coord.rounds() == 1);
}

TEST_CASE("coordinator: collectives of the two threads alternate in a fixed order",
          "[coordinator]") {
  HookCoordinator coord(with_timeout(30s));
  for (uint32_t rep = 0; rep < 3; ++rep) {
    CAPTURE(rep);
    coord.enable();
    CommLog log;
    HookDriver fd(coord, /*backward=*/false, 1, 100 + rep);
    HookDriver bd(coord, /*backward=*/true, 0, 200 + rep);
    Outcome f, b;
    {
      std::jthread ft = side_thread(f, [&] { forward_step(fd, log); });
      std::jthread bt = side_thread(b, [&] { backward_step(bd, log); });
    }
    INFO(f.message << " / " << b.message);
    REQUIRE_FALSE(f.threw);
    REQUIRE_FALSE(b.threw);
    CHECK(coord.rounds() == kRounds);
    CHECK(log.take() == kExpectedComms);
    CHECK(check_rounds(fd.rounds, bd.rounds) == "");
    coord.disable();
  }
}

TEST_CASE("coordinator: disable releases blocked waiters and later calls return at once",
          "[coordinator]") {
  HookCoordinator coord(with_timeout(30s));
  coord.enable();
  REQUIRE(coord.enabled());
  Outcome f, b;
  Clock::time_point disabled_at, f_released;

  SECTION("a waiter at the barrier, disabled from the test thread") {
    {
      std::jthread ft = side_thread(f, [&] {
        coord.rendezvous(HookRole::Comm, fwd("A", 0, 0));
        f_released = Clock::now();
      });
      REQUIRE(wait_for_state(coord,
                             "forward: rendezvous(Comm) at \"A\" (layer 0, forward, "
                             "micro-batch 0), waiting at the barrier"));
      disabled_at = Clock::now();
      coord.disable();
    }
    REQUIRE_FALSE(f.threw);
    CHECK(f_released - disabled_at < 2s);
  }

  SECTION("a waiter for the latch, disabled by its partner") {
    {
      std::jthread ft = side_thread(f, [&] {
        coord.rendezvous(HookRole::Compute, fwd("B", 0, 0));
        f_released = Clock::now();
      });
      std::jthread bt = side_thread(b, [&] {
        coord.rendezvous(HookRole::Comm, bwd("B", 0, 0));
        wait_for_state(coord, "waiting for the partner's collective");
        disabled_at = Clock::now();
        coord.disable();  // instead of notify_dispatched
        coord.disable();  // idempotent, from a participant
      });
    }
    REQUIRE_FALSE(f.threw);
    REQUIRE_FALSE(b.threw);
    CHECK(f_released - disabled_at < 2s);
    CHECK(coord.rounds() == 1);
  }

  coord.disable();  // idempotent
  CHECK_FALSE(coord.enabled());
  // Every call is now a no-op, from any thread, with no partner.
  Clock::time_point start = Clock::now();
  coord.rendezvous(HookRole::Comm, fwd("A", 1, 0));
  coord.notify_dispatched(HookRole::Comm, fwd("B", 1, 0));
  coord.rendezvous(HookRole::Comm, bwd("A", 1, 0));
  coord.depart(bwd("end", -1, 0));
  CHECK(Clock::now() - start < 1s);
}

TEST_CASE("coordinator: depart lets the other side run solo", "[coordinator]") {
  HookCoordinator coord(with_timeout(30s));
  coord.enable();
  Outcome f, b;

  SECTION("the partner waiting at the barrier is released") {
    Outcome after_depart;
    {
      std::jthread ft = side_thread(f, [&] {
        coord.rendezvous(HookRole::Comm, fwd("A", 0, 0));
        coord.notify_dispatched(HookRole::Comm, fwd("B", 0, 0));
        coord.rendezvous(HookRole::Compute, fwd("B", 0, 0));  // the backward departs here
        coord.notify_dispatched(HookRole::Compute, fwd("C", 0, 0));
        coord.rendezvous(HookRole::Comm, fwd("C", 0, 0));  // solo
        coord.notify_dispatched(HookRole::Comm, fwd("D", 0, 0));
        coord.rendezvous(HookRole::Compute, fwd("D", 0, 0));  // solo
      });
      std::jthread bt = side_thread(b, [&] {
        coord.rendezvous(HookRole::Compute, bwd("C", 0, 0));
        wait_for_state(coord,
                       "forward: rendezvous(Compute) at \"B\" (layer 0, forward, "
                       "micro-batch 0), waiting at the barrier");
        coord.depart(bwd("end", -1, 0));
        coord.depart(bwd("end", -1, 0));  // idempotent
        try {
          coord.rendezvous(HookRole::Comm, bwd("late", 0, 0));
        } catch (const Error& e) {
          after_depart.threw = true;
          after_depart.message = e.what();
        }
      });
    }
    INFO(f.message << " / " << b.message);
    REQUIRE_FALSE(f.threw);
    REQUIRE_FALSE(b.threw);
    CHECK(coord.rounds() == 1);
    CHECK(after_depart.threw);
    CHECK_THAT(after_depart.message, Contains("after its depart()"));
  }

  SECTION("depart sets the departing side's pending latch") {
    {
      std::jthread ft =
          side_thread(f, [&] { coord.rendezvous(HookRole::Compute, fwd("B", 0, 0)); });
      std::jthread bt = side_thread(b, [&] {
        coord.rendezvous(HookRole::Comm, bwd("B", 0, 0));
        wait_for_state(coord, "waiting for the partner's collective");
        coord.depart(bwd("end", -1, 0));  // its collective was enqueued
      });
    }
    INFO(f.message << " / " << b.message);
    REQUIRE_FALSE(f.threw);
    REQUIRE_FALSE(b.threw);
    CHECK(coord.rounds() == 1);
  }
  CHECK(coord.enabled());  // depart does not close the window
}

TEST_CASE("coordinator: calls made while recomputing are no-ops", "[coordinator]") {
  HookCoordinator coord(with_timeout(200ms));
  coord.enable();

  SECTION("alone: no wait, no registration") {
    {
      RecomputingScope recompute;
      CHECK(thread_is_recomputing());
      coord.rendezvous(HookRole::Comm, bwd("A", 0, 0));  // would time out
      coord.notify_dispatched(HookRole::Compute, bwd("B", 0, 0));
      coord.rendezvous(HookRole::Comm, bwd("B", 0, 0));
      {
        RecomputingScope nested(false);
        CHECK_FALSE(thread_is_recomputing());
      }
      CHECK(thread_is_recomputing());
    }
    CHECK_FALSE(thread_is_recomputing());
    CHECK(coord.rounds() == 0);
    CHECK(coord.enabled());
    CHECK_THAT(coord.describe(), Contains("backward: no call in this window"));
  }

  SECTION("a re-run between real rendezvous does not disturb the pairing") {
    Outcome f, b;
    {
      std::jthread ft = side_thread(f, [&] {
        coord.rendezvous(HookRole::Comm, fwd("A", 0, 1));
        coord.notify_dispatched(HookRole::Comm, fwd("B", 0, 1));
        coord.rendezvous(HookRole::Compute, fwd("B", 0, 1));
      });
      std::jthread bt = side_thread(b, [&] {
        {
          // Two Comm declarations in a row would be a role error if counted.
          RecomputingScope recompute;
          coord.rendezvous(HookRole::Comm, fwd("A", 1, 0));
          coord.rendezvous(HookRole::Comm, fwd("C", 1, 0));
        }
        coord.rendezvous(HookRole::Compute, bwd("C", 1, 0));
        coord.notify_dispatched(HookRole::Compute, bwd("B", 1, 0));
        coord.rendezvous(HookRole::Comm, bwd("B", 1, 0));
        coord.notify_dispatched(HookRole::Comm, bwd("A", 1, 0));
      });
    }
    INFO(f.message << " / " << b.message);
    REQUIRE_FALSE(f.threw);
    REQUIRE_FALSE(b.threw);
    CHECK(coord.rounds() == 2);
  }
}

TEST_CASE(
    "coordinator: the forward gate holds the forward thread until the backward's first "
    "real rendezvous",
    "[coordinator]") {
  Outcome f, b;

  SECTION("held at the gate, not at the barrier, while the backward recomputes") {
    HookCoordinator coord(with_timeout(30s, /*gate=*/true));
    coord.enable();
    Clock::time_point backward_entered, forward_returned;
    bool seen_at_gate = false;
    {
      std::jthread ft = side_thread(f, [&] {
        coord.rendezvous(HookRole::Comm, fwd("A", 0, 1));
        forward_returned = Clock::now();
        coord.notify_dispatched(HookRole::Comm, fwd("B", 0, 1));
      });
      std::jthread bt = side_thread(b, [&] {
        {
          RecomputingScope recompute;  // the re-run's hooks do not open the gate
          coord.rendezvous(HookRole::Comm, fwd("A", 1, 0));
          seen_at_gate = wait_for_state(coord, "waiting at the forward gate");
        }
        backward_entered = Clock::now();
        coord.rendezvous(HookRole::Compute, bwd("C", 1, 0));
      });
    }
    INFO(f.message << " / " << b.message);
    REQUIRE_FALSE(f.threw);
    REQUIRE_FALSE(b.threw);
    CHECK(seen_at_gate);
    CHECK(forward_returned >= backward_entered);
    CHECK(coord.rounds() == 1);
  }

  SECTION("a departing backward opens the gate") {
    HookCoordinator coord(with_timeout(30s, /*gate=*/true));
    coord.enable();
    {
      std::jthread ft = side_thread(f, [&] { coord.rendezvous(HookRole::Comm, fwd("A", 0, 1)); });
      std::jthread bt = side_thread(b, [&] {
        wait_for_state(coord, "waiting at the forward gate");
        coord.depart(bwd("end", -1, 0));
      });
    }
    REQUIRE_FALSE(f.threw);
    REQUIRE_FALSE(b.threw);
    CHECK(coord.rounds() == 0);
  }

  SECTION("the gate wait is bounded") {
    HookCoordinator coord(with_timeout(200ms, /*gate=*/true));
    coord.enable();
    {
      std::jthread ft = side_thread(f, [&] { coord.rendezvous(HookRole::Comm, fwd("A", 0, 1)); });
    }
    REQUIRE(f.timeout);
    CHECK_THAT(f.message, Contains("forward gate"));
    CHECK_FALSE(coord.enabled());
  }
}

TEST_CASE(
    "coordinator: a timeout names both last hooks, closes the window and releases the "
    "partner",
    "[coordinator]") {
  HookCoordinator coord(with_timeout(200ms));
  coord.enable();
  Outcome f, b, b_again;
  std::promise<void> forward_done;
  std::shared_future<void> forward_done_future = forward_done.get_future().share();
  std::promise<void> backward_ready;
  std::future<void> backward_ready_future = backward_ready.get_future();

  SECTION("waiting at the barrier") {
    {
      std::jthread bt = side_thread(b, [&] {
        coord.notify_dispatched(HookRole::Comm, bwd("combine", 1, 0));
        backward_ready.set_value();
        forward_done_future.wait();
        Clock::time_point start = Clock::now();
        try {
          coord.rendezvous(HookRole::Compute, bwd("experts", 1, 0));
        } catch (const std::exception& e) {
          b_again.threw = true;
          b_again.message = e.what();
        }
        b_again.elapsed =
            std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start);
        coord.rendezvous(HookRole::Compute, bwd("experts", 1, 0));  // now a no-op
      });
      std::jthread ft = side_thread(f, [&] {
        backward_ready_future.wait();
        try {
          coord.rendezvous(HookRole::Comm, fwd("dispatch", 0, 1));
        } catch (...) {
          forward_done.set_value();
          throw;
        }
        forward_done.set_value();
      });
    }
    INFO(f.message);
    REQUIRE(f.timeout);
    CHECK(f.elapsed >= 190ms);
    CHECK_THAT(f.message, Contains("the backward thread at the barrier of round 1"));
    CHECK_THAT(f.message, Contains("within 200 ms"));
    CHECK_THAT(f.message, Contains("forward: rendezvous(Comm) at \"dispatch\" (layer 0, forward, "
                                   "micro-batch 1), waiting at the barrier"));
    CHECK_THAT(f.message,
               Contains("backward: notify_dispatched(Comm) at \"combine\" (layer 1, backward, "
                        "micro-batch 0), running"));
    // The partner's next call fails at once, once; later calls are no-ops.
    INFO(b_again.message);
    CHECK(b_again.threw);
    CHECK_THAT(b_again.message, Contains("closed by the partner's timeout"));
    CHECK_THAT(b_again.message, Contains("\"dispatch\""));
    CHECK(b_again.elapsed < 1s);
    CHECK_FALSE(b.threw);
  }

  SECTION("waiting for the partner's collective") {
    {
      std::jthread bt = side_thread(b, [&] {
        coord.rendezvous(HookRole::Comm, bwd("dispatch_bwd", 2, 0));
        forward_done_future.wait();  // a collective that takes too long to enqueue
        coord.notify_dispatched(HookRole::Comm, bwd("A", 2, 0));
      });
      std::jthread ft = side_thread(f, [&] {
        try {
          coord.rendezvous(HookRole::Compute, fwd("experts", 0, 1));
        } catch (...) {
          forward_done.set_value();
          throw;
        }
        forward_done.set_value();
      });
    }
    INFO(f.message);
    REQUIRE(f.timeout);
    CHECK_THAT(f.message, Contains("notify_dispatched(Comm) from the backward thread for round 1"));
    CHECK_THAT(f.message, Contains("\"experts\" (layer 0, forward, micro-batch 1)"));
    CHECK_THAT(f.message, Contains("\"dispatch_bwd\" (layer 2, backward, micro-batch 0)"));
    CHECK(b.threw);
    CHECK_FALSE(b.timeout);
    CHECK_THAT(b.message, Contains("closed by the partner's timeout"));
  }

  CHECK_FALSE(coord.enabled());
}

TEST_CASE("coordinator: role errors name both hooks and close the window", "[coordinator]") {
  HookCoordinator coord(with_timeout(30s));
  coord.enable();
  Outcome f, b;

  SECTION("Comm paired with Comm") {
    {
      std::jthread ft =
          side_thread(f, [&] { coord.rendezvous(HookRole::Comm, fwd("dispatch", 0, 2)); });
      std::jthread bt =
          side_thread(b, [&] { coord.rendezvous(HookRole::Comm, bwd("combine", 1, 1)); });
    }
    for (const Outcome* o : {&f, &b}) {
      INFO(o->message);
      CHECK(o->threw);
      CHECK_FALSE(o->timeout);
      CHECK_THAT(o->message, Contains("expected one Comm and one Compute at a rendezvous, got "
                                      "Comm from both"));
      CHECK_THAT(o->message, Contains("forward at \"dispatch\" (layer 0, forward, micro-batch 2)"));
      CHECK_THAT(o->message,
                 Contains("backward at \"combine\" (layer 1, backward, micro-batch 1)"));
    }
  }

  SECTION("notify_dispatched with the other role") {
    {
      std::jthread ft = side_thread(f, [&] {
        coord.rendezvous(HookRole::Comm, fwd("A", 0, 2));
        coord.notify_dispatched(HookRole::Compute, fwd("B", 0, 2));
      });
      std::jthread bt =
          side_thread(b, [&] { coord.rendezvous(HookRole::Compute, bwd("C", 1, 1)); });
    }
    INFO(f.message << " / " << b.message);
    CHECK(f.threw);
    CHECK_THAT(f.message, Contains("expected notify_dispatched(Comm)"));
    CHECK_THAT(f.message, Contains("got notify_dispatched(Compute) at \"B\""));
    CHECK(b.threw);
    CHECK_THAT(b.message, Contains("closed by the partner's role error"));
  }

  SECTION("a rendezvous before the own collective was notified") {
    {
      std::jthread ft = side_thread(f, [&] {
        coord.rendezvous(HookRole::Comm, fwd("A", 0, 2));
        coord.rendezvous(HookRole::Compute, fwd("B", 0, 2));
      });
      std::jthread bt =
          side_thread(b, [&] { coord.rendezvous(HookRole::Compute, bwd("C", 1, 1)); });
    }
    INFO(f.message << " / " << b.message);
    CHECK(f.threw);
    CHECK_THAT(f.message, Contains("expected notify_dispatched(Comm)"));
    CHECK(b.threw);
    CHECK_THAT(b.message, Contains("closed by the partner's role error"));
  }

  CHECK_FALSE(coord.enabled());
}

TEST_CASE("coordinator: a window has one forward and one backward thread", "[coordinator]") {
  HookCoordinator coord(with_timeout(30s));
  coord.enable();
  coord.notify_dispatched(HookRole::Compute, fwd("A", 0, 0));  // the test thread is forward
  CHECK_THROWS_WITH(coord.notify_dispatched(HookRole::Compute, bwd("A", 0, 0)),
                    Contains("expected forward hooks from the forward thread"));
  Outcome other;
  {
    std::jthread t =
        side_thread(other, [&] { coord.notify_dispatched(HookRole::Compute, fwd("A", 0, 1)); });
  }
  CHECK(other.threw);
  CHECK_THAT(other.message, Contains("expected one forward thread per window"));
  CHECK(coord.enabled());  // misuse by one thread does not close the window
}

TEST_CASE("coordinator: enable opens a fresh window", "[coordinator]") {
  HookCoordinator coord(with_timeout(200ms));
  auto pair_once = [&](Outcome& f, Outcome& b) {
    std::jthread ft = side_thread(f, [&] {
      coord.rendezvous(HookRole::Comm, fwd("A", 0, 0));
      coord.notify_dispatched(HookRole::Comm, fwd("B", 0, 0));
    });
    std::jthread bt = side_thread(b, [&] { coord.rendezvous(HookRole::Compute, bwd("C", 0, 0)); });
  };
  CHECK_FALSE(coord.enabled());  // starts disabled

  SECTION("after a timeout") {
    coord.enable();
    Outcome t;
    {
      std::jthread ft = side_thread(t, [&] { coord.rendezvous(HookRole::Comm, fwd("A", 0, 0)); });
    }
    REQUIRE(t.timeout);
  }
  SECTION("after a role error") {
    coord.enable();
    Outcome f, b;
    {
      std::jthread ft =
          side_thread(f, [&] { coord.rendezvous(HookRole::Compute, fwd("A", 0, 0)); });
      std::jthread bt =
          side_thread(b, [&] { coord.rendezvous(HookRole::Compute, bwd("A", 0, 0)); });
    }
    REQUIRE(f.threw);
    REQUIRE(b.threw);
  }
  SECTION("over an open window with a waiter") {
    coord.enable();
    Outcome w;
    {
      std::jthread ft = side_thread(w, [&] { coord.rendezvous(HookRole::Comm, fwd("A", 0, 0)); });
      REQUIRE(wait_for_state(coord, "waiting at the barrier"));
      coord.enable();  // releases the old window's waiter
    }
    REQUIRE_FALSE(w.threw);
    coord.disable();
  }

  CHECK_FALSE(coord.enabled());
  coord.enable();
  CHECK(coord.enabled());
  CHECK(coord.rounds() == 0);
  CHECK_THAT(coord.describe(), Contains("forward: no call in this window"));
  Outcome f, b;
  pair_once(f, b);
  INFO(f.message << " / " << b.message);
  CHECK_FALSE(f.threw);
  CHECK_FALSE(b.threw);
  CHECK(coord.rounds() == 1);
}

TEST_CASE("coordinator: rendezvous, notify, gate and depart are traced", "[coordinator]") {
  HookCoordinator coord(with_timeout(30s, /*gate=*/true));
  trace_start();
  coord.enable();
  Outcome f, b;
  {
    std::jthread ft = side_thread(f, [&] {
      coord.rendezvous(HookRole::Comm, fwd("dispatch", 0, 3));
      coord.notify_dispatched(HookRole::Comm, fwd("experts", 0, 3));
    });
    std::jthread bt = side_thread(b, [&] {
      coord.rendezvous(HookRole::Compute, bwd("combine", 1, 2));
      coord.depart(bwd("end", -1, 2));
    });
  }
  coord.disable();
  trace_stop();
  REQUIRE_FALSE(f.threw);
  REQUIRE_FALSE(b.threw);
  nlohmann::json doc = nlohmann::json::parse(trace_json());
  std::vector<nlohmann::json> events;
  for (const nlohmann::json& e : doc["traceEvents"]) {
    if (e.value("cat", "") == "coordinator") events.push_back(e);
  }
  auto find = [&](const std::string& name, const std::string& hook) {
    for (const nlohmann::json& e : events) {
      if (e["name"] == name && e["args"].value("hook", "") == hook) return e;
    }
    return nlohmann::json();
  };
  nlohmann::json r = find("rendezvous", "dispatch");
  REQUIRE_FALSE(r.is_null());
  CHECK(r["ph"] == "i");
  CHECK(r["args"]["role"] == "Comm");
  CHECK(r["args"]["layer"] == 0);
  CHECK(r["args"]["backward"] == false);
  CHECK(r["args"]["micro_batch"] == 3);
  CHECK(r["args"]["round"] == 1);
  CHECK(find("rendezvous", "combine")["args"]["role"] == "Compute");
  CHECK(find("notify_dispatched", "experts")["args"]["role"] == "Comm");
  CHECK_FALSE(find("gate", "dispatch").is_null());
  CHECK(find("depart", "end")["args"]["backward"] == true);
}

TEST_CASE("coordinator: drives a WorkerPair; a failure on one side ends without a hang",
          "[coordinator]") {
  HookCoordinator coord(with_timeout(30s));
  WorkerPair pair;
  auto on_failure = [&] { coord.disable(); };

  SECTION("micro-batches in tandem") {
    for (int mb = 0; mb < 3; ++mb) {
      CAPTURE(mb);
      CommLog log;
      HookDriver fd(coord, /*backward=*/false, mb + 1, 10 + mb);
      HookDriver bd(coord, /*backward=*/true, mb, 20 + mb);
      coord.enable();
      REQUIRE_NOTHROW(
          pair.run([&] { forward_step(fd, log); }, [&] { backward_step(bd, log); }, on_failure));
      CHECK(coord.rounds() == kRounds);
      coord.disable();
      CHECK(log.take() == kExpectedComms);
      CHECK(check_rounds(fd.rounds, bd.rounds) == "");
    }
  }

  SECTION("the forward throws while the backward waits at the barrier") {
    coord.enable();
    std::atomic<int> backward_calls{0};
    Clock::time_point start = Clock::now();
    REQUIRE_THROWS_WITH(
        pair.run(
            [&] {
              coord.rendezvous(HookRole::Comm, fwd("A", 0, 1));
              coord.notify_dispatched(HookRole::Comm, fwd("B", 0, 1));
              wait_for_state(coord, "waiting at the barrier");
              throw Error("[test] forward failed");
            },
            [&] {
              coord.rendezvous(HookRole::Compute, bwd("C", 0, 0));
              coord.notify_dispatched(HookRole::Compute, bwd("B", 0, 0));
              coord.rendezvous(HookRole::Comm, bwd("B", 0, 0));  // released by on_failure
              coord.notify_dispatched(HookRole::Comm, bwd("A", 0, 0));
              coord.rendezvous(HookRole::Compute, bwd("A", 0, 0));  // no-op: disabled
              backward_calls = 5;
            },
            on_failure),
        Contains("forward failed"));
    CHECK(Clock::now() - start < 10s);
    CHECK(backward_calls == 5);
    CHECK_FALSE(coord.enabled());
  }
}
