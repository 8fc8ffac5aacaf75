// Helpers shared by the CUDA kernels of tensor/cuda/ (one .cu per op family,
// all declared from TANDEM_KERNELS in tensor/kernels.h).
//
// - StreamDeviceGuard: launches go to the device that owns the given stream,
//   whatever the calling thread's current CUDA device is (ranks as threads may
//   each drive their own GPU; a kernel launched on another device's stream
//   fails).
// - Launch shape: grid-stride loops over int64 indices with a capped grid.
// - Element conversions mirroring the CPU backend: 16-bit floats compute in
//   float (acc_t), bool computes as int, stores round through the BFloat16/Half
//   constructors of tensor/half.h so both backends round identically.
// - OffsetCalc: the strided-index decomposition for up to N tensors sharing one
//   shape, with adjacent dimensions coalesced on the host.
// - launch: the one way a kernel is launched (Note [Two kernel compilations]).
//
// Note [Two kernel compilations]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Every .cu file here is compiled twice from the same source:
// - native: nvcc compiles the .cu files as they are (when CUDA is found),
//   into namespace tandem::cuda_kernels::native, for a real GPU;
// - emulated: the host compiler compiles tensor/cuda/emulated/*.cpp, each
//   of which defines TANDEM_EMULATED_KERNELS and includes one .cu file, into
//   namespace tandem::cuda_kernels::emulated, against runtime/cuda/emulator/kernel_api.h
//   instead of <cuda_runtime.h> (Note [Emulated CUDA device]). It needs no CUDA
//   header, so it builds where nvcc is absent (-Dgpu_emulator, on by default
//   on x86-64).
// tensor/cuda/backend.cpp defines the tandem::cuda kernels of tensor/kernels.h
// and forwards each call to the set of the live backend (Note [CUDA backends]).
// So that one source serves both, a kernel file never writes `<<<...>>>` or
// `__shared__`: it launches through detail::launch and declares shared memory
// with TANDEM_SHARED(type, name, count) / TANDEM_DYNAMIC_SHARED(type, name)
// (`name` is an array under nvcc and a pointer in the emulation); an unroll
// hint is TANDEM_UNROLL. cuBLAS is the exception: gemm.cu is native only,
// tensor/cuda/emulated/gemm.cpp runs the same GEMM contract on OpenBLAS.
#pragma once

// fmt 9 turns its constexpr support off under nvcc, which leaves its C++20
// consteval format-string checks (the TANDEM_CHECK messages reached through
// runtime/error.h) calling non-constexpr functions: a hard error. Turning it
// back on is what g++ alone does. Must precede the first fmt include: every .cu
// includes this header first.
#ifndef FMT_USE_CONSTEXPR
#define FMT_USE_CONSTEXPR 1
#endif

#ifdef TANDEM_EMULATED_KERNELS
#include "tandem/runtime/cuda/emulator/kernel_api.h"
#define TANDEM_KERNEL_SET cuda_kernels::emulated
#define TANDEM_UNROLL  // nvcc's hint; g++ before 13 cannot be told to ignore `#pragma unroll`
#else
#include <cuda_runtime.h>
#define TANDEM_KERNEL_SET cuda_kernels::native
#define TANDEM_UNROLL _Pragma("unroll")
#define TANDEM_SHARED(type, name, count) __shared__ type name[count]
#define TANDEM_DYNAMIC_SHARED(type, name)                                 \
  extern __shared__ __align__(16) unsigned char tandem_dynamic_shared_[]; \
  type* name = reinterpret_cast<type*>(tandem_dynamic_shared_)
#endif

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "tandem/runtime/cuda/cuda_check.h"
#include "tandem/tensor/cuda/kernel_sets.h"
#include "tandem/tensor/dtype.h"
#include "tandem/tensor/half.h"
#include "tandem/tensor/kernels.h"

namespace tandem::TANDEM_KERNEL_SET::detail {

constexpr int kThreads = 256;

inline cudaStream_t native(void* stream) {
  return static_cast<cudaStream_t>(stream);
}

// kernel<<<grid, block, shared_bytes, stream>>>(args...) in both compilations
// (Note [Two kernel compilations]); a launch error throws, naming the call.
#ifdef TANDEM_EMULATED_KERNELS
template <class... P, class... A>
void launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t shared_bytes, void* stream,
            A&&... args) {
  emu::launch(kernel, grid, block, shared_bytes, stream, std::forward<A>(args)...);
}
#else
template <class... P, class... A>
void launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t shared_bytes, void* stream,
            A&&... args) {
  kernel<<<grid, block, shared_bytes, native(stream)>>>(std::forward<A>(args)...);
  TANDEM_CUDA_CHECK(cudaGetLastError());
}
#endif

// Grid size for a grid-stride loop over n items. Capping keeps the block count
// within gridDim.x limits for any n; 2^16 blocks of 256 threads are ~60 full
// waves on an H200 (132 SMs x 8 such blocks), so the cap never starves it.
inline unsigned blocks_for(int64_t n, int threads = kThreads) {
  int64_t blocks = (n + threads - 1) / threads;
  return static_cast<unsigned>(std::clamp<int64_t>(blocks, 1, int64_t{1} << 16));
}

