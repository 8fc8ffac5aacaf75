// The MPI backend's executor: the one thread of the process that calls MPI
// after initialisation, and the progress loop of every MPI group.
//
// Note [One MPI executor]
// ~~~~~~~~~~~~~~~~~~~~~~~
// MPI may only grant MPI_THREAD_SERIALIZED, and even with MPI_THREAD_MULTIPLE
// two threads testing requests of one communicator serialise inside the
// library. So after MPI_Init_thread exactly one thread per process calls MPI:
// the executor. Every group of the process hands it tasks (launch() only
// queues, it never blocks) and the executor advances them with nonblocking
// MPI calls and MPI_Testall, sleeping briefly when nothing moved.
//
// Each group is a Channel: a FIFO of tasks run one at a time, in launch order
// (so collectives are started on the communicator in the same order on every
// rank, as MPI requires, and multi-step tasks such as the checked-mode
// handshake never interleave with the next collective). The heads of all
// channels progress together, so a collective waiting on one group never
// stalls another group: the same semantics as the threads backend's
// per-group executors.
//
// Waits are bounded (Note [Bounded waits]): a task whose MPI requests do not
// complete within its group's timeout fails with a watchdog report. MPI
// cannot cancel a collective, so the task's requests and the buffers they may
// still write are kept as an orphan (tested until they complete, never freed
// under MPI) and the channel is marked unusable: its queued and later tasks
// fail at once with an error that names the timed-out call.
//
// The executor is the one process-wide object of the backend (MPI itself is
// process-wide): executor() creates it, initialising MPI when needed, and
// finalize() drains it, joins it and finalises MPI.
#pragma once

#include <mpi.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "tensor/tensor.h"

namespace tandem::mpi {

// One unit of work on a channel. Runs only on the executor thread.
class Task {
 public:
  virtual ~Task() = default;
  // Called repeatedly while the task is at the head of its channel: posts
  // nonblocking MPI calls, tests them, and returns true once finished. Never
  // blocks; throws to fail the task.
  virtual bool advance() = 0;
  // Ends the task with an error (a throw from advance(), or its channel
  // being unusable). Never throws.
  virtual void fail(std::exception_ptr error) noexcept = 0;
  // "rank=1/4 group=world backend=mpi #7 all_reduce", for error messages.
  virtual std::string label() const = 0;
};

// A communicator and the FIFO of tasks issued on it.
class Channel {
 public:
  explicit Channel(MPI_Comm comm) : comm_(comm) {}
  Channel(const Channel&) = delete;
  Channel& operator=(const Channel&) = delete;

  MPI_Comm comm() const { return comm_; }
  // Once set, every queued and later task fails with this reason. Any thread.
  void mark_unusable(const std::string& reason);
  std::optional<std::string> unusable_reason() const;

 private:
  friend class Executor;
  MPI_Comm comm_;
  mutable std::mutex mu_;
  std::optional<std::string> unusable_;
  // Executor thread only.
  std::deque<std::unique_ptr<Task>> queue_;
  bool active_ = false;
};

// Requests a failed task could not complete, with everything they may still
// read or write. The executor tests them until they complete.
struct Orphan {
  std::vector<MPI_Request> requests;
  std::shared_ptr<void> buffers;
};

class Executor {
 public:
  Executor(int world_rank, int world_size, bool thread_multiple);
  ~Executor();  // stop(); never throws
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  int world_rank() const { return world_rank_; }
  int world_size() const { return world_size_; }
  bool thread_multiple() const { return thread_multiple_; }
  // The channel of MPI_COMM_WORLD itself (the parent of every world group).
  const std::shared_ptr<Channel>& world_channel() const { return world_channel_; }

  // Queues `task` at the end of `channel`. Any thread. After stop() the task
  // fails at once.
  void submit(std::shared_ptr<Channel> channel, std::unique_ptr<Task> task);
  // Frees a communicator on the executor thread (after stop(): nothing,
  // MPI_Finalize reclaims it). Any thread.
  void release(MPI_Comm comm);
  // Executor thread only: keeps the requests of a failed task.
  void adopt(Orphan orphan);
  bool on_executor_thread() const { return std::this_thread::get_id() == thread_.get_id(); }

  // Lets queued tasks finish (each is bounded), then joins the thread.
  void stop() noexcept;

 private:
  struct Item {
    std::shared_ptr<Channel> channel;
    std::unique_ptr<Task> task;  // or:
    MPI_Comm release = MPI_COMM_NULL;
  };
  void loop();
  void take(std::vector<Item>& items);
  bool progress_channels();
  void progress_orphans();

  int world_rank_;
  int world_size_;
  bool thread_multiple_;
  std::shared_ptr<Channel> world_channel_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Item> inbox_;
  bool stopping_ = false;
  bool stopped_ = false;

  // Executor thread only.
  std::vector<std::shared_ptr<Channel>> active_;
  std::vector<Orphan> orphans_;
  std::chrono::steady_clock::time_point next_orphan_poll_;

  std::thread thread_;
};

// The process's executor, initialising MPI (MPI_Init_thread asking for
// MPI_THREAD_MULTIPLE, accepting MPI_THREAD_SERIALIZED) unless the program
// already did. Throws after finalize(): MPI cannot be initialised twice.
std::shared_ptr<Executor> executor();
// Drains and joins the executor, then calls MPI_Finalize (once).
void finalize();

}  // namespace tandem::mpi
