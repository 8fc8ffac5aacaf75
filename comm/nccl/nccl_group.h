// NcclGroup: the ProcessGroup of the NCCL backend (internal to comm/nccl/).
#pragma once

#include <condition_variable>
#include <mutex>

#include <nccl.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tandem/comm/nccl/nccl_engine.h"
#include "tandem/comm/process_group.h"
#include "tandem/runtime/stream.h"

namespace tandem::nccl {

// Note [NCCL Work]: the Work of an NCCL collective completes on the device.
// wait() makes the caller's current stream of the group's device wait on the
// end event recorded on the comm stream (the host only waits, bounded, for
// the engine thread to have enqueued the calls); synchronize() blocks the
// host until the engine has seen the end event complete.
class NcclWork final : public Work {
 public:
  using Work::Work;
  // Engine thread: the NCCL calls are enqueued and `end` is recorded.
  void mark_enqueued(const Event& end, Device device);
  void wait() override;

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool enqueued_ = false;
  Event end_;
  Device device_;
};

class NcclGroup final : public ProcessGroup {
 public:
  // Takes ownership of `comm` (a nonblocking communicator on `device`);
  // `control` is an MPI group over the same ranks, in the same order.
  NcclGroup(std::shared_ptr<Engine> engine, ncclComm_t comm, ProcessGroupPtr control, Device device,
            int rank, std::vector<int> world_ranks, ProcessGroupOptions options);
  ~NcclGroup() override;

  std::string backend_name() const override { return "nccl"; }
  Device device() const { return device_; }

  // ---- engine thread only (Note [NCCL engine]) ----
  // Makes the comm stream wait on the caller, enqueues the NCCL calls and
  // records launch.end.
  void enqueue(Launch& launch);
  // Polls a launch in flight: true once finished (its Work finished too).
  bool poll(Launch& launch);
  // Fails every later launch with `reason` and aborts the communicator.
  void abort(const std::string& reason) noexcept;
  std::optional<std::string> unusable_reason() const;

 protected:
  WorkPtr make_work(std::string description) override {
    return std::make_shared<NcclWork>(std::move(description));
  }
  void launch(Collective& c) override;
  std::shared_ptr<ProcessGroup> make_subgroup(const std::vector<int>& ranks, int new_rank,
                                              const std::string& name) override;

 private:
  std::shared_ptr<NcclGroup> self();
  void enqueue_collective(Collective& c, void* stream,
                          std::chrono::steady_clock::time_point deadline);
  void enqueue_p2p(Collective& c, void* stream, std::chrono::steady_clock::time_point deadline);
  [[noreturn]] void time_out(const Launch& launch);

  std::shared_ptr<Engine> engine_;
  std::shared_ptr<Lane> lane_;
  ProcessGroupPtr control_;
  Device device_;
  Stream stream_;          // the comm stream
  Tensor barrier_buffer_;  // one i32 on the device (NCCL has no barrier)

  mutable std::mutex mu_;
  std::optional<std::string> unusable_;
  ncclComm_t comm_;  // engine thread only after construction; null once aborted
};

// A nonblocking communicator config (Note [Bounded NCCL calls]).
ncclConfig_t nonblocking_config();

}  // namespace tandem::nccl
