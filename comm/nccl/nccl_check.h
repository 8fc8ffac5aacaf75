// TANDEM_NCCL_CHECK and bounded completion of nonblocking NCCL calls.
// Included only by files compiled with NCCL (Note [CUDA stubs]).
//
// Note [Bounded NCCL calls]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// The backend's communicators are created nonblocking (ncclConfig_t::blocking
// = 0), so no NCCL call can hang the thread that makes it: a call may return
// ncclInProgress, and the communicator's state is then polled with
// ncclCommGetAsyncError until it settles, up to a deadline. NCCL requires
// that poll to finish before the next call on that communicator; every call
// of the backend goes through TANDEM_NCCL_SETTLE, on the one NCCL thread of
// the process (Note [NCCL engine] in nccl_engine.h).
#pragma once

#include <nccl.h>

#include <chrono>

#include "tandem/runtime/error.h"

namespace tandem::nccl {

// Waits (bounded) until `comm` leaves ncclInProgress after a call that
// returned `rc`; throws naming `call` on an error, TimeoutError at `deadline`.
void settle(ncclComm_t comm, ncclResult_t rc, const char* call,
            std::chrono::steady_clock::time_point deadline);

}  // namespace tandem::nccl

// A call that must succeed at once (no communicator involved).
#define TANDEM_NCCL_CHECK(expr)                                                          \
  do {                                                                                   \
    ncclResult_t tandem_nccl_rc_ = (expr);                                               \
    TANDEM_CHECK(tandem_nccl_rc_ == ncclSuccess, "[nccl] {} failed: {} ({}): {}", #expr, \
                 ncclGetErrorString(tandem_nccl_rc_), static_cast<int>(tandem_nccl_rc_), \
                 ncclGetLastError(nullptr));                                             \
  } while (0)

// A call on the nonblocking communicator `comm`, settled by `deadline`.
#define TANDEM_NCCL_SETTLE(comm, expr, deadline) \
  ::tandem::nccl::settle((comm), (expr), #expr, (deadline))
