// HookCoordinator (Note [Hook coordinator] in the header). All state sits
// behind one mutex and one condition variable: the two threads meet a few
// times per layer, so a simple, obviously correct lock beats anything clever.
#include "tandem/runtime/hook_coordinator.h"

#include <fmt/format.h>

#include <string_view>

#include "tandem/runtime/error.h"
#include "tandem/runtime/logging.h"
#include "tandem/runtime/recompute_flag.h"
#include "tandem/runtime/trace.h"

namespace tandem {
namespace {

using Clock = std::chrono::steady_clock;

constexpr const char* kCategory = "coordinator";

std::string json_escape(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      out += fmt::format("\\u{:04x}", static_cast<int>(c));
    } else {
      out += c;
    }
  }
  return out;
}

std::string hook_args(const HookInfo& hook) {
  return fmt::format(R"("hook":"{}","layer":{},"backward":{},"micro_batch":{})",
                     json_escape(hook.name), hook.layer, hook.backward, hook.micro_batch);
}

// A call made during a checkpoint re-run is a no-op (Note [Hook coordinator], "Recompute").
void trace_recompute_skip(const char* event, HookRole role, const HookInfo& hook) {
  if (trace_enabled()) {
    trace_instant(
        kCategory, event,
        fmt::format(R"({},"role":"{}","skipped":"recompute")", hook_args(hook), to_string(role)));
  }
}

const char* rendezvous_call(HookRole role) {
  return role == HookRole::Comm ? "rendezvous(Comm)" : "rendezvous(Compute)";
}

const char* notify_call(HookRole role) {
  return role == HookRole::Comm ? "notify_dispatched(Comm)" : "notify_dispatched(Compute)";
}

int64_t micros_since(Clock::time_point start) {
  return std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - start).count();
}

}  // namespace

const char* to_string(HookRole role) {
  return role == HookRole::Comm ? "Comm" : "Compute";
}

std::string to_string(const HookInfo& hook) {
  std::string out = fmt::format("\"{}\" (", hook.name);
  if (hook.layer >= 0) out += fmt::format("layer {}, ", hook.layer);
  out += hook.backward ? "backward" : "forward";
  if (hook.micro_batch >= 0) out += fmt::format(", micro-batch {}", hook.micro_batch);
  return out + ")";
}

const char* HookCoordinator::state_text(State state) {
  switch (state) {
    case State::Running:
      return "running";
    case State::Departed:
      return "departed";
    case State::AtGate:
      return "waiting at the forward gate";
    case State::AtBarrier:
      return "waiting at the barrier";
    case State::ForLatch:
      return "waiting for the partner's collective to be dispatched";
    case State::Released:
      return "released (window closed)";
  }
  return "?";
}

HookCoordinator::HookCoordinator(HookCoordinatorOptions options) : options_(options) {
  TANDEM_CHECK(options_.timeout.count() > 0,
               "[runtime::hook_coordinator] expected a positive timeout, got {} ms",
               options_.timeout.count());
}

void HookCoordinator::enable() {
  int64_t window;
  {
    std::lock_guard<std::mutex> lock(mu_);
    close_locked();
    enabled_ = true;
    window = window_;
    rounds_ = 0;
    gate_open_ = false;
    sides_[kForward] = Participant{};
    sides_[kBackward] = Participant{};
    fault_.reset();
  }
  if (trace_enabled()) trace_instant(kCategory, "enable", fmt::format("\"window\":{}", window));
}

void HookCoordinator::disable() {
  int64_t window;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!enabled_) return;
    window = window_;
    close_locked();
  }
  if (trace_enabled()) trace_instant(kCategory, "disable", fmt::format("\"window\":{}", window));
}

bool HookCoordinator::enabled() const {
  std::lock_guard<std::mutex> lock(mu_);
  return enabled_;
}

int64_t HookCoordinator::rounds() const {
  std::lock_guard<std::mutex> lock(mu_);
  return rounds_;
}

std::string HookCoordinator::describe() const {
  std::lock_guard<std::mutex> lock(mu_);
  return describe_locked();
}

void HookCoordinator::close_locked() {
  enabled_ = false;
  ++window_;
  barrier_waiting_ = false;
  for (Participant& p : sides_) {
    if (p.state != State::Running && p.state != State::Departed) p.state = State::Released;
  }
  cv_.notify_all();
}

