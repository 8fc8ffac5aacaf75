// The MPI backend: ranks are the processes of `mpirun -n N`, tensors are on the
// CPU (DESIGN §5). Built when Meson finds MPI; otherwise mpi_stub.cpp provides
// the same functions, which say so.
//
// Every group of a process shares one executor thread, the only thread that
// calls MPI after initialisation (Note [One MPI executor] in mpi_executor.h):
// launches only queue, collectives run as nonblocking MPI calls tested until
// they complete, and every wait is bounded by the group's timeout. A timed-out
// collective fails its Work with a watchdog report (rank, group, seq, op and
// the ledger tail); since MPI cannot cancel a collective, that communicator is
// then unusable and later launches on it fail at once with an error naming
// the timed-out call. Other groups (and the parent of a split) stay usable.
//
// Checked mode (ProcessGroupOptions::checked, Note [Checked launch order]):
// before each collective the ranks all-gather the fingerprint of its ledger
// entry; on a mismatch every rank fails with an error naming the first
// divergent call of both sides, and the communicator stays usable (every rank
// skipped the call). Errors found locally before a collective (uneven
// all_to_all split sizes that disagree between sender and receiver, counts
// past INT_MAX) travel in the same exchange, so the peers fail with an error
// naming that rank instead of waiting for the timeout. Point-to-point calls
// are not collective and are not compared.
//
// split() is collective over the parent (MPI_Comm_split after a bounded
// handshake, in the parent's launch order) and blocks the caller until the
// parent's earlier collectives have completed.
#pragma once

#include "tandem/comm/process_group.h"

namespace tandem {

// A new group over MPI_COMM_WORLD (a duplicate of it, so the backend's traffic
// never matches the program's own MPI calls). Collective: every process calls
// it. Initialises MPI when the program has not (MPI_Init_thread asking for
// MPI_THREAD_MULTIPLE, accepting MPI_THREAD_SERIALIZED); a program that
// initialises MPI itself must ask for at least MPI_THREAD_SERIALIZED.
ProcessGroupPtr mpi_world(ProcessGroupOptions options = {});

// Lets pending collectives finish (bounded), stops the executor and calls
// MPI_Finalize. Call once, at the end; groups that outlive it fail every
// launch with a clear error. A no-op in a build without MPI.
void mpi_finalize();

// True when this binary was built with MPI.
bool mpi_built();

// For backends that use an MPI group as their control plane (NCCL): runs only
// the checked-mode exchange of `entry` on `group` (which must be an MPI group),
// in its launch order. The Work fails when the ranks' entries diverge.
WorkPtr mpi_check_entry(ProcessGroup& group, const LedgerEntry& entry);

}  // namespace tandem
