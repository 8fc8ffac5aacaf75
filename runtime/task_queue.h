// TaskQueue: a FIFO of closures run in order by one dedicated thread. The
// executor behind async CPU streams and behind Worker.
//
// Error policy (like a sticky CUDA error): the first exception a task throws is
// captured; later ordinary tasks are skipped until the error is taken by
// synchronize(), which rethrows it on the caller. Tasks pushed with
// `always_run` (event completions) run even then, so that a failure upstream
// can never leave another stream waiting forever.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

namespace tandem {

class TaskQueue {
 public:
  explicit TaskQueue(std::string name);
  ~TaskQueue();  // drains outstanding tasks, joins; never throws
  TaskQueue(const TaskQueue&) = delete;
  TaskQueue& operator=(const TaskQueue&) = delete;

  void push(std::function<void()> task, bool always_run = false);
  // Blocks until every task pushed so far has run, then rethrows the first
  // captured error (and clears it). Bounded by wait_timeout().
  void synchronize();
  // True when nothing is queued or running.
  bool idle() const;
  const std::string& name() const { return name_; }
  std::thread::id thread_id() const { return thread_.get_id(); }

 private:
  struct Task {
    std::function<void()> fn;
    bool always_run;
  };
  void loop();

  std::string name_;
  mutable std::mutex mu_;
  std::condition_variable cv_work_;
  std::condition_variable cv_done_;
  std::deque<Task> tasks_;
  uint64_t pushed_ = 0;
  uint64_t finished_ = 0;
  std::exception_ptr error_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace tandem
