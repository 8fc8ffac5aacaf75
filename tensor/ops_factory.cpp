// Front ends: factories, copies, casts, device moves, cat/stack.
#include <cstring>

#include "tandem/runtime/cuda/cuda_api.h"
#include "tandem/tensor/dispatch.h"
#include "tandem/tensor/ops.h"

namespace tandem::ops {

using detail::dispatch;

void fill_(const Tensor& dst, double value) {
  TensorArg a = arg_of(dst);
  dispatch(
      dst.device(), [=] { cpu::fill(a, value); }, [=](void* s) { cuda::fill(a, value, s); }, dst);
}

Tensor full(const Shape& shape, double value, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  fill_(t, value);
  return t;
}
Tensor zeros(const Shape& shape, DType dtype, Device device) {
  return full(shape, 0.0, dtype, device);
}
Tensor ones(const Shape& shape, DType dtype, Device device) {
  return full(shape, 1.0, dtype, device);
}
Tensor scalar_tensor(double value, DType dtype, Device device) {
  return full(Shape{}, value, dtype, device);
}
Tensor empty_like(const Tensor& t) {
  return empty(t.shape(), t.dtype(), t.device());
}
Tensor zeros_like(const Tensor& t) {
  return zeros(t.shape(), t.dtype(), t.device());
}
Tensor ones_like(const Tensor& t) {
  return ones(t.shape(), t.dtype(), t.device());
}
Tensor full_like(const Tensor& t, double value) {
  return full(t.shape(), value, t.dtype(), t.device());
}

Tensor arange(double start, double end, double step, DType dtype, Device device) {
  TANDEM_CHECK(step != 0.0, "[tensor::arange] expected a non-zero step, got 0");
  TANDEM_CHECK((end - start) / step >= 0 || start == end,
               "[tensor::arange] expected the step to move from start towards end, got start={} "
               "end={} step={}",
               start, end, step);
  auto n = static_cast<int64_t>(std::ceil((end - start) / step));
  Tensor t = empty(Shape{std::max<int64_t>(n, 0)}, dtype, device);
  TensorArg a = arg_of(t);
  dispatch(
      device, [=] { cpu::arange(a, start, step); },
      [=](void* s) { cuda::arange(a, start, step, s); }, t);
  return t;
}

template <class T>
Tensor from_vector(const std::vector<T>& values, const Shape& shape, Device device) {
  TANDEM_CHECK(static_cast<int64_t>(values.size()) == shape.numel(),
               "[tensor::from_vector] expected {} values for shape {}, got {}", shape.numel(),
               shape, values.size());
  // Written directly from the host: a fresh block is never still in use by a
  // stream (Note [Kernel closures keep storage alive]).
  Tensor host = empty(shape, dtype_of<T>::value, Device::cpu());
  if constexpr (std::is_same_v<T, bool>) {
    auto* p = static_cast<uint8_t*>(host.raw_data());
    for (size_t i = 0; i < values.size(); ++i)
      p[i] = values[i] ? 1 : 0;
  } else if (!values.empty()) {
    std::memcpy(host.raw_data(), values.data(), values.size() * sizeof(T));
  }
  return device.is_cpu() ? host : to(host, device);
}

template Tensor from_vector<float>(const std::vector<float>&, const Shape&, Device);
template Tensor from_vector<double>(const std::vector<double>&, const Shape&, Device);
template Tensor from_vector<BFloat16>(const std::vector<BFloat16>&, const Shape&, Device);
template Tensor from_vector<Half>(const std::vector<Half>&, const Shape&, Device);
template Tensor from_vector<int32_t>(const std::vector<int32_t>&, const Shape&, Device);
template Tensor from_vector<int64_t>(const std::vector<int64_t>&, const Shape&, Device);
template Tensor from_vector<bool>(const std::vector<bool>&, const Shape&, Device);

namespace {

Tensor random_fill(const char* op, const Shape& shape, RandomKind kind, double a, double b,
                   Generator& gen, DType dtype, Device device) {
  TANDEM_CHECK(is_floating(dtype), "[tensor::{}] expected a floating dtype, got {}", op,
               dtype_name(dtype));
  Tensor t = empty(shape, dtype, device);
  uint64_t seed = gen.seed();
  uint64_t offset = gen.advance(static_cast<uint64_t>(t.numel()));
  TensorArg arg = arg_of(t);
  dispatch(
      device, [=] { cpu::random(arg, kind, seed, offset, a, b); },
      [=](void* s) { cuda::random(arg, kind, seed, offset, a, b, s); }, t);
  return t;
}

}  // namespace

Tensor rand(const Shape& shape, Generator& gen, DType dtype, Device device) {
  return random_fill("rand", shape, RandomKind::Uniform, 0.0, 1.0, gen, dtype, device);
}
Tensor uniform(const Shape& shape, double low, double high, Generator& gen, DType dtype,
               Device device) {
  TANDEM_CHECK(low <= high, "[tensor::uniform] expected low <= high, got {} > {}", low, high);
  return random_fill("uniform", shape, RandomKind::Uniform, low, high, gen, dtype, device);
}
Tensor randn(const Shape& shape, Generator& gen, DType dtype, Device device) {
  return random_fill("randn", shape, RandomKind::Normal, 0.0, 1.0, gen, dtype, device);
}
Tensor normal(const Shape& shape, double mean, double stddev, Generator& gen, DType dtype,
              Device device) {
  TANDEM_CHECK(stddev >= 0, "[tensor::normal] expected stddev >= 0, got {}", stddev);
  return random_fill("normal", shape, RandomKind::Normal, mean, stddev, gen, dtype, device);
}

void copy_(const Tensor& dst, const Tensor& src) {
  TANDEM_CHECK(dst.defined() && src.defined(),
               "[tensor::copy_] expected defined tensors, got dst={} src={}", dst.defined(),
               src.defined());
  if (dst.device() != src.device()) {
    copy_(dst, to(src, dst.device()));
    return;
  }
  broadcast_shapes(dst.shape(), src.shape(), "copy_");  // validates
  TANDEM_CHECK(
      src.dim() <= dst.dim() && broadcast_shapes(dst.shape(), src.shape(), "copy_") == dst.shape(),
      "[tensor::copy_] expected src {} to broadcast to dst {}", src.shape(), dst.shape());
  // Overlapping source and destination: copy the source out first.
  Tensor source = dst.is_alias_of(src) ? clone(src) : src;
  TensorArg in = broadcast_arg(source, dst.shape());
  TensorArg out = arg_of(dst);
  dispatch(
      dst.device(), [=] { cpu::copy(in, out); }, [=](void* s) { cuda::copy(in, out, s); }, dst,
      source);
}

Tensor contiguous(const Tensor& t) {
  TANDEM_CHECK(t.defined(), "[tensor::contiguous] expected a defined tensor, got an empty handle");
  if (t.is_contiguous()) return t;
  return clone(t);
}

Tensor clone(const Tensor& t) {
  Tensor out = empty(t.shape(), t.dtype(), t.device());
  copy_(out, t);
  return out;
}

Tensor to(const Tensor& t, DType dtype) {
  TANDEM_CHECK(t.defined(), "[tensor::to] expected a defined tensor, got an empty handle");
  if (t.dtype() == dtype) return t;
  Tensor out = empty(t.shape(), dtype, t.device());
  copy_(out, t);
  return out;
}

Tensor to(const Tensor& t, Device device) {
  TANDEM_CHECK(t.defined(), "[tensor::to] expected a defined tensor, got an empty handle");
  if (t.device() == device) return t;
  Tensor src = contiguous(t);
  Tensor out = empty(t.shape(), t.dtype(), device);
  if (t.nbytes() == 0) return out;
  if (device.is_cuda() && src.device().is_cuda()) {
    // Peer copy through the runtime: both streams ordered by synchronising.
    current_stream(src.device()).synchronize();
    const Stream& s = current_stream(device);
    cuda_api::memcpy_async(out.raw_data(), src.raw_data(), t.nbytes(),
                           cuda_api::CopyKind::DeviceToDevice, s.native_handle());
    s.synchronize();
    return out;
  }
  if (device.is_cuda()) {
    current_stream(Device::cpu()).synchronize();  // host data complete
    const Stream& s = current_stream(device);
    cuda_api::memcpy_async(out.raw_data(), src.raw_data(), t.nbytes(),
                           cuda_api::CopyKind::HostToDevice, s.native_handle());
    s.synchronize();  // the host buffer may be freed when we return
    return out;
  }
  const Stream& s = current_stream(src.device());
  cuda_api::memcpy_async(out.raw_data(), src.raw_data(), t.nbytes(),
                         cuda_api::CopyKind::DeviceToHost, s.native_handle());
  s.synchronize();
  return out;
}

Tensor cat(const std::vector<Tensor>& tensors, int64_t dim) {
  TANDEM_CHECK(!tensors.empty(), "[tensor::cat] expected at least one tensor, got none");
  const Tensor& first = tensors[0];
  int d = wrap_dim(dim, first.dim(), "cat");
  TANDEM_CHECK(first.dim() > 0, "[tensor::cat] expected tensors with at least one dim, got 0-d");
  Shape shape = first.shape();
  int64_t total = 0;
  DType dtype = first.dtype();
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i];
    TANDEM_CHECK(t.dim() == first.dim() && t.device() == first.device(),
                 "[tensor::cat] expected tensors of rank {} on {}, got tensor {} of shape {} on {}",
                 first.dim(), first.device(), i, t.shape(), t.device());
    for (int k = 0; k < t.dim(); ++k) {
      TANDEM_CHECK(k == d || t.shape()[k] == shape[k],
                   "[tensor::cat] expected tensor {} to match {} except in dim {}, got {}", i,
                   shape, d, t.shape());
    }
    total += t.shape()[d];
    dtype = promote(dtype, t.dtype());
  }
  shape[d] = total;
  Tensor out = empty(shape, dtype, first.device());
  int64_t offset = 0;
  for (const Tensor& t : tensors) {
    if (t.shape()[d] > 0) copy_(narrow(out, d, offset, t.shape()[d]), t);
    offset += t.shape()[d];
  }
  return out;
}

Tensor stack(const std::vector<Tensor>& tensors, int64_t dim) {
  TANDEM_CHECK(!tensors.empty(), "[tensor::stack] expected at least one tensor, got none");
  int d = wrap_dim(dim, tensors[0].dim() + 1, "stack");
  std::vector<Tensor> expanded;
  expanded.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    TANDEM_CHECK(tensors[i].shape() == tensors[0].shape(),
                 "[tensor::stack] expected every tensor of shape {}, got tensor {} of shape {}",
                 tensors[0].shape(), i, tensors[i].shape());
    expanded.push_back(unsqueeze(tensors[i], d));
  }
  return cat(expanded, d);
}

}  // namespace tandem::ops
