// TANDEM_MPI_CHECK and the dtype -> MPI datatype mapping of the MPI backend.
// Included only by files compiled with MPI (the stub needs neither).
//
// Every communicator the backend creates has MPI_ERRORS_RETURN, so a failing
// call returns here instead of aborting the job, and the message names it.
#pragma once

#include <mpi.h>

#include <string>

#include "tandem/comm/types.h"
#include "tandem/runtime/error.h"
#include "tandem/tensor/dtype.h"

namespace tandem::mpi {

// "MPI_ERR_TRUNCATE: message truncated" for an MPI error code.
std::string error_string(int code);

// The datatype that moves elements of `dtype` bit-exactly (bf16/f16 move as
// 16-bit integers; they are never reduced in that form).
MPI_Datatype move_type(DType dtype);

// How a reduction of `dtype` runs in MPI. bf16 and f16 have no MPI type: they
// are widened to f32, reduced there and rounded once at the end (`via_f32`),
// which is also more accurate than rounding after every partial sum. Bool
// follows the CPU kernels (tensor/cpu/elementwise.cpp: add is logical or).
struct Reduction {
  MPI_Datatype type;
  MPI_Op op;
  bool via_f32;
};
Reduction reduction_for(DType dtype, RedOp op);

// `n` as the int count MPI takes, or a clear error past INT_MAX.
int count_of(int64_t n, const char* what);

}  // namespace tandem::mpi

#define TANDEM_MPI_CHECK(expr)                                                \
  do {                                                                        \
    int tandem_mpi_rc_ = (expr);                                              \
    TANDEM_CHECK(tandem_mpi_rc_ == MPI_SUCCESS, "[mpi] {} failed: {}", #expr, \
                 ::tandem::mpi::error_string(tandem_mpi_rc_));                \
  } while (0)
