// The MPI backend's executor: the one thread of the process that calls MPI
// after initialisation, and the progress loop of every MPI group.
//
// Note [One MPI executor]
// ~~~~~~~~~~~~~~~~~~~~~~~
// MPI may only grant MPI_THREAD_SERIALIZED, and even with MPI_THREAD_MULTIPLE
// two threads testing requests of one communicator serialise inside the
// library. So after MPI_Init_thread MPI is called by one thread at a time:
// whoever holds the executor's progress lock. Every group of the process
// hands the executor tasks (launch() only queues, it never blocks), and a
// *pass* (under the progress lock) takes the queued tasks and advances them
// with nonblocking MPI calls and MPI_Testall.
//
// Who runs the passes (Note [MPI progress]): a thread blocked in
// Work::synchronize() runs them itself, back to back, until its Work
// completes; the executor thread runs them otherwise, sleeping briefly when
// nothing moved.
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
//
// Note [MPI progress]
// ~~~~~~~~~~~~~~~~~~~
// Open MPI moves data only inside MPI calls: a collective of n ranks takes
// several rounds of messages (and a large one many fragments), and each needs
// a test call on the sending and on the receiving side. Progress therefore
// has to be continuous while a collective runs, or every round waits for the
// next poll: with the executor thread sleeping between idle passes (and the
// timer slack lengthening each sleep), a 1 MiB all_gather took many times as
// long as the same MPI call made directly (README, benchmark section,
// "Measurements behind design choices").
// - While some thread waits on a Work of this backend (synchronize(), wait()
//   on an inline stream, or the stream thread of an asynchronous one), that
//   thread runs passes back to back, yielding its core between idle passes,
//   as MPI_Wait does. It costs no thread hand-off: the waiter posts the MPI
//   calls (when the executor thread has not yet), tests them and sees its
//   Work finish. The executor thread stays asleep meanwhile.
// - With nobody waiting (a collective overlapped with compute), the
//   executor thread runs the passes and backs off when nothing moved, so an
//   idle wait costs little CPU on oversubscribed machines.
//
// Note [Lazy executor wake-ups]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Waking the executor thread at every launch cost more than the hand-off it
// replaced: on a loaded machine the woken thread preempted the launching one
// and took the progress lock just before that thread came to wait, which
// tripled a small all_gather's time (README, benchmark section,
// "Measurements behind design choices"). So while launches are waited
// right away (the last waited Work was waited within kSyncWindow of its
// launch), a launch whose Work drives its own progress does not wake the
// executor thread; the waiter takes the task in its first pass. The executor
// thread then looks every kLazyCheck for a task nobody took in that time,
// and if it finds one, progresses it and goes back to waking at every
// launch, so overlapped collectives start at once again. After kLazyWindow
// without launches it sleeps until the next launch wakes it. Tasks without
// such a Work (splits, checked exchanges for NCCL, communicator releases)
// always wake it.
#pragma once

#include <mpi.h>

#include <atomic>
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

#include "tandem/tensor/tensor.h"

namespace tandem::mpi {

// One unit of work on a channel. Runs only in the executor's passes.
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
  // In passes only (under the executor's progress lock).
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
  // fails at once. `waited_soon`: a Work that drives progress when waited
  // (MpiWork) completes the task, which need not wake the executor thread
  // while launches are waited right away (Note [Lazy executor wake-ups]).
  void submit(std::shared_ptr<Channel> channel, std::unique_ptr<Task> task,
              bool waited_soon = false);
  // Frees a communicator in a pass (after stop(): nothing, MPI_Finalize
  // reclaims it). Any thread.
  void release(MPI_Comm comm);
  // In a pass only: keeps the requests of a failed task.
  void adopt(Orphan orphan);
  bool on_executor_thread() const { return std::this_thread::get_id() == thread_.get_id(); }

  // Runs passes on the calling thread until done() or the deadline (Note [MPI
  // progress]). Returns at once after stop() or when called from inside a
  // pass (a completion callback). Any thread but the executor's.
  void drive(const std::function<bool()>& done, std::chrono::steady_clock::time_point deadline);
  // A thread starts waiting on a task submitted at `launched` (Note [Lazy
  // executor wake-ups]).
  void waited(std::chrono::steady_clock::time_point launched);
  // One pass on the calling thread, unless another thread is running one.
  void try_pass();

  // Lets queued tasks finish (each is bounded), then joins the thread.
  void stop() noexcept;

 private:
  struct Item {
    std::shared_ptr<Channel> channel;
    std::unique_ptr<Task> task;  // or:
    MPI_Comm release = MPI_COMM_NULL;
  };
  void loop();
  void enqueue(Item item, bool waited_soon);  // under mu_
  // Under progress_mu_: takes the inbox, advances the channels and orphans.
  // True when some task finished or a new one arrived.
  bool pass();
  bool in_pass() const;  // the calling thread runs a pass
  void take(std::vector<Item>& items);
  bool progress_channels();
  void progress_orphans();

  int world_rank_;
  int world_size_;
  bool thread_multiple_;
  std::shared_ptr<Channel> world_channel_;

  std::mutex mu_;  // the inbox and the flags below; cv_ sleeps on it
  std::condition_variable cv_;
  std::vector<Item> inbox_;
  bool stopping_ = false;
  bool stopped_ = false;      // also written under progress_mu_: no pass after it
  int drivers_ = 0;           // threads in drive()
  bool has_tasks_ = false;    // as of the last pass
  bool has_orphans_ = false;  // as of the last pass
  // Note [Lazy executor wake-ups].
  bool lazy_ = false;       // the last waited launch was waited within kSyncWindow
  bool deep_idle_ = false;  // the executor thread waits for a notification only
  int eager_items_ = 0;     // inbox items that do not wait for a waiter
  std::chrono::steady_clock::time_point inbox_since_, last_submit_;

  // Held for each pass: MPI is called under it only. Its holder owns the
  // state below.
  std::mutex progress_mu_;
  std::atomic<std::thread::id> pass_thread_{};
  std::vector<Item> taken_;
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
