// The device the parallel and train suites run their ranks on. tests/meson.build
// runs each of those suites twice: on the CPU, and with TANDEM_TEST_DEVICE=cuda
// and TANDEM_CUDA=emulated, where the rank threads share cuda:0 (the emulated
// device in CI, the GPU on a GPU machine) and communicate through the threads
// backend (Note [Threads ranks on one CUDA device]). References are computed
// on the CPU; rank inputs go to test_device() and results come back to the CPU
// to be compared.
#pragma once

#include <cstdlib>
#include <string>

#include "tandem/runtime/device.h"
#include "tandem/runtime/error.h"
#include "tandem/tensor/ops.h"

namespace tandem::test {

// cuda:0 when TANDEM_TEST_DEVICE=cuda (an error when no CUDA device exists, so
// a suite meant for CUDA never quietly runs on the CPU), else the CPU.
inline Device test_device() {
  static const Device device = [] {
    const char* env = std::getenv("TANDEM_TEST_DEVICE");
    const std::string name = env == nullptr ? "cpu" : env;
    TANDEM_CHECK(name == "cpu" || name == "cuda",
                 "[tests] expected TANDEM_TEST_DEVICE cpu or cuda, got '{}'", name);
    if (name == "cpu") return Device::cpu();
    TANDEM_CHECK(cuda_available(),
                 "[tests] TANDEM_TEST_DEVICE=cuda needs a CUDA device (a GPU, or "
                 "TANDEM_CUDA=emulated in a build with the emulator); found none");
    return Device::cuda(0);
  }();
  return device;
}

inline Tensor on_test_device(const Tensor& t) {
  return ops::to(t, test_device());
}

inline Tensor on_cpu(const Tensor& t) {
  return ops::to(t, Device::cpu());
}

}  // namespace tandem::test
