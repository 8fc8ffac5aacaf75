// The MPI backend in a build without MPI (Meson compiles this file instead of
// mpi_backend.cpp; STYLE: a stub per missing dependency).
#include "tandem/comm/mpi/mpi_backend.h"

#include "tandem/runtime/error.h"

namespace tandem {

ProcessGroupPtr mpi_world(ProcessGroupOptions /*options*/) {
  TANDEM_FAIL(
      "[comm::mpi] expected a build with MPI, got a build without it (built without MPI; "
      "install an MPI implementation and reconfigure with -Dmpi=enabled)");
}

void mpi_finalize() {}

bool mpi_built() {
  return false;
}

WorkPtr mpi_check_entry(ProcessGroup& group, const LedgerEntry& /*entry*/) {
  TANDEM_FAIL(
      "[comm::mpi_check_entry] expected a build with MPI, got a build without it (built "
      "without MPI; {})",
      group.where());
}

}  // namespace tandem
