// The NCCL engine thread (Note [NCCL engine]) and settle() (Note [Bounded NCCL calls]).
#include "tandem/comm/nccl/nccl_engine.h"

#include <algorithm>
#include <future>

#include "tandem/comm/nccl/nccl_check.h"
#include "tandem/comm/nccl/nccl_group.h"
#include "tandem/runtime/config.h"
#include "tandem/runtime/error.h"
#include "tandem/runtime/logging.h"

namespace tandem::nccl {
namespace {

using Clock = std::chrono::steady_clock;

// When a pass moved nothing the engine sleeps, doubling the pause up to
// kMaxIdle (the same policy as the MPI executor).
constexpr std::chrono::microseconds kMinIdle{20};
constexpr std::chrono::microseconds kMaxIdle{1000};
constexpr std::chrono::seconds kSetupMargin{5};

}  // namespace

void settle(ncclComm_t comm, ncclResult_t rc, const char* call, Clock::time_point deadline) {
  auto pause = kMinIdle;
  while (rc == ncclInProgress) {
    if (Clock::now() > deadline) {
      throw TimeoutError(fmt::format(
          "[nccl] {} did not complete by its deadline (a peer has not joined; the communicator "
          "is still in progress)",
          call));
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, kMaxIdle);
    ncclResult_t polled = ncclCommGetAsyncError(comm, &rc);
    if (polled != ncclSuccess) rc = polled;
  }
  TANDEM_CHECK(rc == ncclSuccess, "[nccl] {} failed: {} ({}): {}", call, ncclGetErrorString(rc),
               static_cast<int>(rc), ncclGetLastError(comm));
}

Engine::Engine() : thread_([this] { loop(); }) {}

Engine::~Engine() {
  stop();
}

void Engine::submit(const std::shared_ptr<Lane>& lane, Launch launch) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stopping_) {
      inbox_.push_back(Item{lane, std::move(launch)});
      cv_.notify_one();
      return;
    }
  }
  launch.c.work->finish(std::make_exception_ptr(CommAbortedError(fmt::format(
      "[comm::nccl] #{} {} failed at once: expected a running NCCL engine, got one stopped",
      launch.c.entry.seq, collective_name(launch.c.kind)))));
}

void Engine::submit(const std::shared_ptr<Lane>& lane, Step step) {
  std::lock_guard<std::mutex> lock(mu_);
  if (stopping_) return;  // process exit: the driver reclaims what the step would free
  inbox_.push_back(Item{lane, std::move(step)});
  cv_.notify_one();
}

void Engine::run(const std::shared_ptr<Lane>& lane, Step step, const std::string& what) {
  auto done = std::make_shared<std::promise<void>>();
  std::future<void> result = done->get_future();
  submit(lane, Step([step = std::move(step), done] {
           try {
             step();
             done->set_value();
           } catch (...) {
             done->set_exception(std::current_exception());
           }
         }));
  auto bound = wait_timeout() + kSetupMargin;
  if (result.wait_for(bound) != std::future_status::ready) {
    throw TimeoutError(fmt::format(
        "[comm::nccl] expected {} to complete within {} ms, got no result (the NCCL engine is "
        "behind earlier launches of this group)",
        what, std::chrono::duration_cast<std::chrono::milliseconds>(bound).count()));
  }
  try {
    result.get();
  } catch (const std::future_error&) {
    TANDEM_FAIL("[comm::nccl] expected {} to run, got a stopped NCCL engine", what);
  }
}

void Engine::stop() noexcept {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopped_) return;
    stopping_ = true;
    cv_.notify_all();
  }
  if (thread_.joinable() && std::this_thread::get_id() != thread_.get_id()) thread_.join();
  std::lock_guard<std::mutex> lock(mu_);
  stopped_ = true;
}

void Engine::loop() {
  set_thread_name("comm nccl");
  std::vector<Item> items;
  auto idle = kMinIdle;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (inbox_.empty() && active_.empty() && in_flight_.empty()) {
        if (stopping_) break;
        cv_.wait(lock, [&] { return stopping_ || !inbox_.empty(); });
      }
      items.swap(inbox_);
    }
    for (Item& item : items) {
      if (!item.lane) {  // a step outside any lane runs now
        try {
          std::get<Step>(item.work)();
        } catch (const std::exception& e) {
          log_warn("[comm::nccl] a setup step failed: {}", e.what());
        }
        continue;
      }
      Lane& lane = *item.lane;
      lane.queue_.push_back(std::move(item.work));
      if (!lane.active_) {
        lane.active_ = true;
        active_.push_back(item.lane);
      }
    }
    items.clear();
    bool moved = progress_lanes();
    moved = progress_in_flight() || moved;
    if (moved) {
      idle = kMinIdle;
    } else if (!active_.empty() || !in_flight_.empty()) {
      std::this_thread::sleep_for(idle);
      idle = std::min(idle * 2, kMaxIdle);
    }
  }
}

bool Engine::start(Launch& launch) {
  NcclGroup& group = *launch.group;
  try {
    if (std::optional<std::string> reason = group.unusable_reason()) {
      throw CommAbortedError(fmt::format(
          "[comm::nccl] {} #{} {} failed at once: expected a usable communicator, got one "
          "aborted earlier: {}",
          group.where(), launch.c.entry.seq, collective_name(launch.c.kind), *reason));
    }
    // The exchange is bounded by the control group's own timeout.
    if (launch.check) {
      if (!launch.check->is_completed()) return false;
      if (std::exception_ptr error = launch.check->error()) std::rethrow_exception(error);
    }
    group.enqueue(launch);
    in_flight_.push_back(std::move(launch));
  } catch (...) {
    launch.c.work->finish(std::current_exception());
  }
  return true;
}

bool Engine::progress_lanes() {
  bool moved = false;
  for (size_t i = 0; i < active_.size();) {
    Lane& lane = *active_[i];
    while (!lane.queue_.empty()) {
      auto& head = lane.queue_.front();
      if (Step* step = std::get_if<Step>(&head)) {
        try {
          (*step)();
        } catch (const std::exception& e) {
          log_warn("[comm::nccl] a setup step failed: {}", e.what());
        }
      } else if (!start(std::get<Launch>(head))) {
        break;
      }
      moved = true;
      // Popping may drop the last reference to a group, whose destructor
      // only submits a step (mu_ is not held here).
      lane.queue_.pop_front();
    }
    if (lane.queue_.empty()) {
      lane.active_ = false;
      active_[i] = std::move(active_.back());
      active_.pop_back();
    } else {
      ++i;
    }
  }
  return moved;
}

bool Engine::progress_in_flight() {
  bool moved = false;
  for (size_t i = 0; i < in_flight_.size();) {
    Launch& launch = in_flight_[i];
    bool done = false;
    try {
      done = launch.group->poll(launch);
    } catch (...) {
      launch.c.work->finish(std::current_exception());
      done = true;
    }
    if (done) {
      moved = true;
      in_flight_.erase(in_flight_.begin() + static_cast<std::ptrdiff_t>(i));
    } else {
      ++i;
    }
  }
  return moved;
}

std::shared_ptr<Engine> engine() {
  // One per process (Note [NCCL engine]); groups hold it, so it outlives them.
  static std::mutex mu;
  static std::shared_ptr<Engine> instance;
  std::lock_guard<std::mutex> lock(mu);
  if (!instance) instance = std::make_shared<Engine>();
  return instance;
}

}  // namespace tandem::nccl
