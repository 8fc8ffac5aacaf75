// Front ends: elementwise ops with numpy broadcasting and dtype promotion.
//
// Promotion: the two operands meet at promote(a, b) (dtype.cpp); true division
// and transcendental functions of integer tensors produce f32 (as in PyTorch);
// arithmetic on bool tensors happens in i64; comparisons return bool.
#include <cmath>
#include <iterator>

#include "tandem/tensor/dispatch.h"
#include "tandem/tensor/ops.h"

namespace tandem::ops {

using detail::dispatch;

namespace {

const char* binary_name(BinaryOp op) {
  static const char* names[] = {"add", "sub", "mul", "div", "pow", "maximum", "minimum",
                                "eq",  "ne",  "lt",  "le",  "gt",  "ge"};
  static_assert(std::size(names) == kBinaryOpCount, "one name per BinaryOp");
  return names[static_cast<int>(op)];
}

const char* unary_name(UnaryOp op) {
#define TANDEM_UNARY_NAME(E, name, ...) #name,
  static const char* names[] = {TANDEM_UNARY_OPS(TANDEM_UNARY_NAME)
                                    TANDEM_UNARY_KERNELS_ONLY(TANDEM_UNARY_NAME)};
#undef TANDEM_UNARY_NAME
  static_assert(std::size(names) == kUnaryOpCount, "one name per UnaryOp");
  return names[static_cast<int>(op)];
}

void check_pair(const Tensor& a, const Tensor& b, const char* op) {
  TANDEM_CHECK(a.defined() && b.defined(), "[tensor::{}] expected defined tensors, got {} and {}",
               op, a.defined() ? "defined" : "undefined", b.defined() ? "defined" : "undefined");
  TANDEM_CHECK(a.device() == b.device(),
               "[tensor::{}] expected both operands on one device, got {} and {}", op, a.device(),
               b.device());
}

DType compute_dtype(BinaryOp op, DType a, DType b) {
  DType t = promote(a, b);
  if (op == BinaryOp::Div && !is_floating(t)) return DType::F32;
  if (t == DType::Bool && !is_comparison(op) && op != BinaryOp::Maximum &&
      op != BinaryOp::Minimum) {
    return DType::I64;
  }
  return t;
}

Tensor binary_op(BinaryOp op, const Tensor& a, const Tensor& b) {
  const char* name = binary_name(op);
  check_pair(a, b, name);
  Shape shape = broadcast_shapes(a.shape(), b.shape(), name);
  DType ct = compute_dtype(op, a.dtype(), b.dtype());
  Tensor x = to(a, ct), y = to(b, ct);
  Tensor out = empty(shape, is_comparison(op) ? DType::Bool : ct, a.device());
  TensorArg ax = broadcast_arg(x, shape), ay = broadcast_arg(y, shape), ao = arg_of(out);
  dispatch(
      out.device(), [=] { cpu::binary(op, ax, ay, ao); },
      [=](void* s) { cuda::binary(op, ax, ay, ao, s); }, x, y, out);
  return out;
}

Tensor scalar_op(BinaryOp op, const Tensor& a, double s, bool scalar_first) {
  const char* name = binary_name(op);
  TANDEM_CHECK(a.defined(), "[tensor::{}] expected a defined tensor, got an empty handle", name);
  DType ct = a.dtype();
  if (!is_floating(ct) && (op == BinaryOp::Div || s != std::floor(s))) ct = DType::F32;
  if (ct == DType::Bool && !is_comparison(op)) ct = DType::I64;
  Tensor x = to(a, ct);
  Tensor out = empty(a.shape(), is_comparison(op) ? DType::Bool : ct, a.device());
  TensorArg ax = arg_of(x), ao = arg_of(out);
  dispatch(
      out.device(), [=] { cpu::binary_scalar(op, ax, s, scalar_first, ao); },
      [=](void* st) { cuda::binary_scalar(op, ax, s, scalar_first, ao, st); }, x, out);
  return out;
}

Tensor unary_op(UnaryOp op, const Tensor& a) {
  TANDEM_CHECK(a.defined(), "[tensor::{}] expected a defined tensor, got an empty handle",
               unary_name(op));
  bool keeps_integers = op == UnaryOp::Neg || op == UnaryOp::Abs || op == UnaryOp::Relu;
  DType ct = a.dtype();
  if (!is_floating(ct) && !keeps_integers) ct = DType::F32;
  if (ct == DType::Bool) ct = DType::I64;
  Tensor x = to(a, ct);
  Tensor out = empty(a.shape(), ct, a.device());
  TensorArg ax = arg_of(x), ao = arg_of(out);
  dispatch(
      out.device(), [=] { cpu::unary(op, ax, ao); }, [=](void* s) { cuda::unary(op, ax, ao, s); },
      x, out);
  return out;
}

}  // namespace

Tensor add(const Tensor& a, const Tensor& b) {
  return binary_op(BinaryOp::Add, a, b);
}
Tensor sub(const Tensor& a, const Tensor& b) {
  return binary_op(BinaryOp::Sub, a, b);
}
Tensor mul(const Tensor& a, const Tensor& b) {
  return binary_op(BinaryOp::Mul, a, b);
}
Tensor div(const Tensor& a, const Tensor& b) {
  return binary_op(BinaryOp::Div, a, b);
}
Tensor pow(const Tensor& a, const Tensor& b) {
  return binary_op(BinaryOp::Pow, a, b);
}
Tensor maximum(const Tensor& a, const Tensor& b) {
  return binary_op(BinaryOp::Maximum, a, b);
}
Tensor minimum(const Tensor& a, const Tensor& b) {
  return binary_op(BinaryOp::Minimum, a, b);
}
Tensor eq(const Tensor& a, const Tensor& b) {
  return binary_op(BinaryOp::Eq, a, b);
}
Tensor ne(const Tensor& a, const Tensor& b) {
  return binary_op(BinaryOp::Ne, a, b);
}
Tensor lt(const Tensor& a, const Tensor& b) {
  return binary_op(BinaryOp::Lt, a, b);
}
Tensor le(const Tensor& a, const Tensor& b) {
  return binary_op(BinaryOp::Le, a, b);
}
Tensor gt(const Tensor& a, const Tensor& b) {
  return binary_op(BinaryOp::Gt, a, b);
}
Tensor ge(const Tensor& a, const Tensor& b) {
  return binary_op(BinaryOp::Ge, a, b);
}

Tensor add(const Tensor& a, double s) {
  return scalar_op(BinaryOp::Add, a, s, false);
}
Tensor sub(const Tensor& a, double s) {
  return scalar_op(BinaryOp::Sub, a, s, false);
}
Tensor rsub(const Tensor& a, double s) {
  return scalar_op(BinaryOp::Sub, a, s, true);
}
Tensor mul(const Tensor& a, double s) {
  return scalar_op(BinaryOp::Mul, a, s, false);
}
Tensor div(const Tensor& a, double s) {
  return scalar_op(BinaryOp::Div, a, s, false);
}
Tensor rdiv(const Tensor& a, double s) {
  return scalar_op(BinaryOp::Div, a, s, true);
}
Tensor pow(const Tensor& a, double e) {
  return scalar_op(BinaryOp::Pow, a, e, false);
}
Tensor eq(const Tensor& a, double s) {
  return scalar_op(BinaryOp::Eq, a, s, false);
}
Tensor ne(const Tensor& a, double s) {
  return scalar_op(BinaryOp::Ne, a, s, false);
}
Tensor lt(const Tensor& a, double s) {
  return scalar_op(BinaryOp::Lt, a, s, false);
}
Tensor le(const Tensor& a, double s) {
  return scalar_op(BinaryOp::Le, a, s, false);
}
Tensor gt(const Tensor& a, double s) {
  return scalar_op(BinaryOp::Gt, a, s, false);
}
Tensor ge(const Tensor& a, double s) {
  return scalar_op(BinaryOp::Ge, a, s, false);
}

#define TANDEM_UNARY_DEFINE(E, name, linear) \
  Tensor name(const Tensor& a) {             \
    return unary_op(UnaryOp::E, a);          \
  }
TANDEM_UNARY_OPS(TANDEM_UNARY_DEFINE)
#undef TANDEM_UNARY_DEFINE
Tensor gelu(const Tensor& a, GeluApproximate approximate) {
  return unary_op(approximate == GeluApproximate::Tanh ? UnaryOp::Gelu : UnaryOp::GeluErf, a);
}

namespace {
void check_dropout(const Tensor& x, double p) {
  TANDEM_CHECK(x.defined(), "[tensor::dropout] expected a defined tensor, got an empty handle");
  TANDEM_CHECK(is_floating(x.dtype()), "[tensor::dropout] expected a floating x, got {}",
               dtype_name(x.dtype()));
  TANDEM_CHECK(p >= 0.0 && p <= 1.0, "[tensor::dropout] expected p in [0, 1], got {}", p);
}
}  // namespace

Tensor dropout(const Tensor& x, double p, uint64_t seed, uint64_t offset) {
  check_dropout(x, p);
  if (p == 0.0) return x;
  if (p == 1.0) return zeros_like(x);
  const Tensor xc = contiguous(x);
  Tensor out = empty(x.shape(), x.dtype(), x.device());
  TensorArg ax = arg_of(xc), ao = arg_of(out);
  dispatch(
      out.device(), [=] { cpu::dropout(ax, p, seed, offset, ao); },
      [=](void* s) { cuda::dropout(ax, p, seed, offset, ao, s); }, xc, out);
  return out;
}

Tensor dropout(const Tensor& x, double p, Generator& gen) {
  check_dropout(x, p);  // before the generator advances
  const uint64_t seed = gen.seed();
  const uint64_t offset = gen.advance(static_cast<uint64_t>(x.numel()));
  return dropout(x, p, seed, offset);
}

Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b) {
  check_pair(a, b, "where");
  check_pair(cond, a, "where");
  TANDEM_CHECK(cond.dtype() == DType::Bool, "[tensor::where] expected a bool condition, got {}",
               dtype_name(cond.dtype()));
  Shape shape =
      broadcast_shapes(broadcast_shapes(cond.shape(), a.shape(), "where"), b.shape(), "where");
  DType ct = promote(a.dtype(), b.dtype());
  Tensor x = to(a, ct), y = to(b, ct);
  Tensor out = empty(shape, ct, a.device());
  TensorArg ac = broadcast_arg(cond, shape), ax = broadcast_arg(x, shape),
            ay = broadcast_arg(y, shape), ao = arg_of(out);
  dispatch(
      out.device(), [=] { cpu::where(ac, ax, ay, ao); },
      [=](void* s) { cuda::where(ac, ax, ay, ao, s); }, cond, x, y, out);
  return out;
}

Tensor where(const Tensor& cond, const Tensor& a, double b) {
  return where(cond, a, scalar_tensor(b, a.dtype(), a.device()));
}

Tensor operator+(const Tensor& a, const Tensor& b) {
  return add(a, b);
}
Tensor operator-(const Tensor& a, const Tensor& b) {
  return sub(a, b);
}
Tensor operator*(const Tensor& a, const Tensor& b) {
  return mul(a, b);
}
Tensor operator/(const Tensor& a, const Tensor& b) {
  return div(a, b);
}
Tensor operator+(const Tensor& a, double s) {
  return add(a, s);
}
Tensor operator-(const Tensor& a, double s) {
  return sub(a, s);
}
Tensor operator*(const Tensor& a, double s) {
  return mul(a, s);
}
Tensor operator/(const Tensor& a, double s) {
  return div(a, s);
}
Tensor operator-(const Tensor& a) {
  return neg(a);
}

}  // namespace tandem::ops
