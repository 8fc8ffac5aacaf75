// The NCCL backend in a build without NCCL (or without the CUDA or MPI it
// needs). Meson compiles this file instead of nccl_backend.cpp.
#include "tandem/comm/nccl/nccl_backend.h"

#include "tandem/runtime/error.h"

namespace tandem {

ProcessGroupPtr nccl_world(ProcessGroupOptions /*options*/) {
  TANDEM_FAIL(
      "[comm::nccl] expected a build with NCCL, got a build without it (NCCL needs "
      "CUDA, NCCL and MPI at configure time)");
}

bool nccl_built() {
  return false;
}

}  // namespace tandem
