// TaskQueue: a FIFO of closures run in order by one dedicated thread. The
// executor behind async CPU streams, Worker and the comm backends.
//
// Error policy (like a sticky CUDA error): the first exception a task throws is
// captured; later ordinary tasks are skipped until the error is taken by
// synchronize(), which rethrows it on the caller. Tasks pushed with
// `always_run` (event completions) run even then, so that a failure upstream
// can never leave another stream waiting forever.
//
// The queue's state is shared with its thread, so the owner may be destroyed
// from inside one of its own tasks (a task holding the last reference to the
// object that owns the queue): the thread then finishes the remaining tasks on
// its own and exits, instead of joining itself.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>

namespace tandem {

class TaskQueue {
 public:
  explicit TaskQueue(std::string name);
  ~TaskQueue();  // drains outstanding tasks, joins (or detaches, see above); never throws
  TaskQueue(const TaskQueue&) = delete;
  TaskQueue& operator=(const TaskQueue&) = delete;

  void push(std::function<void()> task, bool always_run = false);
  // Blocks until every task pushed so far has run, then rethrows the first
  // captured error (and clears it). Bounded by wait_timeout().
  void synchronize();
  // True when nothing is queued or running.
  bool idle() const;
  // Waits up to `timeout` for every task pushed so far to finish, without
  // taking the captured error; false when the time ran out.
  bool wait_idle(std::chrono::milliseconds timeout) const;
  const std::string& name() const;
  std::thread::id thread_id() const { return thread_.get_id(); }

  struct State;

 private:
  std::shared_ptr<State> state_;
  std::thread thread_;
};

}  // namespace tandem
