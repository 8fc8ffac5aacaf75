// Work: the handle every collective returns (the c10d contract, DESIGN §5).
//
//   wait()          the caller's current stream waits for completion; the host
//                   does not block (on an inline CPU stream "the stream" is the
//                   caller itself, so it does block, bounded).
//   synchronize()   the host blocks until completion (bounded).
//   is_completed()  non-blocking.
//   result()        the output tensor (collectives allocate their outputs);
//                   valid to read once waited.
// An error inside the collective is rethrown by wait()/synchronize(). A Work
// keeps its input and output tensors alive until it has completed. Works are
// always owned by a shared_ptr (WorkPtr).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "tandem/runtime/error.h"
#include "tandem/runtime/stream.h"
#include "tandem/runtime/trace.h"
#include "tandem/tensor/tensor.h"

namespace tandem {

// A collective failed because its group was aborted by another rank's failure
// or timeout (the message names that rank); not a root cause in itself.
class CommAbortedError : public Error {
 public:
  explicit CommAbortedError(const std::string& what) : Error(what) {}
};

class Work : public std::enable_shared_from_this<Work> {
 public:
  explicit Work(std::string description);
  virtual ~Work() = default;
  Work(const Work&) = delete;
  Work& operator=(const Work&) = delete;

  virtual void wait();
  virtual void synchronize();
  virtual bool is_completed();

  Tensor result() const { return outputs_.empty() ? Tensor() : outputs_[0]; }
  const std::vector<Tensor>& results() const { return outputs_; }
  const std::string& description() const { return description_; }

  // ---- for backends ----
  void set_outputs(std::vector<Tensor> outputs) { outputs_ = std::move(outputs); }
  void keep_alive(std::vector<Tensor> tensors) { kept_ = std::move(tensors); }
  // Marks completion (with an error, or null). Runs completion callbacks.
  void finish(std::exception_ptr error = nullptr);
  // Called once on completion (immediately if already complete). Virtual: a
  // backend whose waiters drive the collective (threads) must make sure one
  // runs when only callbacks observe the Work.
  virtual void on_completion(std::function<void()> fn);
  // Asks the backend to move this collective's data while the launching
  // thread goes on computing, with nobody waiting on it yet (Note [Progress
  // without a waiter] in parallel/collectives.cpp). A no-op where
  // collectives progress on their own (MPI's executor, NCCL's kernels); the
  // threads backend hands the copies to the group's comm thread. Waiting is
  // still required: this only moves work earlier.
  virtual void progress_in_background() {}
  // Host wait until finish() without rethrowing; false on timeout.
  bool wait_finished(std::chrono::milliseconds timeout);
  std::exception_ptr error() const;

 protected:
  void rethrow_if_failed();

 private:
  std::string description_;
  std::vector<Tensor> outputs_;
  std::vector<Tensor> kept_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  // Set once, under mu_, after error_: a waiter that sees it (acquire) reads
  // error_ without the lock, so a completed Work costs no lock to wait on.
  std::atomic<bool> completed_{false};
  std::exception_ptr error_;
  std::vector<std::function<void()>> callbacks_;
};

using WorkPtr = std::shared_ptr<Work>;

// Host time (ns) that threads of this process have spent blocked in waits for
// collectives to complete, summed over threads: a cheap "exposed
// communication" meter (tandem-train's progress line reads its deltas).
int64_t comm_wait_ns();

// A host wait of a Work whose waiting thread drives the collective itself
// (threads and MPI backends: Note [Threads rounds], Note [MPI progress]),
// counted as Work::wait_finished() counts its own: in comm_wait_ns() and as
// a "comm wait" trace span.
class CommWaitScope {
 public:
  CommWaitScope();
  ~CommWaitScope();
  CommWaitScope(const CommWaitScope&) = delete;
  CommWaitScope& operator=(const CommWaitScope&) = delete;

 private:
  TraceSpan span_;
  std::chrono::steady_clock::time_point start_;
};

// A Work that is already complete (world size 1, empty collectives).
WorkPtr completed_work(std::string description, std::vector<Tensor> outputs);

}  // namespace tandem
