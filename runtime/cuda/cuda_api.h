// The only door from tandem to the CUDA runtime for host-side work.
//
// Note [CUDA stubs]
// ~~~~~~~~~~~~~~~~~
// Meson compiles either cuda_api.cpp (CUDA found: real cudart calls) or
// cuda_api_stub.cpp (no CUDA: device_count() is 0 and every other call throws
// "built without CUDA"). No function body contains #ifdef. libcudart loads the
// driver lazily, so a CUDA build starts on a machine without a driver;
// device_count() treats any error from cudaGetDeviceCount (35: insufficient
// driver, 100: no device) as "no GPU" and never touches the count it did not
// write. Nothing here links the driver API (-lcuda): that would stop the binary
// from starting on a driverless machine. The same split holds for the kernels:
// tensor/cuda/*.cu or tensor/cuda/kernels_stub.cpp.
//
// Handles are passed as void* so this header needs no CUDA include.
#pragma once

#include <cstddef>

namespace tandem::cuda_api {

bool compiled();
int device_count();
void set_device(int device);
int current_device();

void* malloc(size_t nbytes, int device);
void free(void* ptr, int device);
size_t free_memory(int device);

void* stream_create(int device);  // non-blocking w.r.t. the legacy default stream
void stream_destroy(void* stream);
void stream_synchronize(void* stream);
bool stream_query(void* stream);

void* event_create(int device);  // with timing
void event_destroy(void* event);
void event_record(void* event, void* stream);
void stream_wait_event(void* stream, void* event);
void event_synchronize(void* event);
bool event_query(void* event);
float event_elapsed_ms(void* start, void* end);

enum class CopyKind { HostToDevice, DeviceToHost, DeviceToDevice };
void memcpy_async(void* dst, const void* src, size_t nbytes, CopyKind kind, void* stream);
void memset_async(void* dst, int value, size_t nbytes, void* stream);

}  // namespace tandem::cuda_api
