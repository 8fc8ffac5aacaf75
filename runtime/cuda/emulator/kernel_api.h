// The CUDA names a kernel source uses, in host C++: what the emulated
// compilation of tensor/cuda/*.cu includes in place of <cuda_runtime.h>.
//
// Note [Emulated CUDA device]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The same kernel sources run on a GPU (nvcc) and, compiled by the host
// compiler against this header, on an emulated device (Note [Two kernel
// compilations] in tensor/cuda/cuda_common.cuh). Here:
// - threadIdx, blockIdx, blockDim, gridDim are per emulated thread (the
//   executor rewrites them at every fiber switch), dim3 is a host struct;
//   __global__, __device__, __host__ are empty, __forceinline__ is inline.
// - Shared memory is declared through TANDEM_SHARED / TANDEM_DYNAMIC_SHARED
//   (both compilations define them): one host allocation per declaration and
//   block, filled with 0xff bytes when each block starts, so a read before
//   the write it should wait for sees garbage, not a lucky zero.
// - __syncthreads and the warp operations (__shfl*_sync, __ballot_sync,
//   __any_sync, __all_sync, __syncwarp) are barriers of the executor, which
//   runs a block's threads on fibers switching only there
//   (runtime/cuda/emulator/executor.h): a missing barrier gives a wrong
//   result, and under ThreadSanitizer a reported race.
// - Atomics are std::atomic_ref operations (blocks run on several host
//   threads, so they must be real atomics).
// - The math intrinsics map to their libm counterparts (full precision where
//   the GPU's are approximate; tests compare with tolerances anyway).
// - The few runtime calls the kernel files make (cudaMemcpyAsync,
//   cudaMallocAsync, cudaStreamGetDevice, ...) forward to the emulated runtime
//   (runtime/cuda/emulator/device.cpp); a failure throws there, so they
//   return cudaSuccess.
// The CUDA names are macros and reserved identifiers on purpose: they are the
// interface the kernel sources are written against.
#pragma once

#include <math.h>  // the global expf, logf, isinf, INFINITY, ... the kernels call

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <tuple>
#include <type_traits>
#include <utility>

#include "tandem/runtime/cuda/emulator/executor.h"

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
  constexpr dim3(tandem::emu::Dim d) : x(d.x), y(d.y), z(d.z) {}  // NOLINT: implicit, as CUDA's
};

#define threadIdx (::tandem::emu::thread_idx())
#define blockIdx (::tandem::emu::block_idx())
#define blockDim (::tandem::emu::block_dim())
#define gridDim (::tandem::emu::grid_dim())
constexpr int warpSize = tandem::emu::kWarpSize;

