// Compiled instead of cuda_native.cpp when CUDA is not found (Note [CUDA stubs]).
#include "tandem/runtime/cuda/backends.h"
#include "tandem/runtime/error.h"

namespace tandem::cuda_backend::native {
namespace {
[[noreturn]] void no_cuda(const char* what) {
  TANDEM_FAIL("[cuda::{}] expected a CUDA build, got a build without CUDA", what);
}
}  // namespace

bool compiled() {
  return false;
}
int device_count() {
  return 0;
}
void set_device(int) {
  no_cuda("set_device");
}
int current_device() {
  no_cuda("current_device");
}
void* malloc(size_t, int) {
  no_cuda("malloc");
}
void free(void*, int) {
  no_cuda("free");
}
size_t free_memory(int) {
  no_cuda("free_memory");
}
void* stream_create(int) {
  no_cuda("stream_create");
}
void stream_destroy(void*) {}
void stream_synchronize(void*) {
  no_cuda("stream_synchronize");
}
bool stream_query(void*) {
  no_cuda("stream_query");
}
void* event_create(int) {
  no_cuda("event_create");
}
void event_destroy(void*) {}
void event_record(void*, void*) {
  no_cuda("event_record");
}
void stream_wait_event(void*, void*) {
  no_cuda("stream_wait_event");
}
void event_synchronize(void*) {
  no_cuda("event_synchronize");
}
bool event_query(void*) {
  no_cuda("event_query");
}
float event_elapsed_ms(void*, void*) {
  no_cuda("event_elapsed_ms");
}
void memcpy_async(void*, const void*, size_t, CopyKind, void*) {
  no_cuda("memcpy_async");
}
void memset_async(void*, int, size_t, void*) {
  no_cuda("memset_async");
}

}  // namespace tandem::cuda_backend::native
