// The NCCL backend's engine: the one thread of the process that calls NCCL
// (internal to comm/nccl/).
//
// Note [NCCL engine]
// ~~~~~~~~~~~~~~~~~~
// NCCL forbids concurrent enqueues from two threads on one device (Note
// [Issue lock]), and a nonblocking communicator must settle before its next
// call (Note [Bounded NCCL calls]). So one engine thread per process makes
// every NCCL call. launch() only queues, in launch order: it records an event
// on the caller's stream and, in checked mode, submits the fingerprint
// exchange to the group's MPI control group at once (so the control plane
// sees the launch order too). The engine runs each group's lane in order:
// once the head's exchange has succeeded, the comm stream waits on the
// caller's event, the NCCL calls are enqueued and the end event is recorded
// on the comm stream. A completion pass polls the launches in flight (end
// event, ncclCommGetAsyncError) and finishes their Works; past the group's
// timeout it aborts the communicator (ncclCommAbort, on this same thread, so
// no enqueue races the abort) with a watchdog report, and every queued and
// later launch of that group fails at once. Setup steps (a split, freeing a
// communicator) run on the engine in the lane's order too.
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <variant>
#include <vector>

#include "tandem/comm/process_group.h"

namespace tandem::nccl {

class NcclGroup;

struct Launch {
  std::shared_ptr<NcclGroup> group;  // kept alive until the launch finishes
  Collective c;
  WorkPtr check;  // the checked-mode exchange on the control group, or null
  Event caller;   // recorded on the caller's stream of the group's device
  Event end;      // recorded on the comm stream after the NCCL calls
  std::chrono::steady_clock::time_point deadline;
};

// A setup step: runs on the engine thread when it reaches the head of its
// lane; may block, but only on settle() deadlines (Note [Bounded NCCL calls]).
using Step = std::function<void()>;

// A group's FIFO of launches and steps. Engine thread only, but for its
// creation.
class Lane {
 private:
  friend class Engine;
  std::deque<std::variant<Launch, Step>> queue_;
  bool active_ = false;
};

class Engine {
 public:
  Engine();
  ~Engine();  // stop(); never throws
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Any thread. After stop() a launch fails at once and a step is dropped.
  void submit(const std::shared_ptr<Lane>& lane, Launch launch);
  void submit(const std::shared_ptr<Lane>& lane, Step step);
  // Runs `step` on the engine after the lane's earlier items and waits for it
  // (bounded by wait_timeout()), rethrowing its error. Not from the engine.
  void run(const std::shared_ptr<Lane>& lane, Step step, const std::string& what);
  // Lets queued items finish (each is bounded), then joins the thread.
  void stop() noexcept;

 private:
  struct Item {
    std::shared_ptr<Lane> lane;
    std::variant<Launch, Step> work;
  };
  void loop();
  bool progress_lanes();
  bool progress_in_flight();
  // Starts the head of a lane; false when it has to wait (checked exchange).
  bool start(Launch& launch);

  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Item> inbox_;
  bool stopping_ = false;
  bool stopped_ = false;

  // Engine thread only.
  std::vector<std::shared_ptr<Lane>> active_;
  std::vector<Launch> in_flight_;

  std::thread thread_;
};

// The process's engine (created on first use, shared by every NCCL group).
std::shared_ptr<Engine> engine();

}  // namespace tandem::nccl