__device__ __forceinline__ int64_t grid_start() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t grid_step() {
  return static_cast<int64_t>(gridDim.x) * blockDim.x;
}

// Makes the stream's device current for the lifetime of the guard.
class StreamDeviceGuard {
 public:
  explicit StreamDeviceGuard(void* stream) {
    TANDEM_CUDA_CHECK(cudaStreamGetDevice(native(stream), &device_));
    TANDEM_CUDA_CHECK(cudaGetDevice(&previous_));
    if (device_ != previous_) TANDEM_CUDA_CHECK(cudaSetDevice(device_));
  }
  ~StreamDeviceGuard() {
    if (device_ != previous_) (void)cudaSetDevice(previous_);  // destructors never throw
  }
  StreamDeviceGuard(const StreamDeviceGuard&) = delete;
  StreamDeviceGuard& operator=(const StreamDeviceGuard&) = delete;
  int device() const { return device_; }

 private:
  int device_ = 0;
  int previous_ = 0;
};

template <class T>
inline constexpr bool is_half_v = std::is_same_v<T, BFloat16> || std::is_same_v<T, Half>;

// The type arithmetic on T is done in: acc_t<T>, and int for bool.
template <class T>
using compute_t = std::conditional_t<std::is_same_v<T, bool>, int32_t, acc_t<T>>;

// Accumulator of sums and scans: the float acc type, int64 for every integer.
template <class T>
using sum_t = std::conditional_t<std::is_floating_point_v<compute_t<T>>, compute_t<T>, int64_t>;

template <class V, class T>
__device__ __forceinline__ V load_as(T x) {
  if constexpr (std::is_same_v<T, bool>) {
    return static_cast<V>(x ? 1 : 0);
  } else if constexpr (is_half_v<T>) {
    return static_cast<V>(static_cast<float>(x));
  } else {
    return static_cast<V>(x);
  }
}

template <class To, class V>
__device__ __forceinline__ To cast_to(V v) {
  if constexpr (std::is_same_v<To, bool>) {
    return v != V(0);
  } else if constexpr (is_half_v<To>) {
    return To(static_cast<float>(v));  // double -> float -> 16-bit, as on the CPU
  } else {
    return static_cast<To>(v);
  }
}

// Stores v into element i of a buffer whose dtype is known only at run time
// (reduction outputs: the input's dtype, or i64 for the arg ops). The switch is
// uniform across the grid, so it costs no divergence.
template <class V>
__device__ __forceinline__ void store_dyn(void* base, DType dtype, int64_t i, V v) {
  switch (dtype) {
    case DType::F32:
      static_cast<float*>(base)[i] = cast_to<float>(v);
      break;
    case DType::F64:
      static_cast<double*>(base)[i] = cast_to<double>(v);
      break;
    case DType::BF16:
      static_cast<BFloat16*>(base)[i] = cast_to<BFloat16>(v);
      break;
    case DType::F16:
      static_cast<Half*>(base)[i] = cast_to<Half>(v);
      break;
    case DType::I32:
      static_cast<int32_t*>(base)[i] = cast_to<int32_t>(v);
      break;
    case DType::I64:
      static_cast<int64_t*>(base)[i] = cast_to<int64_t>(v);
      break;
    case DType::Bool:
      static_cast<bool*>(base)[i] = cast_to<bool>(v);
      break;
  }
}

// float/double overloads of the math the kernels use (integers go through double).
template <class V>
__device__ __forceinline__ bool is_nan(V x) {
  if constexpr (std::is_floating_point_v<V>) {
    return x != x;
  } else {
    return false;
  }
}
__device__ __forceinline__ float d_exp(float x) {
  return expf(x);
}
__device__ __forceinline__ double d_exp(double x) {
  return exp(x);
}
__device__ __forceinline__ float d_log(float x) {
  return logf(x);
}
__device__ __forceinline__ double d_log(double x) {
  return log(x);
}
__device__ __forceinline__ float d_sqrt(float x) {
  return sqrtf(x);
}
__device__ __forceinline__ double d_sqrt(double x) {
  return sqrt(x);
}
__device__ __forceinline__ float d_tanh(float x) {
  return tanhf(x);
}
__device__ __forceinline__ double d_tanh(double x) {
  return tanh(x);
}
__device__ __forceinline__ float d_erf(float x) {
  return erff(x);
}
__device__ __forceinline__ double d_erf(double x) {
  return erf(x);
}
__device__ __forceinline__ float d_pow(float x, float y) {
  return powf(x, y);
}
__device__ __forceinline__ double d_pow(double x, double y) {
  return pow(x, y);
}

// Up to kMaxDims coordinates shared by N tensors of one shape; offsets[k] is
// the element offset of linear index i in tensor k.
template <int N>
struct OffsetCalc {
  int ndim = 0;
  int64_t shape[kMaxDims] = {};
  int64_t strides[N][kMaxDims] = {};

