#include "tandem/runtime/task_queue.h"

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <mutex>

#include "tandem/runtime/config.h"
#include "tandem/runtime/error.h"

namespace tandem {

struct TaskQueue::State {
  struct Task {
    std::function<void()> fn;
    bool always_run;
  };
  std::string name;
  std::mutex mu;
  std::condition_variable cv_work;
  std::condition_variable cv_done;
  std::deque<Task> tasks;
  uint64_t pushed = 0;
  uint64_t finished = 0;
  std::exception_ptr error;
  bool stop = false;

  void loop() {
    std::unique_lock<std::mutex> lock(mu);
    for (;;) {
      cv_work.wait(lock, [&] { return stop || !tasks.empty(); });
      if (tasks.empty()) return;  // stop and drained
      Task task = std::move(tasks.front());
      tasks.pop_front();
      bool skip = error != nullptr && !task.always_run;
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
      if (failure && !error) error = failure;
      ++finished;
      cv_done.notify_all();
    }
  }
};

TaskQueue::TaskQueue(std::string name) : state_(std::make_shared<State>()) {
  state_->name = std::move(name);
  std::shared_ptr<State> state = state_;
  thread_ = std::thread([state] { state->loop(); });
}

TaskQueue::~TaskQueue() {
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->stop = true;
  }
  state_->cv_work.notify_all();
  if (thread_.get_id() == std::this_thread::get_id()) {
    thread_.detach();  // destroyed by one of our own tasks: the thread finishes alone
  } else {
    thread_.join();
  }
}

void TaskQueue::push(std::function<void()> task, bool always_run) {
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->tasks.push_back(State::Task{std::move(task), always_run});
    ++state_->pushed;
  }
  state_->cv_work.notify_one();
}

void TaskQueue::synchronize() {
  State& s = *state_;
  std::unique_lock<std::mutex> lock(s.mu);
  uint64_t target = s.pushed;
  bool done = s.cv_done.wait_for(lock, wait_timeout(), [&] { return s.finished >= target; });
  if (!done) {
    throw TimeoutError(fmt::format(
        "[runtime::TaskQueue] synchronize on '{}' expected {} tasks to finish within {} ms, "
        "got {} finished ({} still queued)",
        s.name, target, wait_timeout().count(), s.finished, s.tasks.size()));
  }
  if (s.error) {
    std::exception_ptr e = s.error;
    s.error = nullptr;
    std::rethrow_exception(e);
  }
}

bool TaskQueue::idle() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->finished == state_->pushed;
}

bool TaskQueue::wait_idle(std::chrono::milliseconds timeout) const {
  State& s = *state_;
  std::unique_lock<std::mutex> lock(s.mu);
  const uint64_t target = s.pushed;
  return s.cv_done.wait_for(lock, timeout, [&] { return s.finished >= target; });
}

const std::string& TaskQueue::name() const {
  return state_->name;
}

}  // namespace tandem
