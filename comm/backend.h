// Choosing a communication backend by name (DESIGN §5).
//
//   threads  N ranks as threads of one process; its worlds come from
//            run_ranks() (comm/threads/threads_backend.h), not from here.
//   mpi      the processes of `mpirun -n N`, CPU tensors (comm/mpi/).
//   nccl     the processes of `mpirun -n N`, one GPU each, bootstrapped over
//            MPI (comm/nccl/).
// A backend whose dependency was missing at build time is a stub whose
// factory says so; backend_available() tells without trying.
#pragma once

#include <string>

#include "tandem/comm/process_group.h"

namespace tandem {

// The world group of this process for "mpi" or "nccl". Collective: every
// process calls it.
ProcessGroupPtr create_world(const std::string& backend, ProcessGroupOptions options = {});

// TANDEM_BACKEND, default "threads".
std::string backend_from_env();

// True when `name` is compiled in and usable here: "threads" always, "mpi"
// when built with MPI, "nccl" when built with NCCL (and MPI) and a CUDA
// device is present.
bool backend_available(const std::string& name);

// Ends the process's use of MPI (mpi_finalize()) for the mpi and nccl
// backends; a no-op for threads.
void finalize_backend(const std::string& backend);

}  // namespace tandem
