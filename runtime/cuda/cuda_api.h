// The only door from tandem to the CUDA runtime for host-side work.
//
// Note [CUDA stubs]
// ~~~~~~~~~~~~~~~~~
// Meson compiles either cuda_native.cpp (CUDA found: real cudart calls) or
// cuda_native_stub.cpp (no CUDA: device_count() is 0 and every other call
// throws "built without CUDA"), likewise the emulator or its stub
// (Note [CUDA backends]). No function body contains #ifdef. libcudart loads the
// driver lazily, so a CUDA build starts on a machine without a driver;
// device_count() treats any error from cudaGetDeviceCount (35: insufficient
// driver, 100: no device) as "no GPU" and never touches the count it did not
// write. Nothing here links the driver API (-lcuda): that would stop the binary
// from starting on a driverless machine. The same split holds for the kernels:
// tensor/cuda/*.cu or tensor/cuda/kernels_stub.cpp (Note [Two kernel
// compilations] in tensor/cuda/cuda_common.cuh).
//
// Note [CUDA backends]
// ~~~~~~~~~~~~~~~~~~~~
// Behind this header sit two implementations (runtime/cuda/backends.h): the
// native one (real cudart, or its stub) and the emulated device
// (runtime/cuda/emulator/, Note [Emulated CUDA device]), which runs the same
// kernel sources on the host. cuda_api.cpp picks one, once per process, from
// TANDEM_CUDA:
//   auto (default)  the real GPUs when a driver and a device exist, else none;
//   off             no CUDA device, even with a GPU present;
//   emulated        one emulated device, emulated:N N of them (1 to 8).
// A real GPU always wins: with a device present, `emulated` runs on it (so the
// suites that set TANDEM_CUDA=emulated test the real kernels on a GPU
// machine); the emulator runs only where no GPU exists. emulated() says which
// backend is live. A build without nvcc still has the emulated device unless
// configured with -Dgpu_emulator=disabled; the kernels then come from the
// emulated compilation alone (tensor/cuda/backend.cpp).
//
// Handles are passed as void* so this header needs no CUDA include.
#pragma once

#include <cstddef>

namespace tandem::cuda_api {

// True when this binary has a CUDA backend: nvcc's kernels or the emulator's.
bool compiled();
// True when the CUDA devices of this process are emulated (Note [CUDA backends]).
bool emulated();
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
