// Real CUDA runtime calls, the native backend of runtime/cuda/cuda_api.h (compiled only when
// nvcc/CUDA is found; Note [CUDA stubs], Note [CUDA backends]).
#include "tandem/runtime/cuda/backends.h"

#include <cuda_runtime_api.h>

#include "tandem/runtime/cuda/cuda_check.h"

namespace tandem::cuda_backend::native {

bool compiled() {
  return true;
}

int device_count() {
  int count = 0;  // left untouched when the call fails (no driver)
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return count;
}

void set_device(int device) {
  TANDEM_CUDA_CHECK(cudaSetDevice(device));
}

int current_device() {
  int device = 0;
  TANDEM_CUDA_CHECK(cudaGetDevice(&device));
  return device;
}

void* malloc(size_t nbytes, int device) {
  set_device(device);
  void* ptr = nullptr;
  cudaError_t err = cudaMalloc(&ptr, nbytes);
  if (err == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    return nullptr;  // the caching allocator frees its cache and retries
  }
  TANDEM_CUDA_CHECK(err);
  return ptr;
}

void free(void* ptr, int device) {
  set_device(device);
  TANDEM_CUDA_CHECK(cudaFree(ptr));
}

size_t free_memory(int device) {
  set_device(device);
  size_t free_bytes = 0, total = 0;
  TANDEM_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total));
  return free_bytes;
}

void* stream_create(int device) {
  set_device(device);
  cudaStream_t s = nullptr;
  TANDEM_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  return s;
}

void stream_destroy(void* stream) {
  (void)cudaStreamDestroy(static_cast<cudaStream_t>(stream));
}

void stream_synchronize(void* stream) {
  TANDEM_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
}

bool stream_query(void* stream) {
  cudaError_t err = cudaStreamQuery(static_cast<cudaStream_t>(stream));
  if (err == cudaErrorNotReady) return false;
  TANDEM_CUDA_CHECK(err);
  return true;
}

void* event_create(int device) {
  set_device(device);
  cudaEvent_t e = nullptr;
  TANDEM_CUDA_CHECK(cudaEventCreate(&e));
  return e;
}

void event_destroy(void* event) {
  (void)cudaEventDestroy(static_cast<cudaEvent_t>(event));
}

void event_record(void* event, void* stream) {
  TANDEM_CUDA_CHECK(
      cudaEventRecord(static_cast<cudaEvent_t>(event), static_cast<cudaStream_t>(stream)));
}

void stream_wait_event(void* stream, void* event) {
  TANDEM_CUDA_CHECK(
      cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(event), 0));
}

void event_synchronize(void* event) {
  TANDEM_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(event)));
}

bool event_query(void* event) {
  cudaError_t err = cudaEventQuery(static_cast<cudaEvent_t>(event));
  if (err == cudaErrorNotReady) return false;
  TANDEM_CUDA_CHECK(err);
  return true;
}

float event_elapsed_ms(void* start, void* end) {
  float ms = 0;
  TANDEM_CUDA_CHECK(
      cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(start), static_cast<cudaEvent_t>(end)));
  return ms;
}

void memcpy_async(void* dst, const void* src, size_t nbytes, CopyKind kind, void* stream) {
  cudaMemcpyKind k = kind == CopyKind::HostToDevice   ? cudaMemcpyHostToDevice
                     : kind == CopyKind::DeviceToHost ? cudaMemcpyDeviceToHost
                                                      : cudaMemcpyDeviceToDevice;
  TANDEM_CUDA_CHECK(cudaMemcpyAsync(dst, src, nbytes, k, static_cast<cudaStream_t>(stream)));
}

void memset_async(void* dst, int value, size_t nbytes, void* stream) {
  TANDEM_CUDA_CHECK(cudaMemsetAsync(dst, value, nbytes, static_cast<cudaStream_t>(stream)));
}

}  // namespace tandem::cuda_backend::native
