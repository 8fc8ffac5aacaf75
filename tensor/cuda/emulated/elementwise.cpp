// The emulated compilation of tensor/cuda/elementwise.cu (Note [Two kernel compilations]).
#define TANDEM_EMULATED_KERNELS 1
#include "tandem/tensor/cuda/elementwise.cu"  // NOLINT(bugprone-suspicious-include): the point of this file
