#include "tandem/runtime/stream.h"

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>

#include "tandem/runtime/cuda/cuda_api.h"
#include "tandem/runtime/error.h"
#include "tandem/runtime/task_queue.h"

namespace tandem {
namespace detail {

namespace {
std::atomic<uint64_t> next_stream_id{1};
}

struct StreamImpl {
  Device device;
  bool is_inline = false;
  uint64_t id = next_stream_id++;
  std::string name;
  std::unique_ptr<TaskQueue> queue;  // async CPU streams
  void* native = nullptr;            // CUDA streams

  ~StreamImpl() {
    if (native != nullptr) cuda_api::stream_destroy(native);
  }
};

// A CPU event completes when its record task runs; generations let one event
// be recorded many times (a wait captures the generation current at the call).
struct EventImpl {
  std::mutex mu;
  std::condition_variable cv;
  uint64_t recorded = 0;
  uint64_t completed = 0;
  std::chrono::steady_clock::time_point completed_at;
  // CUDA
  void* native = nullptr;
  int cuda_device = -1;

  ~EventImpl() {
    if (native != nullptr) cuda_api::event_destroy(native);
  }

  void complete(uint64_t generation) {
    std::lock_guard<std::mutex> lock(mu);
    if (generation > completed) {
      completed = generation;
      completed_at = std::chrono::steady_clock::now();
    }
    cv.notify_all();
  }