// Static shared memory: `type name[count]` per block; `name` is a pointer here.
#define TANDEM_SHARED(type, name, count) \
  static char name##_tandem_tag_ = 0;    \
  type* name = static_cast<type*>(       \
      ::tandem::emu::static_shared(&name##_tandem_tag_, sizeof(type) * (count)))
// Dynamic shared memory: the launch's shared_bytes, viewed as `type`.
#define TANDEM_DYNAMIC_SHARED(type, name) \
  type* name = static_cast<type*>(::tandem::emu::dynamic_shared())

inline void __syncthreads() {
  tandem::emu::sync_block();
}
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  (void)tandem::emu::warp_exchange(mask, 0, tandem::emu::lane_id(), nullptr);
}

namespace tandem::emu {
template <class T>
T exchange_as(unsigned mask, T value, int src_lane) {
  static_assert(sizeof(T) <= sizeof(uint64_t) && std::is_trivially_copyable_v<T>,
                "warp shuffles move values of at most 8 bytes");
  uint64_t word = 0;
  std::memcpy(&word, &value, sizeof(T));
  uint64_t got = warp_exchange(mask, word, src_lane, nullptr);
  T out;
  std::memcpy(&out, &got, sizeof(T));
  return out;
}
// The lane a shuffle reads within a segment of `width` lanes; its own when the
// source falls outside the segment.
inline int shuffle_source(int lane, int src, int width) {
  int base = lane & ~(width - 1);
  return src >= base && src < base + width ? src : lane;
}
}  // namespace tandem::emu

template <class T>
T __shfl_sync(unsigned mask, T value, int src_lane, int width = warpSize) {
  int lane = tandem::emu::lane_id();
  int base = lane & ~(width - 1);
  return tandem::emu::exchange_as(mask, value, base + (src_lane & (width - 1)));
}
template <class T>
T __shfl_xor_sync(unsigned mask, T value, int lane_mask, int width = warpSize) {
  int lane = tandem::emu::lane_id();
  return tandem::emu::exchange_as(mask, value,
                                  tandem::emu::shuffle_source(lane, lane ^ lane_mask, width));
}
template <class T>
T __shfl_down_sync(unsigned mask, T value, unsigned delta, int width = warpSize) {
  int lane = tandem::emu::lane_id();
  return tandem::emu::exchange_as(
      mask, value, tandem::emu::shuffle_source(lane, lane + static_cast<int>(delta), width));
}
template <class T>
T __shfl_up_sync(unsigned mask, T value, unsigned delta, int width = warpSize) {
  int lane = tandem::emu::lane_id();
  return tandem::emu::exchange_as(
      mask, value, tandem::emu::shuffle_source(lane, lane - static_cast<int>(delta), width));
}
inline unsigned __ballot_sync(unsigned mask, int predicate) {
  unsigned ballot = 0;
  (void)tandem::emu::warp_exchange(mask, predicate != 0, tandem::emu::lane_id(), &ballot);
  return ballot;
}
inline int __any_sync(unsigned mask, int predicate) {
  return __ballot_sync(mask, predicate) != 0;
}
inline int __all_sync(unsigned mask, int predicate) {
  return __ballot_sync(mask, predicate) == mask;
}

// Atomics: each returns the old value, as CUDA's do.
template <class T>
T atomicAdd(T* address, std::type_identity_t<T> v) {
  return std::atomic_ref<T>(*address).fetch_add(v);
}
template <class T>
T atomicSub(T* address, std::type_identity_t<T> v) {
  return std::atomic_ref<T>(*address).fetch_sub(v);
}
template <class T>
T atomicExch(T* address, std::type_identity_t<T> v) {
  return std::atomic_ref<T>(*address).exchange(v);
}
template <class T>
T atomicCAS(T* address, std::type_identity_t<T> compare, std::type_identity_t<T> v) {
  std::atomic_ref<T>(*address).compare_exchange_strong(compare, v);
  return compare;  // the old value whether or not it was swapped
}
template <class T>
T atomicAnd(T* address, std::type_identity_t<T> v) {
  return std::atomic_ref<T>(*address).fetch_and(v);
}
template <class T>
T atomicOr(T* address, std::type_identity_t<T> v) {
  return std::atomic_ref<T>(*address).fetch_or(v);
}
template <class T>
T atomicXor(T* address, std::type_identity_t<T> v) {
  return std::atomic_ref<T>(*address).fetch_xor(v);
}
template <class T>
T atomicMax(T* address, std::type_identity_t<T> v) {
  std::atomic_ref<T> ref(*address);
  T old = ref.load();
  while (old < v && !ref.compare_exchange_weak(old, v)) {
  }
  return old;
}
template <class T>
T atomicMin(T* address, std::type_identity_t<T> v) {
  std::atomic_ref<T> ref(*address);
  T old = ref.load();
  while (v < old && !ref.compare_exchange_weak(old, v)) {
  }
  return old;
}

// Math intrinsics.
inline float __expf(float x) {
  return expf(x);
}
inline float __logf(float x) {
  return logf(x);
}
inline float __powf(float x, float y) {
  return powf(x, y);
}
inline float __fdividef(float a, float b) {
  return a / b;
}
inline float rsqrtf(float x) {
  return 1.0f / sqrtf(x);
}
inline double rsqrt(double x) {
  return 1.0 / sqrt(x);
}
inline float __fmaf_rn(float a, float b, float c) {
  return fmaf(a, b, c);
}
inline double __fma_rn(double a, double b, double c) {
  return fma(a, b, c);
}
inline float __saturatef(float x) {
  return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x);
}
inline int __float_as_int(float x) {
  int i;
  std::memcpy(&i, &x, sizeof i);
  return i;
}
inline float __int_as_float(int i) {
  float x;
  std::memcpy(&x, &i, sizeof x);
  return x;
}

// The runtime subset the kernel files call (Note [Emulated CUDA device]).
enum cudaError_t { cudaSuccess = 0 };
enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
};
struct TandemEmulatedStream;
using cudaStream_t = TandemEmulatedStream*;

namespace tandem::emu {
// Implemented by the emulated runtime (runtime/cuda/emulator/device.cpp).
void enqueue_grid(void* stream, const LaunchShape& shape, std::function<void()> thread_body);
// Host work in stream order (the emulated library calls: GEMM).
void enqueue_host(void* stream, std::function<void()> task);
int stream_device(void* stream);
void* malloc_async(size_t nbytes, void* stream);
void free_async(void* ptr, void* stream);
void copy_async(void* dst, const void* src, size_t nbytes, void* stream);
void set_device(int device);
int current_device();

// kernel<<<grid, block, shared_bytes, stream>>>(args...): the arguments are
// copied now, as a launch copies them, and every emulated thread calls the
// kernel with its own copy.
template <class... P, class... A>
void launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t shared_bytes, void* stream,
            A&&... args) {
  LaunchShape shape{{grid.x, grid.y, grid.z}, {block.x, block.y, block.z}, shared_bytes};
  enqueue_grid(stream, shape,
               [kernel, params = std::tuple<std::decay_t<P>...>(std::forward<A>(args)...)] {
                 std::apply(kernel, params);
               });
}
}  // namespace tandem::emu

inline const char* cudaGetErrorString(cudaError_t) {
  return "no error";
}
inline cudaError_t cudaGetLastError() {
  return cudaSuccess;
}
inline cudaError_t cudaGetDevice(int* device) {
  *device = tandem::emu::current_device();
  return cudaSuccess;
}
inline cudaError_t cudaSetDevice(int device) {
  tandem::emu::set_device(device);
  return cudaSuccess;
}
inline cudaError_t cudaStreamGetDevice(cudaStream_t stream, int* device) {
  *device = tandem::emu::stream_device(stream);
  return cudaSuccess;
}
inline cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t nbytes, cudaMemcpyKind,
                                   cudaStream_t stream) {
  tandem::emu::copy_async(dst, src, nbytes, stream);
  return cudaSuccess;
}
inline cudaError_t cudaMallocAsync(void** ptr, size_t nbytes, cudaStream_t stream) {
  *ptr = tandem::emu::malloc_async(nbytes, stream);
  return cudaSuccess;
}
inline cudaError_t cudaFreeAsync(void* ptr, cudaStream_t stream) {
  tandem::emu::free_async(ptr, stream);
  return cudaSuccess;
}
