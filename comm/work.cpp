#include "tandem/comm/work.h"

#include <atomic>

#include "tandem/runtime/config.h"
#include "tandem/runtime/error.h"
#include "tandem/runtime/trace.h"

namespace tandem {

Work::Work(std::string description) : description_(std::move(description)) {}

void Work::finish(std::exception_ptr error) {
  std::vector<std::function<void()>> callbacks;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (completed_.load(std::memory_order_relaxed)) return;
    error_ = error;
    completed_.store(true, std::memory_order_release);
    callbacks.swap(callbacks_);
    kept_.clear();
  }
  cv_.notify_all();
  for (auto& fn : callbacks)
    fn();
}

void Work::on_completion(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!completed_.load(std::memory_order_relaxed)) {
      callbacks_.push_back(std::move(fn));
      return;
    }
  }
  fn();
}

namespace {
std::atomic<int64_t> g_comm_wait_ns{0};
}

int64_t comm_wait_ns() {
  return g_comm_wait_ns.load(std::memory_order_relaxed);
}

CommWaitScope::CommWaitScope()
    : span_("wait", "comm wait"), start_(std::chrono::steady_clock::now()) {}

CommWaitScope::~CommWaitScope() {
  g_comm_wait_ns.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(
                               std::chrono::steady_clock::now() - start_)
                               .count(),
                           std::memory_order_relaxed);
}

bool Work::wait_finished(std::chrono::milliseconds timeout) {
  if (completed_.load(std::memory_order_acquire)) return true;
  std::unique_lock<std::mutex> lock(mu_);
  if (completed_.load(std::memory_order_relaxed)) return true;
  // A host that blocks here is not computing: tandem-trace counts "wait"
  // spans as neither compute nor communication (Note [Exposed communication]).
  TraceSpan span("wait", "comm wait");
  const auto start = std::chrono::steady_clock::now();
  const bool done =
      cv_.wait_for(lock, timeout, [&] { return completed_.load(std::memory_order_relaxed); });
  g_comm_wait_ns.fetch_add(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start)
          .count(),
      std::memory_order_relaxed);
  return done;
}

std::exception_ptr Work::error() const {
  // error_ is written once, before completed_ (release), and never after.
  return completed_.load(std::memory_order_acquire) ? error_ : nullptr;
}

bool Work::is_completed() {
  return completed_.load(std::memory_order_acquire);
}

void Work::rethrow_if_failed() {
  std::exception_ptr e = error();
  if (e) std::rethrow_exception(e);
}

void Work::synchronize() {
  if (!wait_finished(wait_timeout())) {
    throw TimeoutError(fmt::format(
        "[comm::Work::synchronize] expected {} to complete within {} ms, got no completion "
        "(a peer may be missing; see the watchdog report of the group)",
        description_, wait_timeout().count()));
  }
  rethrow_if_failed();
}

void Work::wait() {
  // CPU: an inline stream is the caller; an async stream waits in its queue.
  // A CUDA output of a host-side backend (threads, Note [Threads ranks on one
  // CUDA device]) is complete when the Work is: the caller waits for that, so
  // its stream only runs later work on finished data.
  Device device = outputs_.empty() || !outputs_[0].defined() ? Device::cpu() : outputs_[0].device();
  const Stream& stream = current_stream(Device::cpu());
  if (!device.is_cpu() || stream.is_inline()) {
    synchronize();
    return;
  }
  std::shared_ptr<Work> self = shared_from_this();
  stream.enqueue_async([self] { self->synchronize(); }, false);
}

WorkPtr completed_work(std::string description, std::vector<Tensor> outputs) {
  auto w = std::make_shared<Work>(std::move(description));
  w->set_outputs(std::move(outputs));
  w->finish();
  return w;
}

}  // namespace tandem