template <class Ready>
HookCoordinator::WaitResult HookCoordinator::wait_locked(std::unique_lock<std::mutex>& lock,
                                                         int side, State state, const char* call,
                                                         int64_t window, Ready ready) {
  Participant& me = sides_[side];
  me.state = state;
  const Clock::time_point deadline = Clock::now() + options_.timeout;
  while (true) {
    if (window_ != window) {
      // Released by disable(), a fault or a newer enable(). `me` may belong
      // to a newer window by now, so it is left alone.
      deliver_fault_locked();
      return WaitResult::Closed;
    }
    if (ready()) {
      me.state = State::Running;
      return WaitResult::Ready;
    }
    if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && window_ == window &&
        !ready()) {
      const int partner = 1 - side;
      std::string awaited;
      if (state == State::AtGate) {
        awaited = "the backward thread's first real rendezvous (forward gate)";
      } else if (state == State::AtBarrier) {
        awaited = fmt::format("the {} thread at the barrier of round {}", side_name(partner),
                              rounds_ + 1);
      } else {
        awaited = fmt::format("notify_dispatched(Comm) from the {} thread for round {}",
                              side_name(partner), rounds_);
      }
      raise_fault_locked(
          side,
          fmt::format("[runtime::hook_coordinator] expected {} within {} ms, got a timeout: the "
                      "{} thread waited in {} at {} (window {}). Last calls: {}. The window is "
                      "closed.",
                      awaited, options_.timeout.count(), side_name(side), call,
                      to_string(*me.last_hook), window, describe_locked()),
          "timeout", /*timeout=*/true);
    }
  }
}

void HookCoordinator::rendezvous(HookRole next, const HookInfo& hook) {
  const char* call = rendezvous_call(next);
  if (thread_is_recomputing()) {
    trace_recompute_skip("rendezvous", next, hook);
    return;
  }
  Clock::time_point start = Clock::now();
  std::unique_lock<std::mutex> lock(mu_);
  if (!enabled_) {
    deliver_fault_locked();
    return;
  }
  int side = identify_locked(hook, call);
  Participant& me = sides_[side];
  Participant& partner = sides_[1 - side];
  record_call_locked(side, call, hook);
  const int64_t window = window_;

  check_dispatched_locked(side, call, hook);
  if (side == kBackward && !gate_open_) {
    gate_open_ = true;
    cv_.notify_all();
  }

  if (partner.departed) return run_solo_locked(lock, side, next, hook, window);

  if (side == kForward && options_.recompute_gate && !me.gate_passed) {
    if (pass_gate_locked(lock, side, call, hook, window) == WaitResult::Closed) return;
    if (partner.departed) return run_solo_locked(lock, side, next, hook, window);
  }

  // A Comm side creates its fresh latch before the barrier: the round it is
  // about to join is rounds_ + 1, since no round completes without it.
  if (next == HookRole::Comm) me.comm_round = rounds_ + 1;
  int64_t round;
  if (!barrier_waiting_) {
    round = rounds_ + 1;
    if (wait_at_barrier_locked(lock, side, next, call, window, round) == WaitResult::Closed) {
      return;
    }
    if (rounds_ < round) {  // the partner departed while this side waited
      barrier_waiting_ = false;
      return run_solo_locked(lock, side, next, hook, window);
    }
  } else {
    round = complete_round_locked(side, next, hook, window);
  }
  me.declared = next;

  if (next == HookRole::Compute) {
    if (wait_locked(lock, side, State::ForLatch, call, window, [&] {
          return partner.dispatched_round >= round || partner.departed;
        }) == WaitResult::Closed) {
      return;
    }
  }
  lock.unlock();
  if (trace_enabled()) {
    trace_instant(
        kCategory, "rendezvous",
        fmt::format(R"({},"role":"{}","window":{},"round":{},"wait_us":{})", hook_args(hook),
                    to_string(next), window, round, micros_since(start)));
  }
}

