// The emulated kernel set's stub, for builds with -Dgpu_emulator=disabled
// (Note [Two kernel compilations]).
#define TANDEM_KERNEL_SET cuda_kernels::emulated
#include "tandem/tensor/cuda/kernels_stub.cpp"  // NOLINT(bugprone-suspicious-include): the point of this file
