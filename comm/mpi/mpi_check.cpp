// MPI error strings and the dtype -> MPI datatype mapping (mpi_check.h).
#include "tandem/comm/mpi/mpi_check.h"

#include <climits>

namespace tandem::mpi {

std::string error_string(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS)
    return fmt::format("MPI error {}", code);
  return fmt::format("{} (MPI error {})", std::string(text, static_cast<size_t>(length)), code);
}

MPI_Datatype move_type(DType dtype) {
  switch (dtype) {
    case DType::F32:
      return MPI_FLOAT;
    case DType::F64:
      return MPI_DOUBLE;
    case DType::BF16:
    case DType::F16:
      return MPI_UINT16_T;
    case DType::I32:
      return MPI_INT32_T;
    case DType::I64:
      return MPI_INT64_T;
    case DType::Bool:
      return MPI_C_BOOL;
  }
  TANDEM_FAIL("[comm::mpi] expected a valid dtype, got {}", static_cast<int>(dtype));
}

Reduction reduction_for(DType dtype, RedOp op) {
  if (dtype == DType::Bool) {
    // Sum and Avg start from the logical or, as cpu::binary(Add) on bool does.
    return {MPI_C_BOOL, op == RedOp::Min ? MPI_LAND : MPI_LOR, false};
  }
  MPI_Op mpi_op = op == RedOp::Max ? MPI_MAX : op == RedOp::Min ? MPI_MIN : MPI_SUM;
  bool via_f32 = dtype == DType::BF16 || dtype == DType::F16;
  return {via_f32 ? MPI_FLOAT : move_type(dtype), mpi_op, via_f32};
}

int count_of(int64_t n, const char* what) {
  TANDEM_CHECK(n >= 0 && n <= INT_MAX,
               "[comm::mpi] expected at most {} elements per MPI call ({}), got {}", INT_MAX, what,
               n);
  return static_cast<int>(n);
}

}  // namespace tandem::mpi