// A Comm side must have notified its last collective before it meets the
// partner again (Note [Hook coordinator], "Checks").
void HookCoordinator::check_dispatched_locked(int side, const char* call, const HookInfo& hook) {
  const Participant& me = sides_[side];
  if (me.declared == HookRole::Comm && me.dispatched_round < me.comm_round) {
    raise_fault_locked(
        side,
        fmt::format("[runtime::hook_coordinator::rendezvous] expected "
                    "notify_dispatched(Comm) for the collective the {} thread "
                    "announced at round {} before its next rendezvous, got {} at "
                    "{}. Last calls: {}. The window is closed.",
                    side_name(side), me.comm_round, call, to_string(hook), describe_locked()),
        "role error", /*timeout=*/false);
  }
}

// Note [Hook coordinator], "Forward gate".
HookCoordinator::WaitResult HookCoordinator::pass_gate_locked(std::unique_lock<std::mutex>& lock,
                                                              int side, const char* call,
                                                              const HookInfo& hook,
                                                              int64_t window) {
  Participant& me = sides_[side];
  const Participant& partner = sides_[1 - side];
  Clock::time_point gate_start = Clock::now();
  if (wait_locked(lock, side, State::AtGate, call, window,
                  [&] { return gate_open_ || partner.departed; }) == WaitResult::Closed) {
    return WaitResult::Closed;
  }
  me.gate_passed = true;
  if (trace_enabled()) {
    trace_instant(kCategory, "gate",
                  fmt::format(R"({},"window":{},"wait_us":{})", hook_args(hook), window,
                              micros_since(gate_start)));
  }
  return WaitResult::Ready;
}

// The first side at a round waits there until the second completes it (or
// departs, or the window closes).
HookCoordinator::WaitResult HookCoordinator::wait_at_barrier_locked(
    std::unique_lock<std::mutex>& lock, int side, HookRole next, const char* call, int64_t window,
    int64_t round) {
  const Participant& partner = sides_[1 - side];
  barrier_waiting_ = true;
  barrier_side_ = side;
  barrier_role_ = next;
  return wait_locked(lock, side, State::AtBarrier, call, window,
                     [&] { return rounds_ >= round || partner.departed; });
}

// The second side at a round checks the roles and completes it.
int64_t HookCoordinator::complete_round_locked(int side, HookRole next, const HookInfo& hook,
                                               int64_t window) {
  const Participant& partner = sides_[1 - side];
  TANDEM_INTERNAL_ASSERT(barrier_side_ != side, "one side arrived twice at round {}", rounds_ + 1);
  if (barrier_role_ == next) {
    const HookInfo& other = *partner.last_hook;
    raise_fault_locked(
        side,
        fmt::format("[runtime::hook_coordinator::rendezvous] expected one Comm and one Compute "
                    "at a rendezvous, got {} from both: forward at {}, backward at {} (window "
                    "{}, round {}). The window is closed.",
                    to_string(next), to_string(side == kForward ? hook : other),
                    to_string(side == kForward ? other : hook), window, rounds_ + 1),
        "role error", /*timeout=*/false);
  }
  barrier_waiting_ = false;
  const int64_t round = ++rounds_;
  cv_.notify_all();
  return round;
}

void HookCoordinator::run_solo_locked(std::unique_lock<std::mutex>& lock, int side, HookRole next,
                                      const HookInfo& hook, int64_t window) {
  Participant& me = sides_[side];
  me.declared.reset();
  me.dispatched_round = me.comm_round;  // nobody waits on this thread's latch
  me.state = State::Running;
  lock.unlock();
  if (trace_enabled()) {
    trace_instant(kCategory, "rendezvous",
                  fmt::format(R"({},"role":"{}","window":{},"skipped":"solo")", hook_args(hook),
                              to_string(next), window));
  }
}

void HookCoordinator::notify_dispatched(HookRole prev, const HookInfo& hook) {
  const char* call = notify_call(prev);
  if (thread_is_recomputing()) {
    trace_recompute_skip("notify_dispatched", prev, hook);
    return;
  }
  std::unique_lock<std::mutex> lock(mu_);
  if (!enabled_) {
    deliver_fault_locked();
    return;
  }
  int side = identify_locked(hook, call);
  Participant& me = sides_[side];
  record_call_locked(side, call, hook);
  if (me.declared && *me.declared != prev) {
    raise_fault_locked(side,
                       fmt::format("[runtime::hook_coordinator::notify_dispatched] expected "
                                   "notify_dispatched({}) for the op the {} thread announced at "
                                   "its last rendezvous, got {} at {}. Last calls: {}. The window "
                                   "is closed.",
                                   to_string(*me.declared), side_name(side), call, to_string(hook),
                                   describe_locked()),
                       "role error", /*timeout=*/false);
  }
  me.declared.reset();
  const int64_t window = window_;
  const int64_t round = me.comm_round;
  if (prev == HookRole::Comm && me.dispatched_round < me.comm_round) {
    me.dispatched_round = me.comm_round;
    cv_.notify_all();
  }
  lock.unlock();
  if (trace_enabled()) {
    trace_instant(kCategory, "notify_dispatched",
                  fmt::format(R"({},"role":"{}","window":{},"round":{})", hook_args(hook),
                              to_string(prev), window, round));
  }
}

