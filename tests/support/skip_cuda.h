// TANDEM_SKIP_WITHOUT_CUDA(): returns from a Catch2 test case, reported as
// skipped, where no CUDA device exists (neither a GPU nor the emulated device,
// TANDEM_CUDA=emulated). The line on stdout reaches the JUnit report, where the
// CI summary counts skips.
#pragma once

#include <catch2/catch.hpp>

#include <iostream>

#include "tandem/runtime/device.h"

#define TANDEM_SKIP_WITHOUT_CUDA()                      \
  do {                                                  \
    if (!::tandem::cuda_available()) {                  \
      WARN("SKIP: no CUDA device");                     \
      std::cout << "SKIP: no CUDA device" << std::endl; \
      return;                                           \
    }                                                   \
  } while (0)
