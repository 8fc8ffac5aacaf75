// The run-time choice between the native and the emulated CUDA backend
// (Note [CUDA backends]); every call forwards to the chosen one.
#include "tandem/runtime/cuda/cuda_api.h"

#include <cstdlib>
#include <string>

#include "tandem/runtime/cuda/backends.h"
#include "tandem/runtime/error.h"

namespace tandem::cuda_api {
namespace {

constexpr int kMaxEmulatedDevices = 8;

struct Selection {
  bool emulated = false;
  int count = 0;
};

int parse_emulated_count(const std::string& value) {
  if (value == "emulated") return 1;
  std::string digits = value.substr(9);  // after "emulated:"
  int count = 0;
  try {
    size_t used = 0;
    count = std::stoi(digits, &used);
    if (used != digits.size()) count = 0;
  } catch (const std::logic_error&) {
  }
  TANDEM_CHECK(count >= 1 && count <= kMaxEmulatedDevices,
               "[cuda] expected TANDEM_CUDA=emulated:N with N in [1, {}], got \"{}\"",
               kMaxEmulatedDevices, value);
  return count;
}

Selection select() {
  const char* env = std::getenv("TANDEM_CUDA");
  const std::string value = env != nullptr && *env != '\0' ? env : "auto";
  if (value == "off") return {};
  const bool wants_emulator = value == "emulated" || value.rfind("emulated:", 0) == 0;
  TANDEM_CHECK(value == "auto" || wants_emulator,
               "[cuda] expected TANDEM_CUDA to be auto, off, emulated or emulated:N, got \"{}\"",
               value);
  const int emulated_count = wants_emulator ? parse_emulated_count(value) : 0;
  const int native = cuda_backend::native::device_count();
  if (native > 0 || !wants_emulator) return {false, native};  // a real GPU always wins
  TANDEM_CHECK(cuda_backend::emulator::compiled(),
               "[cuda] expected a build with the emulated device for TANDEM_CUDA={}, got one "
               "configured with -Dgpu_emulator=disabled",
               value);
  cuda_backend::emulator::set_device_count(emulated_count);
  return {true, emulated_count};
}

const Selection& selection() {
  static const Selection chosen = select();
  return chosen;
}

}  // namespace

bool compiled() {
  return cuda_backend::native::compiled() || cuda_backend::emulator::compiled();
}
bool emulated() {
  return selection().emulated;
}
int device_count() {
  return selection().count;
}

// The rest forward; with no device at all they reach the native backend,
// whose stub or cudart reports the error.
#define TANDEM_CUDA_FORWARD(call) \
  (emulated() ? cuda_backend::emulator::call : cuda_backend::native::call)

void set_device(int device) {
  TANDEM_CUDA_FORWARD(set_device(device));
}
int current_device() {
  return TANDEM_CUDA_FORWARD(current_device());
}
void* malloc(size_t nbytes, int device) {
  return TANDEM_CUDA_FORWARD(malloc(nbytes, device));
}
void free(void* ptr, int device) {
  TANDEM_CUDA_FORWARD(free(ptr, device));
}
size_t free_memory(int device) {
  return TANDEM_CUDA_FORWARD(free_memory(device));
}
void* stream_create(int device) {
  return TANDEM_CUDA_FORWARD(stream_create(device));
}
void stream_destroy(void* stream) {
  TANDEM_CUDA_FORWARD(stream_destroy(stream));
}
void stream_synchronize(void* stream) {
  TANDEM_CUDA_FORWARD(stream_synchronize(stream));
}
bool stream_query(void* stream) {
  return TANDEM_CUDA_FORWARD(stream_query(stream));
}
void* event_create(int device) {
  return TANDEM_CUDA_FORWARD(event_create(device));
}
void event_destroy(void* event) {
  TANDEM_CUDA_FORWARD(event_destroy(event));
}
void event_record(void* event, void* stream) {
  TANDEM_CUDA_FORWARD(event_record(event, stream));
}
void stream_wait_event(void* stream, void* event) {
  TANDEM_CUDA_FORWARD(stream_wait_event(stream, event));
}
void event_synchronize(void* event) {
  TANDEM_CUDA_FORWARD(event_synchronize(event));
}
bool event_query(void* event) {
  return TANDEM_CUDA_FORWARD(event_query(event));
}
float event_elapsed_ms(void* start, void* end) {
  return TANDEM_CUDA_FORWARD(event_elapsed_ms(start, end));
}
void memcpy_async(void* dst, const void* src, size_t nbytes, CopyKind kind, void* stream) {
  TANDEM_CUDA_FORWARD(memcpy_async(dst, src, nbytes, kind, stream));
}
void memset_async(void* dst, int value, size_t nbytes, void* stream) {
  TANDEM_CUDA_FORWARD(memset_async(dst, value, nbytes, stream));
}

#undef TANDEM_CUDA_FORWARD

}  // namespace tandem::cuda_api
