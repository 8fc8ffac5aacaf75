// Front ends: reductions, cumsum, softmax. Kernels see a contiguous
// (outer, r, inner) view: when the reduced dims form one block of a contiguous
// tensor no copy is made; otherwise the reduced dims are permuted last and the
// tensor is copied once.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "tandem/tensor/dispatch.h"
#include "tandem/tensor/ops.h"

namespace tandem::ops {

using detail::dispatch;

namespace {

struct ReducePlan {
  Tensor input;  // contiguous
  int64_t outer = 1, r = 1, inner = 1;
  Shape out_shape;
};

ReducePlan plan_reduce(const Tensor& t, const Dims& dims, bool keepdim, const char* op) {
  TANDEM_CHECK(t.defined(), "[tensor::{}] expected a defined tensor, got an empty handle", op);
  bool reduced[kMaxDims] = {};
  if (dims.empty()) {
    for (int i = 0; i < t.dim(); ++i)
      reduced[i] = true;
  }
  for (int64_t d : dims) {
    int w = wrap_dim(d, t.dim(), op);
    TANDEM_CHECK(!reduced[w] || t.dim() == 0,
                 "[tensor::{}] expected each dim once, got {} (dim {} repeats)", op, dims, w);
    reduced[w] = true;
  }
  ReducePlan p;
  int first = -1, last = -1;
  for (int i = 0; i < t.dim(); ++i) {
    if (reduced[i]) {
      if (first < 0) first = i;
      last = i;
      if (keepdim) p.out_shape.push_back(1);
    } else {
      p.out_shape.push_back(t.shape()[i]);
    }
  }
  bool block = true;
  for (int i = first; i >= 0 && i <= last; ++i)
    block = block && reduced[i];
  if (first < 0) {  // 0-d tensor or nothing to reduce
    p.input = contiguous(t);
    p.outer = t.numel();
    return p;
  }
  if (block && t.is_contiguous()) {
    p.input = t;
    for (int i = 0; i < first; ++i)
      p.outer *= t.shape()[i];
    for (int i = first; i <= last; ++i)
      p.r *= t.shape()[i];
    for (int i = last + 1; i < t.dim(); ++i)
      p.inner *= t.shape()[i];
    return p;
  }
  Dims order;
  for (int i = 0; i < t.dim(); ++i) {
    if (!reduced[i]) {
      order.push_back(i);
      p.outer *= t.shape()[i];
    }
  }
  for (int i = 0; i < t.dim(); ++i) {
    if (reduced[i]) {
      order.push_back(i);
      p.r *= t.shape()[i];
    }
  }
  p.input = contiguous(permute(t, order));
  return p;
}

Tensor run_reduce(ReduceOp op, const Tensor& t, const Dims& dims, bool keepdim, const char* name) {
  Tensor src = t;
  if (op == ReduceOp::Sum && !is_floating(t.dtype())) src = to(t, DType::I64);
  if (op == ReduceOp::Mean && !is_floating(t.dtype())) src = to(t, DType::F32);
  ReducePlan p = plan_reduce(src, dims, keepdim, name);
  bool arg = op == ReduceOp::Argmax || op == ReduceOp::Argmin;
  if (op != ReduceOp::Sum && op != ReduceOp::Mean) {
    TANDEM_CHECK(p.r > 0, "[tensor::{}] expected a non-empty reduction, got shape {} over dims {}",
                 name, t.shape(), dims);
  }
  Tensor out = empty(p.out_shape, arg ? DType::I64 : src.dtype(), t.device());
  if (op == ReduceOp::Mean && p.r == 0) {
    fill_(out, std::nan(""));  // 0 / 0, as in PyTorch (a sum over nothing is 0)
    return out;
  }
  TensorArg ai = arg_of(p.input), ao = arg_of(out);
  int64_t outer = p.outer, r = p.r, inner = p.inner;
  dispatch(
      t.device(), [=] { cpu::reduce(op, ai, outer, r, inner, ao); },
      [=](void* s) { cuda::reduce(op, ai, outer, r, inner, ao, s); }, p.input, out);
  return out;
}

// (outer, r, inner) of a contiguous copy of `t` along one dim.
ReducePlan plan_along(const Tensor& t, int64_t dim, const char* op) {
  TANDEM_CHECK(t.defined(), "[tensor::{}] expected a defined tensor, got an empty handle", op);
  int d = wrap_dim(dim, t.dim(), op);
  ReducePlan p;
  p.input = contiguous(t);
  p.out_shape = t.shape();
  for (int i = 0; i < d; ++i)
    p.outer *= t.shape()[i];
  p.r = t.dim() == 0 ? 1 : t.shape()[d];
  for (int i = d + 1; i < t.dim(); ++i)
    p.inner *= t.shape()[i];
  return p;
}

Tensor run_softmax(const Tensor& t, int64_t dim, bool log) {
  const char* name = log ? "log_softmax" : "softmax";
  Tensor src = is_floating(t.dtype()) ? t : to(t, DType::F32);
  ReducePlan p = plan_along(src, dim, name);
  Tensor out = empty(p.out_shape, src.dtype(), t.device());
  TensorArg ai = arg_of(p.input), ao = arg_of(out);
  int64_t outer = p.outer, r = p.r, inner = p.inner;
  dispatch(
      t.device(), [=] { cpu::softmax(ai, outer, r, inner, log, ao); },
      [=](void* s) { cuda::softmax(ai, outer, r, inner, log, ao, s); }, p.input, out);
  return out;
}

}  // namespace

Tensor sum(const Tensor& t, const Dims& dims, bool keepdim) {
  return run_reduce(ReduceOp::Sum, t, dims, keepdim, "sum");
}
Tensor mean(const Tensor& t, const Dims& dims, bool keepdim) {
  return run_reduce(ReduceOp::Mean, t, dims, keepdim, "mean");
}
Tensor amax(const Tensor& t, const Dims& dims, bool keepdim) {
  return run_reduce(ReduceOp::Max, t, dims, keepdim, "amax");
}
Tensor amin(const Tensor& t, const Dims& dims, bool keepdim) {
  return run_reduce(ReduceOp::Min, t, dims, keepdim, "amin");
}
Tensor argmax(const Tensor& t, int64_t dim, bool keepdim) {
  return run_reduce(ReduceOp::Argmax, t, Dims{dim}, keepdim, "argmax");
}
Tensor argmin(const Tensor& t, int64_t dim, bool keepdim) {
  return run_reduce(ReduceOp::Argmin, t, Dims{dim}, keepdim, "argmin");
}
std::pair<Tensor, Tensor> max(const Tensor& t, int64_t dim, bool keepdim) {
  return {amax(t, Dims{dim}, keepdim), argmax(t, dim, keepdim)};
}

Tensor cumsum(const Tensor& t, int64_t dim) {
  Tensor src = (is_floating(t.dtype()) || t.dtype() == DType::I64) ? t : to(t, DType::I64);
  ReducePlan p = plan_along(src, dim, "cumsum");
  Tensor out = empty(p.out_shape, src.dtype(), t.device());
  TensorArg ai = arg_of(p.input), ao = arg_of(out);
  int64_t outer = p.outer, r = p.r, inner = p.inner;
  dispatch(
      t.device(), [=] { cpu::cumsum(ai, outer, r, inner, ao); },
      [=](void* s) { cuda::cumsum(ai, outer, r, inner, ao, s); }, p.input, out);
  return out;
}

Tensor softmax(const Tensor& t, int64_t dim) {
  return run_softmax(t, dim, false);
}
Tensor log_softmax(const Tensor& t, int64_t dim) {
  return run_softmax(t, dim, true);
}

bool allclose(const Tensor& a, const Tensor& b, double rtol, double atol) {
  if (!a.defined() || !b.defined()) return a.defined() == b.defined();
  if (a.shape() != b.shape()) return false;
  std::vector<double> x = to(to(a, Device::cpu()), DType::F64).to_vector<double>();
  std::vector<double> y = to(to(b, Device::cpu()), DType::F64).to_vector<double>();
  for (size_t i = 0; i < x.size(); ++i) {
    if (std::isnan(x[i]) || std::isnan(y[i])) return false;
    if (std::abs(x[i] - y[i]) > atol + rtol * std::abs(y[i])) return false;
  }
  return true;
}

bool equal(const Tensor& a, const Tensor& b) {
  if (!a.defined() || !b.defined()) return a.defined() == b.defined();
  if (a.shape() != b.shape() || a.dtype() != b.dtype()) return false;
  Tensor x = contiguous(to(a, Device::cpu())), y = contiguous(to(b, Device::cpu()));
  current_stream(Device::cpu()).synchronize();
  return std::memcmp(x.raw_data(), y.raw_data(), x.nbytes()) == 0;
}

}  // namespace tandem::ops
