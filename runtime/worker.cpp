#include "tandem/runtime/worker.h"

#include "tandem/runtime/logging.h"

namespace tandem {

Worker::Worker(std::string name, Device device)
    : stream_(Stream::create(device, default_cpu_stream_mode(), name + "/stream")),
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

// The closure's tensors may still be in flight on the caller's stream (Note
// [Thread hand-off]): the worker's stream waits for them first.
void Worker::submit(std::function<void()> fn) {
  HandOff handed(stream_.device());
  queue_->push([handed, fn = std::move(fn)] {
    handed.wait();
    fn();
  });
}

void Worker::synchronize() {
  queue_->synchronize();
  stream_.synchronize();
}

}  // namespace tandem
