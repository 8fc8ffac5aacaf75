// The NCCL backend: one GPU per process of `mpirun -n N`, CUDA tensors
// (DESIGN §5). Built when Meson finds CUDA, NCCL and MPI; otherwise
// nccl_stub.cpp provides the same functions, which say so.
//
// Bootstrap over MPI: an MPI group over the same ranks is the control plane
// (rank 0 creates the ncclUniqueId and broadcasts it, the ranks of a host
// pick their GPUs, checked mode exchanges fingerprints, splits are agreed
// on). Each group has its own comm stream; a collective's stream waits on
// the caller's stream (Collective::ready) and the caller's stream waits on
// the collective's end event in Work::wait(), so neither host blocks
// (Note [Stream ordering]). Note [NCCL issue thread] in nccl_backend.cpp says
// who enqueues and why; Work::synchronize() is bounded by the group's timeout
// and aborts the communicator (ncclCommAbort) with a watchdog report when it
// expires.
//
// Point-to-point: NCCL matches sends and receives by order per peer, not by
// tag, and cannot check the received size; tag_id is recorded in the ledger
// only.
#pragma once

#include "tandem/comm/process_group.h"

namespace tandem {

// The world group over all processes of MPI_COMM_WORLD, on GPU
// (local rank mod device count), where the local rank counts the lower world
// ranks on the same host. Collective; initialises MPI when needed.
ProcessGroupPtr nccl_world(ProcessGroupOptions options = {});

// True when this binary was built with NCCL.
bool nccl_built();

}  // namespace tandem
