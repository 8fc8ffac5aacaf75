// HookCoordinator (Note [Hook coordinator]): ordering observed with
// timestamps, alternation of the two threads' collectives under the MoE
// sync-hook role tables of DESIGN §8, and the disable / depart / recompute /
// gate / timeout / role-check rules.
//
// Catch2 is not thread-safe: worker threads only record (timestamps, messages,
// logs); every assertion runs on the test thread after the join.
#include <catch2/catch.hpp>

#include "tests/runtime/hook_coordinator_util.h"

using namespace tandem;
using namespace tandem::coordinator_test;
using namespace std::chrono_literals;
using Catch::Matchers::Contains;

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
