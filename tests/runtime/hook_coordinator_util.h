// Helpers shared by the hook coordinator tests (test_hook_coordinator*.cpp):
// hook descriptors, side threads whose outcome is checked on the test thread,
// and a driver that fires the DESIGN §8 role tables for a few layers.
#pragma once

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

#include "tandem/runtime/error.h"
#include "tandem/runtime/hook_coordinator.h"
#include "tandem/runtime/recompute_flag.h"
#include "tandem/runtime/trace.h"
#include "tandem/runtime/worker_pair.h"

namespace tandem {

using namespace std::chrono_literals;

namespace coordinator_test {

using Clock = std::chrono::steady_clock;

inline HookInfo fwd(const std::string& name, int layer, int micro_batch) {
  return HookInfo{name, layer, /*backward=*/false, micro_batch};
}
inline HookInfo bwd(const std::string& name, int layer, int micro_batch) {
  return HookInfo{name, layer, /*backward=*/true, micro_batch};
}

inline HookCoordinatorOptions with_timeout(std::chrono::milliseconds timeout, bool gate = false) {
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
inline std::jthread side_thread(Outcome& out, std::function<void()> fn) {
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
inline bool wait_for_state(const HookCoordinator& coord, const std::string& text) {
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
inline void forward_step(HookDriver& d, CommLog& log) {
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
inline void backward_step(HookDriver& d, CommLog& log) {
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
inline const std::vector<std::string> kExpectedComms = {
    "B:combine_bwd2", "F:dispatch0", "B:dispatch_bwd2", "F:combine0",
    "B:combine_bwd1", "F:dispatch1", "B:dispatch_bwd1", "F:combine1",
    "B:combine_bwd0", "F:dispatch2", "B:dispatch_bwd0", "F:combine2",
};
constexpr int kRounds = 4 * kLayers - 1;

// Each round pairs one Comm with one Compute, and the Compute side's op
// started after the Comm side enqueued its collective. Returns "" or the
// first violation.
inline std::string check_rounds(const std::vector<Round>& f, const std::vector<Round>& b) {
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

}  // namespace coordinator_test

}  // namespace tandem
