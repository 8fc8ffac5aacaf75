// The emulated CUDA runtime: the cuda_backend::emulator backend of runtime/cuda/cuda_api.h
// (Note [CUDA backends]) and the runtime calls of the emulated kernel
// compilation (runtime/cuda/emulator/kernel_api.h).
//
// - Device memory is host memory, one plain malloc per allocation, so
//   AddressSanitizer sees a kernel's access past the end of a buffer.
// - A CUDA stream is an asynchronous CPU stream (runtime/stream.h: a FIFO
//   with its own worker thread); a kernel launch enqueues its grid there, and
//   the grid's blocks run on that thread and the executor's pool.
// - A CUDA event is a tandem Event recorded on that CPU stream: record, wait,
//   synchronize, query and elapsed_ms keep their CUDA meaning. Errors thrown
//   by a kernel stay on the stream (like a sticky CUDA error) and surface at
//   the next synchronisation.
// - Copies follow cudaMemcpyAsync on pageable host memory: host-to-device
//   takes a snapshot of the source before returning, device-to-host returns
//   once the copy has run.
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "tandem/runtime/cuda/backends.h"
#include "tandem/runtime/cuda/emulator/executor.h"
#include "tandem/runtime/error.h"
#include "tandem/runtime/stream.h"

namespace tandem {
namespace {

// Reported by free_memory: the emulated devices share the host's memory, so
// this is only the figure callers that size caches by it see.
constexpr size_t kReportedFreeBytes = size_t{16} << 30;

std::atomic<int> emulated_devices{1};
thread_local int current = 0;

struct EmulatedStream {
  int device;
  Stream stream;  // an asynchronous CPU stream
};

struct EmulatedEvent {
  int device;
  Event event;
};

EmulatedStream& stream_of(void* stream) {
  TANDEM_CHECK(stream != nullptr,
               "[cuda::emulator] expected an emulated stream, got the null (legacy default) "
               "stream");
  return *static_cast<EmulatedStream*>(stream);
}

EmulatedEvent& event_of(void* event) {
  return *static_cast<EmulatedEvent*>(event);
}

void check_device(int device, const char* op) {
  const int count = emulated_devices.load();
  TANDEM_CHECK(device >= 0 && device < count,
               "[cuda::{}] expected an emulated device index in [0, {}), got {}", op, count,
               device);
}

void enqueue(void* stream, std::function<void()> task) {
  stream_of(stream).stream.enqueue_async(std::move(task), false);
}

}  // namespace

namespace cuda_backend::emulator {

bool compiled() {
  return true;
}
void set_device_count(int count) {
  emulated_devices.store(count);
}
int device_count() {
  return emulated_devices.load();
}
void set_device(int device) {
  check_device(device, "set_device");
  current = device;
}
int current_device() {
  return current;
}

void* malloc(size_t nbytes, int device) {
  check_device(device, "malloc");
  return std::malloc(nbytes == 0 ? 1 : nbytes);  // null: the caching allocator frees and retries
}
void free(void* ptr, int) {
  std::free(ptr);
}
size_t free_memory(int device) {
  check_device(device, "free_memory");
  return kReportedFreeBytes;
}

void* stream_create(int device) {
  check_device(device, "stream_create");
  auto s = std::make_unique<EmulatedStream>(
      EmulatedStream{device, Stream::create(Device::cpu(), CpuStreamMode::Async,
                                            fmt::format("cuda:{}/emulated", device))});
  return s.release();  // owned by the caller's RAII stream (runtime/stream.cpp)
}
void stream_destroy(void* stream) {
  delete static_cast<EmulatedStream*>(stream);
}
void stream_synchronize(void* stream) {
  stream_of(stream).stream.synchronize();
}
bool stream_query(void* stream) {
  return stream_of(stream).stream.query();
}

void* event_create(int device) {
  check_device(device, "event_create");
  return std::make_unique<EmulatedEvent>(EmulatedEvent{device, Event()}).release();
}
void event_destroy(void* event) {
  delete static_cast<EmulatedEvent*>(event);
}
void event_record(void* event, void* stream) {
  event_of(event).event.record(stream_of(stream).stream);
}
void stream_wait_event(void* stream, void* event) {
  event_of(event).event.wait(stream_of(stream).stream);
}
void event_synchronize(void* event) {
  event_of(event).event.synchronize();
}
bool event_query(void* event) {
  return event_of(event).event.query();
}
float event_elapsed_ms(void* start, void* end) {
  return event_of(start).event.elapsed_ms(event_of(end).event);
}

void memcpy_async(void* dst, const void* src, size_t nbytes, CopyKind kind, void* stream) {
  if (nbytes == 0) return;
  if (kind == CopyKind::HostToDevice) {
    auto staged = std::make_shared<std::vector<unsigned char>>(
        static_cast<const unsigned char*>(src), static_cast<const unsigned char*>(src) + nbytes);
    enqueue(stream, [dst, staged] { std::memcpy(dst, staged->data(), staged->size()); });
    return;
  }
  enqueue(stream, [dst, src, nbytes] { std::memmove(dst, src, nbytes); });
  if (kind == CopyKind::DeviceToHost) stream_synchronize(stream);
}
void memset_async(void* dst, int value, size_t nbytes, void* stream) {
  if (nbytes == 0) return;
  enqueue(stream, [dst, value, nbytes] { std::memset(dst, value, nbytes); });
}

}  // namespace cuda_backend::emulator

// The runtime calls of the emulated kernel compilation (kernel_api.h).
namespace emu {

void enqueue_host(void* stream, std::function<void()> task) {
  enqueue(stream, std::move(task));
}
void enqueue_grid(void* stream, const LaunchShape& shape, std::function<void()> thread_body) {
  check_shape(shape);  // at the launch, as a GPU reports a bad configuration
  enqueue(stream, [shape, body = std::move(thread_body)] { run_grid(shape, body); });
}
int stream_device(void* stream) {
  return stream_of(stream).device;
}
void* malloc_async(size_t nbytes, void* stream) {
  void* ptr = cuda_backend::emulator::malloc(nbytes, stream_of(stream).device);
  TANDEM_CHECK(ptr != nullptr, "[cuda::emulator] expected {} bytes of device memory, got none",
               nbytes);
  return ptr;
}
void free_async(void* ptr, void* stream) {
  enqueue(stream, [ptr] { std::free(ptr); });
}
void copy_async(void* dst, const void* src, size_t nbytes, void* stream) {
  cuda_backend::emulator::memcpy_async(dst, src, nbytes, cuda_api::CopyKind::DeviceToDevice,
                                       stream);
}
void set_device(int device) {
  cuda_backend::emulator::set_device(device);
}
int current_device() {
  return cuda_backend::emulator::current_device();
}

}  // namespace emu
}  // namespace tandem
