// Device: where a tensor lives and where its ops run (DESIGN §2).
//
// GPU presence is detected at run time: a binary built with CUDA starts and runs
// its CPU paths on a machine without a driver (Note [CUDA stubs]).
#pragma once

#include <fmt/format.h>

#include <cstdint>
#include <string>

namespace tandem {

enum class DeviceType : uint8_t { Cpu, Cuda };

class Device {
 public:
  constexpr Device() = default;
  static constexpr Device cpu() { return Device(DeviceType::Cpu, 0); }
  // Checks that the index names an existing GPU.
  static Device cuda(int index = 0);
  // "cpu", "cuda", "cuda:1".
  static Device parse(const std::string& text);

  constexpr DeviceType type() const { return type_; }
  constexpr int index() const { return index_; }
  constexpr bool is_cpu() const { return type_ == DeviceType::Cpu; }
  constexpr bool is_cuda() const { return type_ == DeviceType::Cuda; }
  std::string str() const;

  friend constexpr bool operator==(Device a, Device b) {
    return a.type_ == b.type_ && a.index_ == b.index_;
  }

 private:
  constexpr Device(DeviceType type, int index) : type_(type), index_(index) {}
  DeviceType type_ = DeviceType::Cpu;
  int index_ = 0;
};

// Number of usable GPUs; 0 without a driver, without a GPU, or built without CUDA.
int cuda_device_count();
bool cuda_available();
// True when this binary was compiled with the CUDA kernels: nvcc's, or the
// emulated device's (Note [CUDA backends] in runtime/cuda/cuda_api.h).
bool built_with_cuda();
// True when the CUDA devices of this process are emulated (TANDEM_CUDA=emulated
// on a machine without a GPU).
bool cuda_emulated();

// The best device of this machine: cuda:0 when a GPU is present, else cpu.
Device default_device();

// The calling thread's current device (cpu until set). Setting a CUDA device
// also makes it the CUDA runtime's current device for this thread.
Device current_device();
void set_current_device(Device device);

// RAII: sets the current device, restores the previous one on exit.
class DeviceGuard {
 public:
  explicit DeviceGuard(Device device) : previous_(current_device()) { set_current_device(device); }
  ~DeviceGuard() { set_current_device(previous_); }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  Device previous_;
};

}  // namespace tandem

template <>
struct fmt::formatter<tandem::Device> : fmt::formatter<std::string> {
  auto format(tandem::Device d, format_context& ctx) const {
    return fmt::formatter<std::string>::format(d.str(), ctx);
  }
};
