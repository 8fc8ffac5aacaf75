// The two implementations behind runtime/cuda/cuda_api.h (Note [CUDA backends]):
// cuda_backend::native (real cudart: cuda_native.cpp, or cuda_native_stub.cpp
// without CUDA) and cuda_backend::emulator (runtime/cuda/emulator/device.cpp,
// or device_stub.cpp when built with -Dgpu_emulator=disabled). Both declare the
// same functions as cuda_api; cuda_api.cpp picks one at run time.
#pragma once

#include <cstddef>

#include "tandem/runtime/cuda/cuda_api.h"

#define TANDEM_DECLARE_CUDA_BACKEND()                                                        \
  using cuda_api::CopyKind;                                                                  \
  bool compiled();                                                                           \
  int device_count();                                                                        \
  void set_device(int device);                                                               \
  int current_device();                                                                      \
  void* malloc(size_t nbytes, int device);                                                   \
  void free(void* ptr, int device);                                                          \
  size_t free_memory(int device);                                                            \
  void* stream_create(int device);                                                           \
  void stream_destroy(void* stream);                                                         \
  void stream_synchronize(void* stream);                                                     \
  bool stream_query(void* stream);                                                           \
  void* event_create(int device);                                                            \
  void event_destroy(void* event);                                                           \
  void event_record(void* event, void* stream);                                              \
  void stream_wait_event(void* stream, void* event);                                         \
  void event_synchronize(void* event);                                                       \
  bool event_query(void* event);                                                             \
  float event_elapsed_ms(void* start, void* end);                                            \
  void memcpy_async(void* dst, const void* src, size_t nbytes, CopyKind kind, void* stream); \
  void memset_async(void* dst, int value, size_t nbytes, void* stream);

namespace tandem::cuda_backend::native {
TANDEM_DECLARE_CUDA_BACKEND()
}  // namespace tandem::cuda_backend::native

namespace tandem::cuda_backend::emulator {
TANDEM_DECLARE_CUDA_BACKEND()
// The number of emulated devices, set once by cuda_api.cpp before any other call.
void set_device_count(int count);
}  // namespace tandem::cuda_backend::emulator
