// Compiled instead of device.cpp and executor.cpp in a build configured with
// -Dgpu_emulator=disabled (Note [CUDA backends]): there is no emulated device,
// and cuda_api.cpp never selects this backend (it checks compiled() first).
#include "tandem/runtime/cuda/backends.h"
#include "tandem/runtime/error.h"

namespace tandem::cuda_backend::emulator {
namespace {
[[noreturn]] void no_emulator(const char* what) {
  TANDEM_FAIL("[cuda::{}] expected a build with the emulated device, got -Dgpu_emulator=disabled",
              what);
}
}  // namespace

bool compiled() {
  return false;
}
void set_device_count(int) {
  no_emulator("set_device_count");
}
int device_count() {
  return 0;
}
void set_device(int) {
  no_emulator("set_device");
}
int current_device() {
  no_emulator("current_device");
}
void* malloc(size_t, int) {
  no_emulator("malloc");
}
void free(void*, int) {
  no_emulator("free");
}
size_t free_memory(int) {
  no_emulator("free_memory");
}
void* stream_create(int) {
  no_emulator("stream_create");
}
void stream_destroy(void*) {}
void stream_synchronize(void*) {
  no_emulator("stream_synchronize");
}
bool stream_query(void*) {
  no_emulator("stream_query");
}
void* event_create(int) {
  no_emulator("event_create");
}
void event_destroy(void*) {}
void event_record(void*, void*) {
  no_emulator("event_record");
}
void stream_wait_event(void*, void*) {
  no_emulator("stream_wait_event");
}
void event_synchronize(void*) {
  no_emulator("event_synchronize");
}
bool event_query(void*) {
  no_emulator("event_query");
}
float event_elapsed_ms(void*, void*) {
  no_emulator("event_elapsed_ms");
}
void memcpy_async(void*, const void*, size_t, CopyKind, void*) {
  no_emulator("memcpy_async");
}
void memset_async(void*, int, size_t, void*) {
  no_emulator("memset_async");
}

}  // namespace tandem::cuda_backend::emulator
