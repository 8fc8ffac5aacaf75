// HookCoordinator: orders the ops of the forward and backward worker threads of
// the dual-pipe schedule so that each collective of one thread is enqueued
// before the compute it overlaps on the other, in the same order on every rank
// (DESIGN §8). The sync hooks of parallel/ call it; it knows nothing of
// tensors or autograd.
//
// Note [Hook coordinator]
// -----------------------
// Two threads, the forward thread and the backward thread, fire hooks between
// their ops. At each hook a thread calls notify_dispatched(prev) for the op it
// just enqueued, then rendezvous(next) for the op it will enqueue next, where
// each role is Comm (a collective) or Compute.
//
//  * rendezvous(next) is a barrier of two. A Comm side first creates a fresh
//    "dispatched" latch for this barrier round; after the barrier a Compute side
//    waits until the partner's latch of the same round is set. The two roles
//    at one barrier must be one Comm and one Compute.
//  * notify_dispatched(Comm) sets the latch the thread created at its last
//    rendezvous; notify_dispatched(Compute) only checks the role.
//
// Hence in every round the Compute side starts only after the Comm side has
// enqueued its collective, and a thread's next collective comes after the
// next barrier: the collectives of the two threads alternate in an order fixed
// by the hook sequence, the same on every rank.
//
// Windows. The coordinator starts disabled; enable() opens an overlap window
// (fresh barrier, fresh participants, rounds from 0) and disable() closes it:
// every blocked call is released and every later call returns at once, until
// the next enable(). disable() is idempotent and may be called from any
// thread (WorkerPair's on_failure does). enable() on an open window starts a
// fresh one and releases the old one's waiters.
//
// Participants. A window's two threads are identified on their first call in
// it, by the direction of the hook they pass: HookInfo::backward == false
// makes the calling thread the forward thread, true the backward thread. A
// third thread, a second thread of the same direction, or one thread passing
// hooks of both directions gets an Error (the window stays open).
//
// Depart. When the two sides fire different numbers of hooks, the side that is
// done calls depart(): its pending latch is set, and for the rest of the
// window the other side's rendezvous return at once (it runs solo, releasing
// it if it was waiting at the barrier). A departed thread must not call
// rendezvous or notify_dispatched again in that window (Error); a repeated
// depart() is a no-op.
//
// Recompute. While thread_is_recomputing() (Note [Recompute flag]) is true on
// the calling thread, rendezvous and notify_dispatched are no-ops: a
// checkpoint re-run does not fire its hooks twice.
//
// Forward gate (options.recompute_gate, for schedules with recompute). The
// forward thread's first rendezvous of a window waits until the backward
// thread has entered its first real (non-recompute) rendezvous, departed, or
// the window closed. The backward thread of a recompute schedule starts with a
// re-run whose hooks are no-ops; the gate makes the pairing explicit and gives
// the wait its own trace event and timeout message.
//
// Checks (the coordinator turns protocol slips into errors, not hangs):
//  * two Comm or two Compute at one barrier: both threads get an Error naming
//    both hooks;
//  * notify_dispatched(prev) whose role differs from the one declared at the
//    thread's last rendezvous, or a rendezvous while the thread's own Comm
//    latch is still unset (it forgot to notify): Error on that thread.
// Each check closes the window.
//
// Bounded waits (Note [Bounded waits]). Each wait (barrier, latch, gate) ends
// after options.timeout. The waiting thread then throws TimeoutError naming
// what it waited for and both threads' last hooks (name, layer, direction,
// micro-batch), and the window is closed as by disable(), so nothing else
// blocks on it.
//
// Faults and the partner. After a timeout or a check closed the window, the
// *other* participant's next coordinator call in that window (or the wait it
// is blocked in) throws an Error, once: "the overlap window was closed by the
// partner's <timeout|role error>: <message>". Failing rather than returning
// keeps it from enqueueing ops out of the agreed order; later calls are
// no-ops like after disable(). A plain disable() makes no error: its waiters
// return. (A fault's error survives a disable() that follows it, e.g. from
// WorkerPair's on_failure; enable() clears it.)
//
// Trace. Each rendezvous, notify_dispatched, gate passage and depart is a
// trace_instant event of category "coordinator" with the hook as args (name,
// layer, direction, micro-batch, role, window, round, wait_us; calls skipped
// for recompute or solo say so in "skipped"); enable, disable, timeout and
// role_error are events too. Calls made while no window is open are not traced.
//
// Thread safety: every method may be called from any thread. The coordinator
// must outlive the calls made on it (WorkerPair::run returns only after both
// sides have stopped).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "tandem/runtime/config.h"