  __device__ __forceinline__ void get(int64_t i, int64_t (&offsets)[N]) const {
    TANDEM_UNROLL
    for (int k = 0; k < N; ++k)
      offsets[k] = 0;
    for (int d = ndim - 1; d >= 0; --d) {
      int64_t extent = shape[d];
      int64_t c = i % extent;
      i /= extent;
      TANDEM_UNROLL
      for (int k = 0; k < N; ++k)
        offsets[k] += c * strides[k][d];
    }
  }
};

// Builds the calculator for tensors that all have args[0]'s shape. Size-1 dims
// are dropped and a dim is merged into its inner neighbour when every tensor
// steps over both as one, so e.g. a transposed matrix keeps 2 dims and a
// broadcast row 2 dims whatever the rank: fewer divisions per element.
template <int N>
OffsetCalc<N> make_offset_calc(const TensorArg* const (&args)[N]) {
  OffsetCalc<N> calc;
  const TensorArg& ref = *args[0];
  for (int d = 0; d < ref.ndim; ++d) {
    if (ref.shape[d] == 1) continue;
    int last = calc.ndim - 1;
    bool merge = last >= 0;
    for (int k = 0; k < N && merge; ++k) {
      merge = calc.strides[k][last] == args[k]->strides[d] * ref.shape[d];
    }
    if (merge) {
      calc.shape[last] *= ref.shape[d];
      for (int k = 0; k < N; ++k)
        calc.strides[k][last] = args[k]->strides[d];
    } else {
      calc.shape[calc.ndim] = ref.shape[d];
      for (int k = 0; k < N; ++k)
        calc.strides[k][calc.ndim] = args[k]->strides[d];
      ++calc.ndim;
    }
  }
  return calc;
}

// Calls fn(TypeTag<U>{}) with an unsigned integer type of the element size:
// kernels that only move elements (where, same-dtype copy, indexing) are
// instantiated once per width instead of once per dtype.
template <class F>
decltype(auto) dispatch_width(DType dtype, F&& fn) {
  switch (dtype_size(dtype)) {
    case 1:
      return fn(TypeTag<uint8_t>{});
    case 2:
      return fn(TypeTag<uint16_t>{});
    case 4:
      return fn(TypeTag<uint32_t>{});
    default:
      return fn(TypeTag<uint64_t>{});
  }
}

// Index tensors: i64 per the kernel contract; i32 is accepted as well so a
// front end may pass either without a conversion pass.
template <class F>
decltype(auto) dispatch_index(DType dtype, const char* op, F&& fn) {
  if (dtype == DType::I64) return fn(TypeTag<int64_t>{});
  TANDEM_CHECK(dtype == DType::I32, "[cuda::{}] expected an i64 or i32 index, got {}", op,
               dtype_name(dtype));
  return fn(TypeTag<int32_t>{});
}

// Note [Cascade summation] (tensor/cpu/cascade.h) on the GPU: a thread adds
// its terms into level 0; every kFan terms level 0 is added into level 1 and
// cleared, every kFan of those level 1 into level 2, and every kFan of those
// level 2 into level 3. A term passes through at most kFan additions per
// level, so a thread's error grows like 3 * kFan + n / kFan^3 rather than n
// (level 3 takes one term per 32768 of the thread's). Threads' sums are then
// combined by block_reduce's tree. Exact (and merely a little slower) for
// integer S.
template <class S>
struct CascadeSum {
  static constexpr int kFan = 32;
  S level0 = S(0), level1 = S(0), level2 = S(0), level3 = S(0);
  int count0 = 0, count1 = 0, count2 = 0;

  __device__ __forceinline__ void add(S x) {
    level0 += x;
    if (++count0 < kFan) return;
    level1 += level0;
    level0 = S(0);
    count0 = 0;
    if (++count1 < kFan) return;
    level2 += level1;
    level1 = S(0);
    count1 = 0;
    if (++count2 < kFan) return;
    level3 += level2;
    level2 = S(0);
    count2 = 0;
  }
  // The sum so far, small levels first.
  __device__ __forceinline__ S total() const { return level3 + (level2 + (level1 + level0)); }
};

// Shared-memory tree reduction of one value per thread of a block (blockDim.x
// a power of two, at most kMaxBlock). `combine` must be associative; the
// result is valid in every thread.
constexpr int kMaxBlock = 1024;

template <class S, class Combine>
__device__ S block_reduce(S value, S* shared, Combine combine) {
  int tid = threadIdx.x;
  shared[tid] = value;
  __syncthreads();
  for (int width = blockDim.x / 2; width > 0; width /= 2) {
    if (tid < width) shared[tid] = combine(shared[tid], shared[tid + width]);
    __syncthreads();
  }
  S result = shared[0];
  __syncthreads();  // shared may be reused by the caller's next reduction
  return result;
}

// Threads per block for a per-row kernel: a power of two covering `n` items,
// between one warp and `cap`.
inline int row_threads(int64_t n, int cap = kThreads) {
  int threads = 32;
  while (threads < cap && threads < n)
    threads *= 2;
  return threads;
}

}  // namespace tandem::TANDEM_KERNEL_SET::detail
