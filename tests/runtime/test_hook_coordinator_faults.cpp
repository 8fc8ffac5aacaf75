// HookCoordinator: role errors, participants, windows, tracing and use with a
// WorkerPair (the ordering rules are in test_hook_coordinator.cpp).
#include <catch2/catch.hpp>

#include "tests/runtime/hook_coordinator_util.h"

using namespace tandem;
using namespace tandem::coordinator_test;
using namespace std::chrono_literals;
using Catch::Matchers::Contains;

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
