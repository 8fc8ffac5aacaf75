// The emulated compilation of tensor/cuda/reduce.cu (Note [Two kernel compilations]).
#define TANDEM_EMULATED_KERNELS 1
#include "tandem/tensor/cuda/reduce.cu"  // NOLINT(bugprone-suspicious-include): the point of this file
