// Worker: a thread with a queue of closures and its own current stream
// (DESIGN §2). The forward and backward workers of the dual-pipe schedule are
// Workers. The first exception a closure throws is captured and rethrown on
// the caller at the next synchronize(); later closures are skipped until then.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "tandem/runtime/stream.h"
#include "tandem/runtime/task_queue.h"

namespace tandem {

class Worker {
 public:
  // `device`: the device whose stream becomes the worker's current stream. On
  // CPU the worker's stream has the default mode (default_cpu_stream_mode()):
  // inline runs ops on the worker thread itself, async on a stream of its own.
  explicit Worker(std::string name, Device device = Device::cpu());
  ~Worker();  // drains and joins; never throws
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  // Runs `fn` on the worker after the worker's stream has waited for the
  // caller's current stream (Note [Thread hand-off]).
  void submit(std::function<void()> fn);
  // Waits for every submitted closure and for the worker's stream; rethrows the
  // first error. Bounded by wait_timeout().
  void synchronize();
  // Waits up to `timeout` for the submitted closures to end, keeping any
  // error for synchronize(); false when one still runs.
  bool wait_idle(std::chrono::milliseconds timeout) const { return queue_->wait_idle(timeout); }
  const std::string& name() const { return queue_->name(); }
  const Stream& stream() const { return stream_; }

 private:
  Stream stream_;
  std::unique_ptr<TaskQueue> queue_;
};

}  // namespace tandem
