// The emulated compilation of tensor/cuda/attention.cu (Note [Two kernel compilations]).
#define TANDEM_EMULATED_KERNELS 1
#include "tandem/tensor/cuda/attention.cu"  // NOLINT(bugprone-suspicious-include): the point of this file