  // Host-side wait for `generation`; bounded (Note [Bounded waits]).
  void wait_for(uint64_t generation, const char* who) {
    std::unique_lock<std::mutex> lock(mu);
    if (!cv.wait_for(lock, wait_timeout(), [&] { return completed >= generation; })) {
      throw TimeoutError(
          fmt::format("[runtime::Event] {} expected record #{} to complete within {} ms, got "
                      "only #{} completed (the producing stream is stalled or failed)",
                      who, generation, wait_timeout().count(), completed));
    }
  }
};

}  // namespace detail

Stream Stream::create(Device device, CpuStreamMode mode, std::string name) {
  auto impl = std::make_shared<detail::StreamImpl>();
  impl->device = device;
  impl->name = name.empty() ? fmt::format("{}/stream{}", device.str(), impl->id) : std::move(name);
  if (device.is_cpu()) {
    impl->is_inline = mode == CpuStreamMode::Inline;
    if (!impl->is_inline) impl->queue = std::make_unique<TaskQueue>(impl->name);
  } else {
    impl->native = cuda_api::stream_create(device.index());
  }
  return Stream(std::move(impl));
}

Device Stream::device() const {
  return impl_->device;
}
bool Stream::is_inline() const {
  return impl_->is_inline;
}
uint64_t Stream::id() const {
  return impl_ ? impl_->id : 0;
}
const std::string& Stream::name() const {
  return impl_->name;
}
void* Stream::native_handle() const {
  return impl_->native;
}

void Stream::enqueue_async(std::function<void()> fn, bool always_run) const {
  TANDEM_INTERNAL_ASSERT(impl_ && impl_->device.is_cpu(), "enqueue on a non-CPU stream");
  if (impl_->is_inline) {
    fn();
  } else {
    impl_->queue->push(std::move(fn), always_run);
  }
}

void Stream::synchronize() const {
  if (impl_->device.is_cuda()) {
    cuda_api::stream_synchronize(impl_->native);
  } else if (!impl_->is_inline) {
    impl_->queue->synchronize();
  }
}

bool Stream::query() const {
  if (impl_->device.is_cuda()) return cuda_api::stream_query(impl_->native);
  return impl_->is_inline || impl_->queue->idle();
}

namespace {

constexpr int kMaxCudaDevices = 16;

struct ThreadStreams {
  Stream cpu;
  std::array<Stream, kMaxCudaDevices> cuda;
};

ThreadStreams& thread_streams() {
  thread_local ThreadStreams streams;
  return streams;
}

Stream& slot_for(Device device) {
  ThreadStreams& s = thread_streams();
  if (device.is_cpu()) return s.cpu;
  TANDEM_CHECK(device.index() < kMaxCudaDevices,
               "[runtime::Stream] expected a CUDA device index < {}, got {}", kMaxCudaDevices,
               device.index());
  return s.cuda[device.index()];
}

}  // namespace

const Stream& current_stream(Device device) {
  Stream& slot = slot_for(device);
  if (!slot.defined()) {
    slot = Stream::create(device, default_cpu_stream_mode(), device.str() + "/default");
  }
  return slot;
}

void set_current_stream(const Stream& stream) {
  TANDEM_CHECK(stream.defined(), "[runtime::set_current_stream] expected a stream, got null");
  slot_for(stream.device()) = stream;
}

StreamGuard::StreamGuard(const Stream& stream) : previous_(current_stream(stream.device())) {
  set_current_stream(stream);
}

StreamGuard::~StreamGuard() {
  slot_for(previous_.device()) = previous_;
}

Event::Event() : impl_(std::make_shared<detail::EventImpl>()) {}

void Event::record(const Stream& stream) {
  auto& e = *impl_;
  if (stream.device().is_cuda()) {
    if (e.native == nullptr) {
      e.native = cuda_api::event_create(stream.device().index());
      e.cuda_device = stream.device().index();
    }
    TANDEM_CHECK(e.cuda_device == stream.device().index(),
                 "[runtime::Event::record] expected a stream on cuda:{}, got {}", e.cuda_device,
                 stream.device().str());
    cuda_api::event_record(e.native, stream.native_handle());
    std::lock_guard<std::mutex> lock(e.mu);
    ++e.recorded;
    return;
  }
  uint64_t generation;
  {
    std::lock_guard<std::mutex> lock(e.mu);
    generation = ++e.recorded;
  }
  if (stream.is_inline()) {
    e.complete(generation);
  } else {
    auto impl = impl_;
    stream.enqueue_async([impl, generation] { impl->complete(generation); }, /*always_run=*/true);
  }
}

void Event::wait(const Stream& stream) const {
  auto& e = *impl_;
  uint64_t generation;
  {
    std::lock_guard<std::mutex> lock(e.mu);
    generation = e.recorded;
  }
  if (generation == 0) return;
  if (e.native != nullptr) {
    TANDEM_CHECK(stream.device().is_cuda(),
                 "[runtime::Event::wait] expected a CUDA stream for a CUDA event, got {}",
                 stream.device().str());
    cuda_api::stream_wait_event(stream.native_handle(), e.native);
    return;
  }
  TANDEM_CHECK(stream.device().is_cpu(),
               "[runtime::Event::wait] expected a CPU stream for a CPU event, got {} (use "
               "synchronize() to order a CPU producer before a GPU consumer)",
               stream.device().str());
  if (stream.is_inline()) {
    e.wait_for(generation, "inline stream wait");
  } else {
    auto impl = impl_;
    // Not always_run: after an upstream failure the consumer's work is skipped anyway.
    stream.enqueue_async([impl, generation] { impl->wait_for(generation, "stream wait"); }, false);
  }
}

void Event::synchronize() const {
  auto& e = *impl_;
  if (e.native != nullptr) {
    cuda_api::event_synchronize(e.native);
    return;
  }
  uint64_t generation;
  {
    std::lock_guard<std::mutex> lock(e.mu);
    generation = e.recorded;
  }
  e.wait_for(generation, "Event::synchronize");
}

bool Event::query() const {
  auto& e = *impl_;
  if (e.native != nullptr) return cuda_api::event_query(e.native);
  std::lock_guard<std::mutex> lock(e.mu);
  return e.completed >= e.recorded;
}

bool Event::recorded() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->recorded > 0;
}

float Event::elapsed_ms(const Event& end) const {
  TANDEM_CHECK(recorded() && end.recorded(),
               "[runtime::Event::elapsed_ms] expected both events recorded, got start={} end={}",
               recorded(), end.recorded());
  if (impl_->native != nullptr) return cuda_api::event_elapsed_ms(impl_->native, end.impl_->native);
  synchronize();
  end.synchronize();
  std::chrono::steady_clock::time_point start_at, end_at;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    start_at = impl_->completed_at;
  }
  {
    std::lock_guard<std::mutex> lock(end.impl_->mu);
    end_at = end.impl_->completed_at;
  }
  return std::chrono::duration<float, std::milli>(end_at - start_at).count();
}

HandOff::HandOff(Device device) : device_(device) {
  // An event never recorded is complete: nothing to do for streams that have
  // run everything enqueued (inline ones always have).
  const Stream& cpu = current_stream(Device::cpu());
  if (!cpu.query()) cpu_.record(cpu);
  if (device_.is_cuda()) device_event_.record(current_stream(device_));
}

void HandOff::wait() const {
  cpu_.wait(current_stream(Device::cpu()));
  if (device_.is_cuda()) device_event_.wait(current_stream(device_));
}

}  // namespace tandem
