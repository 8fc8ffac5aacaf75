#include "tandem/runtime/device.h"

#include "tandem/runtime/cuda/cuda_api.h"
#include "tandem/runtime/error.h"

namespace tandem {

Device Device::cuda(int index) {
  int count = cuda_device_count();
  TANDEM_CHECK(index >= 0 && index < count,
               "[runtime::Device] expected a CUDA device index in [0, {}), got {}{}", count, index,
               built_with_cuda() ? (count == 0 ? " (no GPU or driver on this machine; "
                                                 "TANDEM_CUDA=emulated runs an emulated one)"
                                               : "")
                                 : " (built without CUDA)");
  return Device(DeviceType::Cuda, index);
}

Device Device::parse(const std::string& text) {
  if (text == "cpu") return cpu();
  if (text == "cuda") return cuda(0);
  if (text.rfind("cuda:", 0) == 0) {
    try {
      size_t used = 0;
      int index = std::stoi(text.substr(5), &used);
      if (used == text.size() - 5) return cuda(index);
    } catch (const std::logic_error&) {
    }
  }
  TANDEM_FAIL("[runtime::Device] expected \"cpu\", \"cuda\" or \"cuda:N\", got \"{}\"", text);
}

std::string Device::str() const {
  return is_cpu() ? std::string("cpu") : fmt::format("cuda:{}", index_);
}

int cuda_device_count() {
  static const int count = cuda_api::device_count();
  return count;
}

bool cuda_available() {
  return cuda_device_count() > 0;
}
bool built_with_cuda() {
  return cuda_api::compiled();
}
bool cuda_emulated() {
  return cuda_api::emulated();
}

Device default_device() {
  return cuda_available() ? Device::cuda(0) : Device::cpu();
}

namespace {
thread_local Device thread_device = Device::cpu();
}

Device current_device() {
  return thread_device;
}

void set_current_device(Device device) {
  if (device.is_cuda()) cuda_api::set_device(device.index());
  thread_device = device;
}

}  // namespace tandem
