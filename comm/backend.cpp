// Backend selection (backend.h).
#include "tandem/comm/backend.h"

#include <cstdlib>

#include "tandem/comm/mpi/mpi_backend.h"
#include "tandem/comm/nccl/nccl_backend.h"
#include "tandem/runtime/device.h"
#include "tandem/runtime/error.h"

namespace tandem {

ProcessGroupPtr create_world(const std::string& backend, ProcessGroupOptions options) {
  if (backend == "mpi") return mpi_world(std::move(options));
  if (backend == "nccl") return nccl_world(std::move(options));
  TANDEM_CHECK(backend != "threads",
               "[comm::create_world] expected \"mpi\" or \"nccl\", got \"threads\" (a threads "
               "world is a set of threads: start it with run_ranks())");
  TANDEM_FAIL("[comm::create_world] expected a backend among threads, mpi, nccl, got \"{}\"",
              backend);
}

std::string backend_from_env() {
  const char* value = std::getenv("TANDEM_BACKEND");
  std::string name = value != nullptr && *value != '\0' ? value : "threads";
  TANDEM_CHECK(name == "threads" || name == "mpi" || name == "nccl",
               "[comm::backend_from_env] expected TANDEM_BACKEND among threads, mpi, nccl, got "
               "\"{}\"",
               name);
  return name;
}

bool backend_available(const std::string& name) {
  if (name == "threads") return true;
  if (name == "mpi") return mpi_built();
  // NCCL needs real GPUs: an emulated device (Note [CUDA backends]) does not count.
  if (name == "nccl") return nccl_built() && cuda_device_count() > 0 && !cuda_emulated();
  return false;
}

void finalize_backend(const std::string& backend) {
  if (backend == "mpi" || backend == "nccl") mpi_finalize();
}

}  // namespace tandem