namespace tandem {

enum class HookRole { Comm, Compute };

const char* to_string(HookRole role);

// Where a hook fired; carried into trace events and error messages.
struct HookInfo {
  std::string name;       // e.g. "dispatch", "combine"
  int layer = -1;         // -1: not tied to a layer
  bool backward = false;  // the direction, which also names the calling side
  int micro_batch = -1;   // -1: unknown
};

// `"combine" (layer 3, backward, micro-batch 2)`.
std::string to_string(const HookInfo& hook);

struct HookCoordinatorOptions {
  // Bound of every wait (Note [Bounded waits]).
  std::chrono::milliseconds timeout = wait_timeout();
  // Hold the forward thread's first rendezvous until the backward thread's
  // first real rendezvous (Note [Hook coordinator], "Forward gate").
  bool recompute_gate = false;
};

class HookCoordinator {
 public:
  explicit HookCoordinator(HookCoordinatorOptions options = {});
  HookCoordinator(const HookCoordinator&) = delete;
  HookCoordinator& operator=(const HookCoordinator&) = delete;

  // Opens a fresh overlap window.
  void enable();
  // Closes the window and releases every waiter; idempotent, any thread.
  void disable();
  bool enabled() const;

  // The calling thread will enqueue an op of role `next` (Note [Hook coordinator]).
  void rendezvous(HookRole next, const HookInfo& hook);
  // The calling thread has enqueued the op of role `prev` announced at its last rendezvous.
  void notify_dispatched(HookRole prev, const HookInfo& hook);
  // The calling thread fires no more hooks in this window; the partner runs solo.
  void depart(const HookInfo& hook);

  // Barrier rounds completed in the current (or last) window.
  int64_t rounds() const;
  // Both threads' last calls and what each is doing, as in timeout messages.
  std::string describe() const;
  const HookCoordinatorOptions& options() const { return options_; }

 private:
  enum Side { kForward = 0, kBackward = 1 };
  // What a participant is doing, shown by describe() and in timeout messages.
  enum class State { Running, Departed, AtGate, AtBarrier, ForLatch, Released };

  struct Participant {
    std::optional<std::thread::id> thread;
    bool departed = false;
    bool gate_passed = false;  // forward: its first rendezvous went through the gate
    bool fault_delivered = false;
    std::optional<HookInfo> last_hook;
    std::string last_call;  // e.g. "rendezvous(Comm)"
    State state = State::Running;
    std::optional<HookRole> declared;  // role of the last met rendezvous, until notified
    int64_t comm_round = 0;            // round of the latest Comm latch created
    int64_t dispatched_round = 0;      // latest round whose latch is set
  };

  struct Fault {
    std::string message;
    const char* kind;  // "timeout" or "role error"
    int origin;        // the side that detected it
  };

  // Outcome of a wait: the condition held, or the window closed under it.
  enum class WaitResult { Ready, Closed };

  int identify_locked(const HookInfo& hook, const char* call);
  void record_call_locked(int side, const char* call, const HookInfo& hook);
  // The steps of rendezvous(), in the order it takes them (Note [Hook coordinator]).
  void check_dispatched_locked(int side, const char* call, const HookInfo& hook);
  WaitResult pass_gate_locked(std::unique_lock<std::mutex>& lock, int side, const char* call,
                              const HookInfo& hook, int64_t window);
  WaitResult wait_at_barrier_locked(std::unique_lock<std::mutex>& lock, int side, HookRole next,
                                    const char* call, int64_t window, int64_t round);
  int64_t complete_round_locked(int side, HookRole next, const HookInfo& hook, int64_t window);
  // Releases the lock: the partner departed, so this side goes on alone.
  void run_solo_locked(std::unique_lock<std::mutex>& lock, int side, HookRole next,
                       const HookInfo& hook, int64_t window);
  // Throws the fault's error once to a participant that did not cause it.
  void deliver_fault_locked();
  [[noreturn]] void raise_fault_locked(int side, std::string message, const char* kind,
                                       bool timeout);
  template <class Ready>
  WaitResult wait_locked(std::unique_lock<std::mutex>& lock, int side, State state,
                         const char* call, int64_t window, Ready ready);
  // Closes the window (disable(), faults, enable()) and wakes every waiter.
  void close_locked();
  std::string describe_locked() const;
  static const char* side_name(int side) { return side == kForward ? "forward" : "backward"; }
  static const char* state_text(State state);

  const HookCoordinatorOptions options_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool enabled_ = false;
  int64_t window_ = 0;            // bumped by enable() and disable()
  int64_t rounds_ = 0;            // completed barrier rounds in the window
  bool barrier_waiting_ = false;  // one side has arrived at the current round
  int barrier_side_ = 0;
  HookRole barrier_role_ = HookRole::Comm;
  bool gate_open_ = false;
  Participant sides_[2];
  std::optional<Fault> fault_;
};

}  // namespace tandem
