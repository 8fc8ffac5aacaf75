#include "runtime/worker.h"

#include "runtime/logging.h"

namespace tandem {

Worker::Worker(std::string name, Device device)
    : stream_(Stream::create(device, CpuStreamMode::Inline, name + "/stream")),
      queue_(std::make_unique<TaskQueue>(name)) {
  // The worker thread adopts the stream (and the caller's log rank) first.
  Stream stream = stream_;
  LogContext context = current_log_context();
  queue_->push([stream, context, name] {
    set_current_stream(stream);
    set_log_context(context);
    set_thread_name(name);
  });
}

Worker::~Worker() = default;

void Worker::submit(std::function<void()> fn) {
  queue_->push(std::move(fn));
}

void Worker::synchronize() {
  queue_->synchronize();
  stream_.synchronize();
}

}  // namespace tandem
