// The emulated compilation of tensor/cuda/sort.cu (Note [Two kernel compilations]).
#define TANDEM_EMULATED_KERNELS 1
#include "tandem/tensor/cuda/sort.cu"  // NOLINT(bugprone-suspicious-include): the point of this file
