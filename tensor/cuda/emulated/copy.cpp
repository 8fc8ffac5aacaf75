// The emulated compilation of tensor/cuda/copy.cu (Note [Two kernel compilations]).
#define TANDEM_EMULATED_KERNELS 1
#include "tandem/tensor/cuda/copy.cu"  // NOLINT(bugprone-suspicious-include): the point of this file
