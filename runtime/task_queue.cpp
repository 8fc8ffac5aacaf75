#include "runtime/task_queue.h"

#include "runtime/config.h"
#include "runtime/error.h"

namespace tandem {

TaskQueue::TaskQueue(std::string name) : name_(std::move(name)), thread_([this] { loop(); }) {}

TaskQueue::~TaskQueue() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_work_.notify_all();
  thread_.join();
}

void TaskQueue::push(std::function<void()> task, bool always_run) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    tasks_.push_back(Task{std::move(task), always_run});
    ++pushed_;
  }
  cv_work_.notify_one();
}

void TaskQueue::loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_work_.wait(lock, [&] { return stop_ || !tasks_.empty(); });
    if (tasks_.empty()) return;  // stop_ and drained
    Task task = std::move(tasks_.front());
    tasks_.pop_front();
    bool skip = error_ != nullptr && !task.always_run;
    lock.unlock();
    std::exception_ptr failure;
    if (!skip) {
      try {
        task.fn();
      } catch (...) {
        failure = std::current_exception();
      }
    }
    task.fn = nullptr;  // release captured storage before reporting completion
    lock.lock();
    if (failure && !error_) error_ = failure;
    ++finished_;
    cv_done_.notify_all();
  }
}

void TaskQueue::synchronize() {
  std::unique_lock<std::mutex> lock(mu_);
  uint64_t target = pushed_;
  bool done = cv_done_.wait_for(lock, wait_timeout(), [&] { return finished_ >= target; });
  if (!done) {
    throw TimeoutError(fmt::format(
        "[runtime::TaskQueue] synchronize on '{}' expected {} tasks to finish within {} ms, "
        "got {} finished ({} still queued)",
        name_, target, wait_timeout().count(), finished_, tasks_.size()));
  }
  if (error_) {
    std::exception_ptr e = error_;
    error_ = nullptr;
    std::rethrow_exception(e);
  }
}

bool TaskQueue::idle() const {
  std::lock_guard<std::mutex> lock(mu_);
  return finished_ == pushed_;
}

}  // namespace tandem
