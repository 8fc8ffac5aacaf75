// Stream and Event: the ordering primitives of DESIGN §2.
//
// Note [Stream ordering]
// ~~~~~~~~~~~~~~~~~~~~~~
// Every op is enqueued on the calling thread's current stream for the device
// of its operands. Work on one stream runs in FIFO order. Between streams the
// only ordering is an Event: `e.record(producer); e.wait(consumer);` makes
// everything enqueued on `consumer` afterwards run after everything enqueued on
// `producer` before the record. Hosts synchronise only through synchronize()
// and through value reads (Tensor::item/to_vector), which synchronise the
// tensor's stream.
//
// A CUDA stream is a cudaStream_t. A CPU stream is either *inline* (work runs
// immediately on the calling thread; the default, fastest) or *async* (a FIFO
// executor with one worker thread, TaskQueue), so that stream/event semantics
// are the same as on a GPU and a missing synchronisation shows up as a wrong
// result or a TSan report in CPU tests (TANDEM_CPU_STREAMS=async runs the whole
// suite that way).
//
// Buffer lifetime: on CPU a closure captures the storages it touches, so a
// buffer cannot be reused while a stream still holds work on it. On CUDA the
// caching allocator tracks the streams that used a block (record_stream).
//
// Note [Thread hand-off]
// ~~~~~~~~~~~~~~~~~~~~~~
// Each thread has its own current stream, so a tensor handed to another
// thread (a closure for a Worker, the body of a rank thread) may still be
// unwritten on the sending thread's stream when the receiving thread's stream
// reads it. Whoever hands work to another thread therefore forks: it records
// a HandOff on its own current streams, and the receiving thread waits on it
// (HandOff::wait) on its current streams before it runs the work. Whoever
// joins a thread's work synchronises that thread's stream before the results
// are read (Worker::synchronize, run_ranks). On inline streams both halves are
// free: an inline stream has run everything already.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "tandem/runtime/config.h"
#include "tandem/runtime/device.h"

namespace tandem {

class TaskQueue;

namespace detail {
struct StreamImpl;
struct EventImpl;
}  // namespace detail

class Stream {
 public:
  Stream() = default;  // null stream; use current_stream() or create()
  // A new stream on `device`. On CPU `mode` chooses inline or async.
  static Stream create(Device device, CpuStreamMode mode = CpuStreamMode::Async,
                       std::string name = "");

  Device device() const;
  bool is_inline() const;
  bool defined() const { return impl_ != nullptr; }
  // Unique per process, stable for the stream's lifetime (allocator pools, traces).
  uint64_t id() const;
  const std::string& name() const;
  // The cudaStream_t of a CUDA stream (as void*); null for CPU streams.
  void* native_handle() const;

  // CPU streams only: run `fn` in stream order. Inline streams run it now on
  // the caller (and exceptions propagate directly); async streams queue it and
  // a failure surfaces at the next synchronize().
  template <class F>
  void enqueue(F&& fn) const {
    if (is_inline()) {
      fn();
    } else {
      enqueue_async(std::function<void()>(std::forward<F>(fn)), false);
    }
  }
  void enqueue_async(std::function<void()> fn, bool always_run) const;

  // Host waits for all enqueued work; rethrows a captured error. Bounded.
  void synchronize() const;
  // True when all enqueued work has finished.
  bool query() const;

  friend bool operator==(const Stream& a, const Stream& b) { return a.impl_ == b.impl_; }

 private:
  explicit Stream(std::shared_ptr<detail::StreamImpl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<detail::StreamImpl> impl_;
  friend class Event;
};

// The calling thread's current stream for `device` (each thread starts with its
// own default stream per device, created on first use).
const Stream& current_stream(Device device = Device::cpu());
void set_current_stream(const Stream& stream);

// RAII: makes `stream` current for its device on this thread, restores on exit.
class StreamGuard {
 public:
  explicit StreamGuard(const Stream& stream);
  ~StreamGuard();
  StreamGuard(const StreamGuard&) = delete;
  StreamGuard& operator=(const StreamGuard&) = delete;

 private:
  Stream previous_;
};

class Event {
 public:
  Event();
  // Marks the point of `stream`'s queue reached so far.
  void record(const Stream& stream);
  // `stream` waits (the host does not) until the last record has completed.
  // Waiting on a never-recorded event is a no-op, as in CUDA.
  void wait(const Stream& stream) const;
  // Host waits until the last record has completed. Bounded (TimeoutError).
  void synchronize() const;
  bool query() const;
  // Milliseconds between this event's completion and `end`'s.
  float elapsed_ms(const Event& end) const;
  bool recorded() const;

 private:
  std::shared_ptr<detail::EventImpl> impl_;
};

// The fork half of Note [Thread hand-off]: records the calling thread's
// current CPU stream (and its current stream of `device` when that is a CUDA
// device); wait() makes the calling thread's current streams of the same
// devices wait for those records.
class HandOff {
 public:
  explicit HandOff(Device device = Device::cpu());
  void wait() const;

 private:
  Device device_;
  Event cpu_, device_event_;
};

}  // namespace tandem