void HookCoordinator::depart(const HookInfo& hook) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!enabled_) {
    deliver_fault_locked();
    return;
  }
  int side = identify_locked(hook, "depart");
  Participant& me = sides_[side];
  if (me.departed) return;
  record_call_locked(side, "depart", hook);
  me.departed = true;
  me.state = State::Departed;
  me.declared.reset();
  me.dispatched_round = me.comm_round;  // its last collective was enqueued before depart
  if (side == kBackward) gate_open_ = true;
  const int64_t window = window_;
  const int64_t round = rounds_;
  cv_.notify_all();
  lock.unlock();
  if (trace_enabled()) {
    trace_instant(kCategory, "depart",
                  fmt::format(R"({},"window":{},"round":{})", hook_args(hook), window, round));
  }
}

int HookCoordinator::identify_locked(const HookInfo& hook, const char* call) {
  const std::thread::id self = std::this_thread::get_id();
  const int side = hook.backward ? kBackward : kForward;
  TANDEM_CHECK(sides_[1 - side].thread != self,
               "[runtime::hook_coordinator::{}] expected {} hooks from the {} thread, got {}", call,
               side_name(1 - side), side_name(1 - side), to_string(hook));
  Participant& p = sides_[side];
  if (!p.thread) {
    p.thread = self;
  } else {
    TANDEM_CHECK(*p.thread == self,
                 "[runtime::hook_coordinator::{}] expected one {} thread per window, got a second "
                 "one at {}",
                 call, side_name(side), to_string(hook));
  }
  TANDEM_CHECK(!p.departed || std::string_view(call) == "depart",
               "[runtime::hook_coordinator::{}] expected no calls from the {} thread after its "
               "depart(), got {} at {}",
               call, side_name(side), call, to_string(hook));
  return side;
}

void HookCoordinator::record_call_locked(int side, const char* call, const HookInfo& hook) {
  Participant& p = sides_[side];
  p.last_call = call;
  p.last_hook = hook;
}

void HookCoordinator::deliver_fault_locked() {
  if (!fault_) return;
  const std::thread::id self = std::this_thread::get_id();
  for (int side : {kForward, kBackward}) {
    Participant& p = sides_[side];
    if (p.thread != self) continue;
    if (side == fault_->origin || p.fault_delivered) return;
    p.fault_delivered = true;
    throw Error(
        fmt::format("[runtime::hook_coordinator] the overlap window was closed by the "
                    "partner's {}: {}",
                    fault_->kind, fault_->message));
  }
}

void HookCoordinator::raise_fault_locked(int side, std::string message, const char* kind,
                                         bool timeout) {
  fault_ = Fault{message, kind, side};
  sides_[side].fault_delivered = true;
  const int64_t window = window_;
  close_locked();
  log_debug("{}", message);
  if (trace_enabled()) {
    trace_instant(kCategory, timeout ? "timeout" : "role_error",
                  fmt::format(R"("window":{},"message":"{}")", window, json_escape(message)));
  }
  if (timeout) throw TimeoutError(message);
  throw Error(message);
}

std::string HookCoordinator::describe_locked() const {
  std::string out;
  for (int side : {kForward, kBackward}) {
    const Participant& p = sides_[side];
    if (!out.empty()) out += "; ";
    if (!p.last_hook) {
      out += fmt::format("{}: no call in this window", side_name(side));
    } else {
      out += fmt::format("{}: {} at {}, {}", side_name(side), p.last_call, to_string(*p.last_hook),
                         state_text(p.state));
    }
  }
  return out;
}

}  // namespace tandem
