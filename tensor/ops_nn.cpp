// Front ends of the neural-network ops in tensor/ops.h: normalisation,
// indexing, sorting, cross_entropy and scaled dot-product attention.
//
// The kernel-backed ops check shapes, dtypes and devices here, make their
// operands contiguous, convert i32 indices to i64, view every operand as the
// (outer, n, inner) layout tensor/kernels.h describes and dispatch. Index
// values are checked by the kernels (they are data). Every dispatch passes the
// tensors its kernel touches (Note [Kernel closures keep storage alive]).
// cross_entropy is a composition of other ops, so it runs on any device that
// has those ops; attention and the norm backward are fused kernels.
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "tandem/tensor/dispatch.h"
#include "tandem/tensor/kernels.h"
#include "tandem/tensor/ops.h"

namespace tandem::ops {
namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

void check_defined(const Tensor& t, const char* op, const char* name) {
  TANDEM_CHECK(t.defined(), "[tensor::{}] expected a defined tensor for {}, got an empty handle",
               op, name);
}

void check_same_device(const Tensor& a, const Tensor& b, const char* op, const char* a_name,
                       const char* b_name) {
  TANDEM_CHECK(a.device() == b.device(),
               "[tensor::{}] expected {} and {} on one device, got {} and {}", op, a_name, b_name,
               a.device(), b.device());
}

// A kernel argument for an optional tensor: data == nullptr when undefined.
TensorArg optional_arg(const Tensor& t) {
  return t.defined() ? arg_of(t) : TensorArg{};
}

// The index operand of the indexing ops: i64 (i32 converted), contiguous.
Tensor index_i64(const Tensor& index, const char* op) {
  TANDEM_CHECK(is_integral(index.dtype()), "[tensor::{}] expected an i64 or i32 index, got {}", op,
               dtype_name(index.dtype()));
  return contiguous(index.dtype() == DType::I64 ? index : to(index, DType::I64));
}

// The extents before and after `dim`: a contiguous tensor of `shape` is an
// (outer, shape[dim], inner) array.
struct Around {
  int64_t outer = 1;
  int64_t inner = 1;
};
Around around(const Shape& shape, int dim) {
  Around a;
  for (int i = 0; i < dim; ++i) {
    a.outer *= shape[i];
  }
  for (int i = dim + 1; i < shape.size(); ++i) {
    a.inner *= shape[i];
  }
  return a;
}

Tensor cast_if_needed(const Tensor& t, DType dtype) {
  return t.dtype() == dtype ? t : to(t, dtype);
}

// Common checks of the optional affine parameters of layer_norm / rms_norm.
void check_norm_param(const Tensor& p, const Tensor& x, const char* op, const char* name) {
  if (!p.defined()) return;
  const int64_t d = x.size(-1);
  TANDEM_CHECK(p.shape() == Shape{d}, "[tensor::{}] expected {} of shape [{}] (x={}), got {}", op,
               name, d, x.shape(), p.shape());
  TANDEM_CHECK(p.dtype() == x.dtype(), "[tensor::{}] expected {} of x's dtype {}, got {}", op, name,
               dtype_name(x.dtype()), dtype_name(p.dtype()));
  check_same_device(x, p, op, "x", name);
}

void check_norm_input(const Tensor& x, const char* op) {
  check_defined(x, op, "x");
  TANDEM_CHECK(x.dim() >= 1, "[tensor::{}] expected x with at least 1 dim, got shape {}", op,
               x.shape());
  TANDEM_CHECK(is_floating(x.dtype()), "[tensor::{}] expected a floating x, got {}", op,
               dtype_name(x.dtype()));
}

// Checks shared by topk and argsort; returns the wrapped dim.
int check_sort_input(const Tensor& t, int64_t dim, const char* op) {
  check_defined(t, op, "t");
  TANDEM_CHECK(t.dim() >= 1, "[tensor::{}] expected a tensor with at least 1 dim, got shape {}", op,
               t.shape());
  TANDEM_CHECK(t.dtype() != DType::Bool, "[tensor::{}] expected a numeric dtype, got bool", op);
  return wrap_dim(dim, t.dim(), op);
}

// Attention operands: 4-D, k and v alike, one dtype and device, grouped heads.
void check_attention_inputs(const Tensor& q, const Tensor& k, const Tensor& v, const char* op) {
  check_defined(q, op, "q");
  check_defined(k, op, "k");
  check_defined(v, op, "v");
  TANDEM_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
               "[tensor::{}] expected 4-D (B, H, S, D) q, k and v, got q={}, k={}, v={}", op,
               q.shape(), k.shape(), v.shape());
  TANDEM_CHECK(k.shape() == v.shape(), "[tensor::{}] expected k and v of one shape, got k={}, v={}",
               op, k.shape(), v.shape());
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(3), Hkv = k.size(1);
  TANDEM_CHECK(k.size(0) == B && k.size(3) == D,
               "[tensor::{}] expected q and k with the same B and D, got q={}, k={}", op, q.shape(),
               k.shape());
  // No heads at all (an empty head shard) is the one layout with Hkv == 0.
  TANDEM_CHECK((Hkv > 0 && Hq % Hkv == 0) || (Hq == 0 && Hkv == 0),
               "[tensor::{}] expected Hq divisible by Hkv, got Hq={}, Hkv={} (q={}, k={})", op, Hq,
               Hkv, q.shape(), k.shape());
  TANDEM_CHECK(q.dtype() == k.dtype() && q.dtype() == v.dtype(),
               "[tensor::{}] expected q, k and v of one dtype, got {}, {} and {}", op,
               dtype_name(q.dtype()), dtype_name(k.dtype()), dtype_name(v.dtype()));
  TANDEM_CHECK(is_floating(q.dtype()), "[tensor::{}] expected floating q, k and v, got {}", op,
               dtype_name(q.dtype()));
  check_same_device(q, k, op, "q", "k");
  check_same_device(q, v, op, "q", "v");
}

// The attention kernels read rows along D with unit stride (any other strides).
Tensor unit_stride_last(const Tensor& t) {
  return t.size(-1) <= 1 || t.stride(-1) == 1 ? t : contiguous(t);
}

// (B, S, H, D) storage seen as (B, H, S, D).
Tensor heads_view(const Tensor& bshd) {
  return transpose(bshd, 1, 2);
}

// Note [Packed sequences]: every query row's key window [begin, end), in
// local key positions, as (window_rows, Sq, 2) int32; the bounds are checked
// against the positions the call covers.
std::vector<int32_t> attention_windows(const AttentionOptions& o, int64_t B, int64_t Sq, int64_t Sk,
                                       const char* op) {
  const DocumentBounds& docs = *o.documents;
  const int64_t rows = static_cast<int64_t>(docs.cumulative.size());
  TANDEM_CHECK(rows == 1 || rows == B,
               "[tensor::{}] expected document bounds for 1 or {} (batch) rows, got {}", op, B,
               rows);
  const int64_t last = std::max(o.q_offset + Sq, o.k_offset + Sk);
  TANDEM_CHECK(last <= std::numeric_limits<int32_t>::max(),
               "[tensor::{}] expected positions below 2^31 with document bounds, got {}", op, last);
  std::vector<int32_t> w(static_cast<size_t>(rows * Sq * 2));
  for (int64_t b = 0; b < rows; ++b) {
    const std::vector<int64_t>& cu = docs.row(b);
    TANDEM_CHECK(cu.back() >= last,
                 "[tensor::{}] expected the documents of row {} to cover positions [0, {}) (q at "
                 "{}, k at {}), got bounds ending at {}",
                 op, b, last, o.q_offset, o.k_offset, cu.back());
    for (int64_t i = 0; i < Sq; ++i) {
      const int64_t p = o.q_offset + i;
      // The document holding p: the last bound <= p (empty documents skipped).
      const auto d = std::upper_bound(cu.begin(), cu.end(), p) - 1;
      const int64_t end = o.causal ? p + 1 : *(d + 1);
      w[static_cast<size_t>((b * Sq + i) * 2)] =
          static_cast<int32_t>(std::clamp<int64_t>(*d - o.k_offset, 0, Sk));
      w[static_cast<size_t>((b * Sq + i) * 2 + 1)] =
          static_cast<int32_t>(std::clamp<int64_t>(end - o.k_offset, 0, Sk));
    }
  }
  return w;
}

// The windows on the kernels' device, kept alive by the caller until they ran.
Tensor windows_tensor(const AttentionOptions& o, int64_t B, int64_t Sq, int64_t Sk, Device dev,
                      const char* op) {
  if (!o.documents) return Tensor();
  std::vector<int32_t> w = attention_windows(o, B, Sq, Sk, op);
  const auto rows = static_cast<int64_t>(o.documents->cumulative.size());
  return from_vector(w, Shape{rows, Sq, 2}, dev);
}

AttentionArgs attention_args(const Tensor& q, const Tensor& k, const AttentionOptions& options,
                             double scale, const Tensor& windows) {
  AttentionArgs a;
  a.batch = q.size(0);
  a.heads_q = q.size(1);
  a.heads_kv = k.size(1);
  a.seq_q = q.size(2);
  a.seq_k = k.size(2);
  a.dim = q.size(3);
  a.scale = scale;
  a.causal = options.causal;
  a.q_offset = options.q_offset;
  a.k_offset = options.k_offset;
  if (windows.defined()) {
    a.windows = windows.data_ptr<int32_t>();
    a.window_rows = windows.size(0);
  }
  return a;
}

}  // namespace

// ---- normalisation ----

NormResult layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps) {
  check_norm_input(x, "layer_norm");
  check_norm_param(weight, x, "layer_norm", "weight");
  check_norm_param(bias, x, "layer_norm", "bias");
  TANDEM_CHECK(eps >= 0.0, "[tensor::layer_norm] expected eps >= 0, got {}", eps);
  const Tensor xc = contiguous(x);
  const Tensor wc = weight.defined() ? contiguous(weight) : Tensor();
  const Tensor bc = bias.defined() ? contiguous(bias) : Tensor();
  const int64_t d = x.size(-1);
  const int64_t rows = around(x.shape(), x.dim() - 1).outer;
  const Device dev = x.device();
  NormResult r;
  r.out = empty(x.shape(), x.dtype(), dev);
  r.mean = empty({rows}, DType::F32, dev);
  r.rstd = empty({rows}, DType::F32, dev);
  const TensorArg xa = arg_of(xc), wa = optional_arg(wc), ba = optional_arg(bc);
  const TensorArg oa = arg_of(r.out), ma = arg_of(r.mean), ra = arg_of(r.rstd);
  detail::dispatch(
      dev, [=] { cpu::layer_norm(xa, wa, ba, eps, rows, d, oa, ma, ra); },
      [=](void* s) { cuda::layer_norm(xa, wa, ba, eps, rows, d, oa, ma, ra, s); }, xc, wc, bc,
      r.out, r.mean, r.rstd);
  return r;
}

NormResult rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  check_norm_input(x, "rms_norm");
  check_norm_param(weight, x, "rms_norm", "weight");
  TANDEM_CHECK(eps >= 0.0, "[tensor::rms_norm] expected eps >= 0, got {}", eps);
  const Tensor xc = contiguous(x);
  const Tensor wc = weight.defined() ? contiguous(weight) : Tensor();
  const int64_t d = x.size(-1);
  const int64_t rows = around(x.shape(), x.dim() - 1).outer;
  const Device dev = x.device();
  NormResult r;
  r.out = empty(x.shape(), x.dtype(), dev);
  r.rstd = empty({rows}, DType::F32, dev);
  const TensorArg xa = arg_of(xc), wa = optional_arg(wc);
  const TensorArg oa = arg_of(r.out), ra = arg_of(r.rstd);
  detail::dispatch(
      dev, [=] { cpu::rms_norm(xa, wa, eps, rows, d, oa, ra); },
      [=](void* s) { cuda::rms_norm(xa, wa, eps, rows, d, oa, ra, s); }, xc, wc, r.out, r.rstd);
  return r;
}

NormGrads norm_backward(const Tensor& dy, const Tensor& x, const Tensor& weight, const Tensor& mean,
                        const Tensor& rstd, bool want_dweight, bool want_dbias) {
  constexpr const char* op = "norm_backward";
  check_norm_input(x, op);
  check_norm_param(weight, x, op, "weight");
  check_defined(dy, op, "dy");
  check_defined(rstd, op, "rstd");
  TANDEM_CHECK(dy.shape() == x.shape(), "[tensor::{}] expected dy of x's shape {}, got {}", op,
               x.shape(), dy.shape());
  check_same_device(x, dy, op, "x", "dy");
  const int64_t d = x.size(-1);
  const int64_t rows = around(x.shape(), x.dim() - 1).outer;
  auto check_stat = [&](const Tensor& t, const char* name) {
    TANDEM_CHECK(t.dtype() == DType::F32 && t.numel() == rows,
                 "[tensor::{}] expected {} as {} f32 values (x={}), got {} {}", op, name, rows,
                 x.shape(), dtype_name(t.dtype()), t.shape());
    check_same_device(x, t, op, "x", name);
  };
  check_stat(rstd, "rstd");
  if (mean.defined()) check_stat(mean, "mean");
  TANDEM_CHECK(!want_dbias || mean.defined(),
               "[tensor::{}] expected mean (layer_norm) when a bias gradient is asked for", op);
  const Device dev = x.device();
  const DType acc = x.dtype() == DType::F64 ? DType::F64 : DType::F32;
  NormGrads r;
  r.dx = empty(x.shape(), x.dtype(), dev);
  Tensor dw = want_dweight && weight.defined() ? empty({d}, acc, dev) : Tensor();
  Tensor db = want_dbias ? empty({d}, acc, dev) : Tensor();
  if (x.numel() == 0) {
    if (dw.defined()) fill_(dw, 0.0);
    if (db.defined()) fill_(db, 0.0);
  } else {
    const Tensor xc = contiguous(x), gc = contiguous(cast_if_needed(dy, x.dtype()));
    const Tensor wc = weight.defined() ? contiguous(weight) : Tensor();
    const Tensor mc = mean.defined() ? contiguous(mean) : Tensor();
    const Tensor rc = contiguous(rstd);
    const TensorArg ga = arg_of(gc), xa = arg_of(xc), wa = optional_arg(wc), ma = optional_arg(mc),
                    ra = arg_of(rc), dxa = arg_of(r.dx), dwa = optional_arg(dw),
                    dba = optional_arg(db);
    detail::dispatch(
        dev, [=] { cpu::norm_backward(ga, xa, wa, ma, ra, rows, d, dxa, dwa, dba); },
        [=](void* s) { cuda::norm_backward(ga, xa, wa, ma, ra, rows, d, dxa, dwa, dba, s); }, gc,
        xc, wc, mc, rc, r.dx, dw, db);
  }
  if (dw.defined()) r.dweight = cast_if_needed(dw, weight.dtype());
  if (db.defined()) r.dbias = cast_if_needed(db, x.dtype());
  return r;
}

// ---- indexing ----

Tensor embedding(const Tensor& weight, const Tensor& indices) {
  check_defined(weight, "embedding", "weight");
  check_defined(indices, "embedding", "indices");
  TANDEM_CHECK(weight.dim() == 2, "[tensor::embedding] expected a 2-D weight (V, D), got shape {}",
               weight.shape());
  TANDEM_CHECK(is_integral(indices.dtype()),
               "[tensor::embedding] expected i64 or i32 indices, got {}",
               dtype_name(indices.dtype()));
  check_same_device(weight, indices, "embedding", "weight", "indices");
  Shape out_shape = indices.shape();
  TANDEM_CHECK(out_shape.size() < kMaxDims,
               "[tensor::embedding] expected indices with at most {} dims, got shape {}",
               kMaxDims - 1, indices.shape());
  out_shape.push_back(weight.size(1));
  const Tensor rows = index_select(weight, 0, reshape(indices, {indices.numel()}));
  return reshape(rows, out_shape);
}

Tensor index_select(const Tensor& t, int64_t dim, const Tensor& index) {
  check_defined(t, "index_select", "t");
  check_defined(index, "index_select", "index");
  TANDEM_CHECK(t.dim() >= 1, "[tensor::index_select] expected t with at least 1 dim, got shape {}",
               t.shape());
  TANDEM_CHECK(index.dim() == 1, "[tensor::index_select] expected a 1-D index, got shape {}",
               index.shape());
  check_same_device(t, index, "index_select", "t", "index");
  const int d = wrap_dim(dim, t.dim(), "index_select");
  const Tensor idx = index_i64(index, "index_select");
  const Tensor tc = contiguous(t);
  const Around a = around(t.shape(), d);
  const int64_t n = t.size(d);
  Shape out_shape = t.shape();
  out_shape[d] = idx.numel();
  Tensor out = empty(out_shape, t.dtype(), t.device());
  const TensorArg ta = arg_of(tc), ia = arg_of(idx), oa = arg_of(out);
  const int64_t outer = a.outer, inner = a.inner;
  detail::dispatch(
      t.device(), [=] { cpu::index_select(ta, outer, n, inner, ia, oa); },
      [=](void* s) { cuda::index_select(ta, outer, n, inner, ia, oa, s); }, tc, idx, out);
  return out;
}

Tensor gather(const Tensor& t, int64_t dim, const Tensor& index) {
  check_defined(t, "gather", "t");
  check_defined(index, "gather", "index");
  TANDEM_CHECK(t.dim() >= 1, "[tensor::gather] expected t with at least 1 dim, got shape {}",
               t.shape());
  TANDEM_CHECK(index.dim() == t.dim(),
               "[tensor::gather] expected index of t's rank {}, got rank {} (t={}, index={})",
               t.dim(), index.dim(), t.shape(), index.shape());
  check_same_device(t, index, "gather", "t", "index");
  const int d = wrap_dim(dim, t.dim(), "gather");
  // Like torch.gather, index may be smaller than t off `dim`: only the leading
  // part of t is read there, so narrow t to index's extents first.
  Tensor src = t;
  for (int i = 0; i < t.dim(); ++i) {
    if (i == d) continue;
    TANDEM_CHECK(index.size(i) <= t.size(i),
                 "[tensor::gather] expected index.shape[{}] <= t.shape[{}], got {} vs {} (t={}, "
                 "index={})",
                 i, i, index.size(i), t.size(i), t.shape(), index.shape());
    if (index.size(i) < t.size(i)) src = narrow(src, i, 0, index.size(i));
  }
  const Tensor idx = index_i64(index, "gather");
  const Tensor sc = contiguous(src);
  const Around a = around(index.shape(), d);
  const int64_t n = t.size(d), k = index.size(d), outer = a.outer, inner = a.inner;
  Tensor out = empty(index.shape(), t.dtype(), t.device());
  const TensorArg sa = arg_of(sc), ia = arg_of(idx), oa = arg_of(out);
  detail::dispatch(
      t.device(), [=] { cpu::gather(sa, outer, n, inner, ia, k, oa); },
      [=](void* s) { cuda::gather(sa, outer, n, inner, ia, k, oa, s); }, sc, idx, out);
  return out;
}

Tensor scatter_add(const Tensor& t, int64_t dim, const Tensor& index, const Tensor& src) {
  check_defined(t, "scatter_add", "t");
  check_defined(index, "scatter_add", "index");
  check_defined(src, "scatter_add", "src");
  TANDEM_CHECK(t.dim() >= 1, "[tensor::scatter_add] expected t with at least 1 dim, got shape {}",
               t.shape());
  TANDEM_CHECK(index.dim() == t.dim() && src.dim() == t.dim(),
               "[tensor::scatter_add] expected t, index and src of one rank, got {}, {} and {} "
               "(t={}, index={}, src={})",
               t.dim(), index.dim(), src.dim(), t.shape(), index.shape(), src.shape());
  TANDEM_CHECK(src.dtype() == t.dtype(),
               "[tensor::scatter_add] expected src of t's dtype {}, got {}", dtype_name(t.dtype()),
               dtype_name(src.dtype()));
  TANDEM_CHECK(t.dtype() != DType::Bool,
               "[tensor::scatter_add] expected a numeric dtype, got bool");
  check_same_device(t, index, "scatter_add", "t", "index");
  check_same_device(t, src, "scatter_add", "t", "src");
  const int d = wrap_dim(dim, t.dim(), "scatter_add");
  // As in torch.scatter_add_: index.shape <= src.shape everywhere and
  // <= t.shape off `dim`; only that leading part of src and of t takes part.
  Tensor src_part = src;
  for (int i = 0; i < t.dim(); ++i) {
    TANDEM_CHECK(index.size(i) <= src.size(i),
                 "[tensor::scatter_add] expected index.shape[{}] <= src.shape[{}], got {} vs {} "
                 "(index={}, src={})",
                 i, i, index.size(i), src.size(i), index.shape(), src.shape());
    TANDEM_CHECK(i == d || index.size(i) <= t.size(i),
                 "[tensor::scatter_add] expected index.shape[{}] <= t.shape[{}] off dim {}, got {} "
                 "vs {} (index={}, t={})",
                 i, i, d, index.size(i), t.size(i), index.shape(), t.shape());
    if (index.size(i) < src.size(i)) src_part = narrow(src_part, i, 0, index.size(i));
  }
  const Tensor idx = index_i64(index, "scatter_add");
  const Tensor sc = contiguous(src_part);
  Tensor out = contiguous(clone(t));
  Tensor target = out;
  for (int i = 0; i < t.dim(); ++i) {
    if (i != d && index.size(i) < t.size(i)) target = narrow(target, i, 0, index.size(i));
  }
  // The kernel needs a contiguous (outer, n, inner) output: scatter into a
  // copy of the narrowed part when it is strided, then copy it back.
  Tensor work = contiguous(target);
  const Around a = around(index.shape(), d);
  const int64_t n = t.size(d), k = index.size(d), outer = a.outer, inner = a.inner;
  const TensorArg wa = arg_of(work), ia = arg_of(idx), sa = arg_of(sc);
  detail::dispatch(
      t.device(), [=] { cpu::scatter_add(wa, outer, n, inner, ia, k, sa); },
      [=](void* s) { cuda::scatter_add(wa, outer, n, inner, ia, k, sa, s); }, work, idx, sc);
  if (!work.is_alias_of(target)) copy_(target, work);
  return out;
}

// ---- sorting ----

std::pair<Tensor, Tensor> topk(const Tensor& t, int64_t k, int64_t dim, bool largest) {
  const int d = check_sort_input(t, dim, "topk");
  const int64_t n = t.size(d);
  TANDEM_CHECK(k >= 0 && k <= n, "[tensor::topk] expected k in [0, {}] (t={}, dim={}), got {}", n,
               t.shape(), d, k);
  const int last = t.dim() - 1;
  const Tensor xc = contiguous(transpose(t, d, last));
  Shape out_shape = xc.shape();
  out_shape[last] = k;
  Tensor values = empty(out_shape, t.dtype(), t.device());
  Tensor indices = empty(out_shape, DType::I64, t.device());
  const int64_t rows = around(xc.shape(), last).outer;
  const TensorArg xa = arg_of(xc), va = arg_of(values), ia = arg_of(indices);
  detail::dispatch(
      t.device(), [=] { cpu::topk(xa, rows, n, k, largest, va, ia); },
      [=](void* s) { cuda::topk(xa, rows, n, k, largest, va, ia, s); }, xc, values, indices);
  return {transpose(values, d, last), transpose(indices, d, last)};
}

Tensor argsort(const Tensor& t, int64_t dim, bool descending) {
  const int d = check_sort_input(t, dim, "argsort");
  const int64_t n = t.size(d);
  const int last = t.dim() - 1;
  const Tensor xc = contiguous(transpose(t, d, last));
  Tensor indices = empty(xc.shape(), DType::I64, t.device());
  const int64_t rows = around(xc.shape(), last).outer;
  const TensorArg xa = arg_of(xc), ia = arg_of(indices);
  detail::dispatch(
      t.device(), [=] { cpu::argsort(xa, rows, n, descending, ia); },
      [=](void* s) { cuda::argsort(xa, rows, n, descending, ia, s); }, xc, indices);
  return transpose(indices, d, last);
}

Tensor one_hot(const Tensor& indices, int64_t num_classes) {
  check_defined(indices, "one_hot", "indices");
  TANDEM_CHECK(num_classes > 0, "[tensor::one_hot] expected num_classes > 0, got {}", num_classes);
  Shape out_shape = indices.shape();
  TANDEM_CHECK(out_shape.size() < kMaxDims,
               "[tensor::one_hot] expected indices with at most {} dims, got shape {}",
               kMaxDims - 1, indices.shape());
  out_shape.push_back(num_classes);
  const Tensor idx = index_i64(indices, "one_hot");
  const int64_t n = idx.numel();
  Tensor out = empty(out_shape, DType::I64, indices.device());
  const TensorArg ia = arg_of(idx), oa = arg_of(out);
  detail::dispatch(
      indices.device(), [=] { cpu::one_hot(ia, n, num_classes, oa); },
      [=](void* s) { cuda::one_hot(ia, n, num_classes, oa, s); }, idx, out);
  return out;
}

// ---- losses and attention ----

Tensor cross_entropy(const Tensor& logits, const Tensor& targets, int64_t ignore_index) {
  CrossEntropyOptions options;
  options.ignore_index = ignore_index;
  return cross_entropy(logits, targets, options);
}

Tensor cross_entropy(const Tensor& logits, const Tensor& targets,
                     const CrossEntropyOptions& options) {
  check_defined(logits, "cross_entropy", "logits");
  check_defined(targets, "cross_entropy", "targets");
  TANDEM_CHECK(logits.dim() == 2,
               "[tensor::cross_entropy] expected 2-D logits (N, C), got shape {}", logits.shape());
  TANDEM_CHECK(is_floating(logits.dtype()),
               "[tensor::cross_entropy] expected floating logits, got {}",
               dtype_name(logits.dtype()));
  TANDEM_CHECK(targets.dim() == 1 && targets.size(0) == logits.size(0),
               "[tensor::cross_entropy] expected targets of shape [{}] (logits={}), got {}",
               logits.size(0), logits.shape(), targets.shape());
  TANDEM_CHECK(is_integral(targets.dtype()),
               "[tensor::cross_entropy] expected i64 or i32 targets, got {}",
               dtype_name(targets.dtype()));
  check_same_device(logits, targets, "cross_entropy", "logits", "targets");
  const double eps = options.label_smoothing;
  TANDEM_CHECK(eps >= 0.0 && eps <= 1.0,
               "[tensor::cross_entropy] expected label_smoothing in [0, 1], got {}", eps);
  // Accumulate in f32 (f64 for f64 logits); only the N picked values are cast.
  const DType acc = logits.dtype() == DType::F64 ? DType::F64 : DType::F32;
  const Tensor t64 = cast_if_needed(targets, DType::I64);
  const Tensor valid = ne(t64, static_cast<double>(options.ignore_index));
  // Ignored targets may hold any value (e.g. -100): read class 0 there instead
  // and drop it with the mask, so gather's range check sees only real classes.
  const Tensor safe = where(valid, t64, zeros_like(t64));
  const Tensor logp = log_softmax(logits, 1);
  Tensor row = neg(cast_if_needed(squeeze(gather(logp, 1, unsqueeze(safe, 1)), 1), acc));
  if (eps > 0.0) {
    // The smoothing term: the mean over classes of -logp (a uniform target).
    const Tensor uniform =
        div(neg(sum(cast_if_needed(logp, acc), {1})), static_cast<double>(logits.size(1)));
    row = add(mul(row, 1.0 - eps), mul(uniform, eps));
  }
  // where, not a multiply by the mask: an ignored row's terms may be -inf.
  const Tensor per_row = where(valid, row, 0.0);
  if (options.reduction == Reduction::None) return per_row;
  const Tensor total = sum(per_row);
  if (options.reduction == Reduction::Sum) return total;
  const Tensor count = sum(to(valid, acc));
  // No valid target: total is 0, and dividing by max(count, 1) returns 0, not NaN.
  return div(total, maximum(count, ones_like(count)));
}

AttentionResult scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                             const AttentionOptions& options) {
  constexpr const char* op = "scaled_dot_product_attention";
  check_attention_inputs(q, k, v, op);
  const int64_t B = q.size(0), Hq = q.size(1), Sq = q.size(2), D = q.size(3);
  const int64_t Sk = k.size(2);
  const Device dev = q.device();
  const double scale =
      options.scale.value_or(D > 0 ? 1.0 / std::sqrt(static_cast<double>(D)) : 1.0);

  AttentionResult r;
  if (q.numel() == 0 || Sk == 0) {
    // Nothing to attend to, or no query: a zero (or empty) output, lse = -inf.
    r.out = zeros({B, Hq, Sq, D}, q.dtype(), dev);
    r.lse = full({B, Hq, Sq}, kNegInf, DType::F32, dev);
    if (D == 0 && r.lse.numel() > 0) {
      // D == 0 alone: every score is an empty dot product, 0, so a row's
      // log-sum-exp is log(number of keys it sees) (-inf when none).
      const Tensor qpos =
          unsqueeze(arange(static_cast<double>(options.q_offset),
                           static_cast<double>(options.q_offset + Sq), 1.0, DType::I64, dev),
                    1);
      const Tensor kpos =
          unsqueeze(arange(static_cast<double>(options.k_offset),
                           static_cast<double>(options.k_offset + Sk), 1.0, DType::I64, dev),
                    0);
      Tensor seen = options.causal ? sum(to(le(kpos, qpos), DType::F32), {1})
                                   : full({Sq}, static_cast<double>(Sk), DType::F32, dev);
      if (options.documents) {  // the window of each row of each batch row
        std::vector<int32_t> w = attention_windows(options, B, Sq, Sk, op);
        std::vector<float> n(w.size() / 2);
        for (size_t i = 0; i < n.size(); ++i)
          n[i] = static_cast<float>(w[2 * i + 1] - w[2 * i]);
        seen = from_vector(n, Shape{static_cast<int64_t>(n.size()) / Sq, 1, Sq}, dev);
      }
      copy_(r.lse, log(seen));
    }
    return r;
  }
  // The kernel runs in f32 for 16-bit inputs (f64 for f64), with one rounding
  // of the output at the end.
  const DType ct = q.dtype() == DType::F64 ? DType::F64 : DType::F32;
  const Tensor qc = unit_stride_last(cast_if_needed(q, ct));
  const Tensor kc = unit_stride_last(cast_if_needed(k, ct));
  const Tensor vc = unit_stride_last(cast_if_needed(v, ct));
  const Tensor out = heads_view(empty({B, Sq, Hq, D}, ct, dev));
  r.lse = empty({B, Hq, Sq}, DType::F32, dev);
  const Tensor windows = windows_tensor(options, B, Sq, Sk, dev, op);
  const AttentionArgs args = attention_args(q, k, options, scale, windows);
  const TensorArg qa = arg_of(qc), ka = arg_of(kc), va = arg_of(vc), oa = arg_of(out),
                  la = arg_of(r.lse);
  detail::dispatch(
      dev, [=] { cpu::attention(args, qa, ka, va, oa, la); },
      [=](void* s) { cuda::attention(args, qa, ka, va, oa, la, s); }, qc, kc, vc, out, r.lse,
      windows);
  r.out = cast_if_needed(out, q.dtype());
  return r;
}

std::vector<Tensor> scaled_dot_product_attention_backward(const Tensor& q, const Tensor& k,
                                                          const Tensor& v, const Tensor& out,
                                                          const Tensor& lse, const Tensor& dout,
                                                          const AttentionOptions& options) {
  constexpr const char* op = "scaled_dot_product_attention_backward";
  check_attention_inputs(q, k, v, op);
  check_defined(out, op, "out");
  check_defined(lse, op, "lse");
  check_defined(dout, op, "dout");
  const int64_t B = q.size(0), Hq = q.size(1), Sq = q.size(2), D = q.size(3);
  TANDEM_CHECK(out.shape() == q.shape() && dout.shape() == q.shape(),
               "[tensor::{}] expected out and dout of q's shape {}, got out={}, dout={}", op,
               q.shape(), out.shape(), dout.shape());
  TANDEM_CHECK((lse.shape() == Shape{B, Hq, Sq}),
               "[tensor::{}] expected lse of shape [{}, {}, {}], got {}", op, B, Hq, Sq,
               lse.shape());
  const Device dev = q.device();
  check_same_device(q, out, op, "q", "out");
  check_same_device(q, lse, op, "q", "lse");
  check_same_device(q, dout, op, "q", "dout");
  const int64_t Hkv = k.size(1), Sk = k.size(2);
  const DType ct = q.dtype() == DType::F64 ? DType::F64 : DType::F32;
  if (q.numel() == 0 || k.numel() == 0) {  // no scores: zero (or empty) gradients
    return {zeros_like(q), zeros_like(k), zeros_like(v)};
  }
  const double scale =
      options.scale.value_or(D > 0 ? 1.0 / std::sqrt(static_cast<double>(D)) : 1.0);
  const Tensor qc = unit_stride_last(cast_if_needed(q, ct));
  const Tensor kc = unit_stride_last(cast_if_needed(k, ct));
  const Tensor vc = unit_stride_last(cast_if_needed(v, ct));
  const Tensor oc = unit_stride_last(cast_if_needed(out, ct));
  const Tensor doc = unit_stride_last(cast_if_needed(dout, ct));
  const Tensor lc = contiguous(cast_if_needed(lse, DType::F32));
  // Gradients in the (B, S, H, D) layout the projections' inputs come from.
  const Tensor dq = heads_view(empty({B, Sq, Hq, D}, ct, dev));
  const Tensor dk = heads_view(empty({B, Sk, Hkv, D}, ct, dev));
  const Tensor dv = heads_view(empty({B, Sk, Hkv, D}, ct, dev));
  const Tensor windows = windows_tensor(options, B, Sq, Sk, dev, op);
  const AttentionArgs args = attention_args(q, k, options, scale, windows);
  const TensorArg qa = arg_of(qc), ka = arg_of(kc), va = arg_of(vc), oa = arg_of(oc),
                  la = arg_of(lc), ga = arg_of(doc), dqa = arg_of(dq), dka = arg_of(dk),
                  dva = arg_of(dv);
  detail::dispatch(
      dev, [=] { cpu::attention_backward(args, qa, ka, va, oa, la, ga, dqa, dka, dva); },
      [=](void* s) { cuda::attention_backward(args, qa, ka, va, oa, la, ga, dqa, dka, dva, s); },
      qc, kc, vc, oc, lc, doc, dq, dk, dv, windows);
  return {cast_if_needed(dq, q.dtype()), cast_if_needed(dk, k.dtype()),
          cast_if_needed(dv, v.dtype())};
}

// ---- SwiGLU ----

namespace {
void check_swiglu_operand(const Tensor& a, const Tensor& t, const char* op, const char* name) {
  check_defined(t, op, name);
  TANDEM_CHECK(t.shape() == a.shape(), "[tensor::{}] expected {} of a's shape {}, got {}", op, name,
               a.shape(), t.shape());
  TANDEM_CHECK(t.dtype() == a.dtype(), "[tensor::{}] expected {} of a's dtype {}, got {}", op, name,
               dtype_name(a.dtype()), dtype_name(t.dtype()));
  check_same_device(a, t, op, "a", name);
}
}  // namespace

Tensor swiglu(const Tensor& a, const Tensor& b) {
  check_defined(a, "swiglu", "a");
  TANDEM_CHECK(is_floating(a.dtype()), "[tensor::swiglu] expected a floating a, got {}",
               dtype_name(a.dtype()));
  check_swiglu_operand(a, b, "swiglu", "b");
  const Tensor ac = contiguous(a), bc = contiguous(b);
  Tensor out = empty(a.shape(), a.dtype(), a.device());
  const TensorArg aa = arg_of(ac), ba = arg_of(bc), oa = arg_of(out);
  detail::dispatch(
      a.device(), [=] { cpu::swiglu(aa, ba, oa); }, [=](void* s) { cuda::swiglu(aa, ba, oa, s); },
      ac, bc, out);
  return out;
}

std::pair<Tensor, Tensor> swiglu_backward(const Tensor& a, const Tensor& b, const Tensor& g) {
  check_defined(a, "swiglu_backward", "a");
  TANDEM_CHECK(is_floating(a.dtype()), "[tensor::swiglu_backward] expected a floating a, got {}",
               dtype_name(a.dtype()));
  check_swiglu_operand(a, b, "swiglu_backward", "b");
  check_defined(g, "swiglu_backward", "g");
  TANDEM_CHECK(g.shape() == a.shape(),
               "[tensor::swiglu_backward] expected g of a's shape {}, got {}", a.shape(),
               g.shape());
  check_same_device(a, g, "swiglu_backward", "a", "g");
  const Tensor ac = contiguous(a), bc = contiguous(b);
  const Tensor gc = contiguous(cast_if_needed(g, a.dtype()));
  Tensor da = empty(a.shape(), a.dtype(), a.device());
  Tensor db = empty(a.shape(), a.dtype(), a.device());
  const TensorArg aa = arg_of(ac), ba = arg_of(bc), ga = arg_of(gc), daa = arg_of(da),
                  dba = arg_of(db);
  detail::dispatch(
      a.device(), [=] { cpu::swiglu_backward(aa, ba, ga, daa, dba); },
      [=](void* s) { cuda::swiglu_backward(aa, ba, ga, daa, dba, s); }, ac, bc, gc, da, db);
  return {da, db};
}

// ---- rotary embedding ----

Tensor rotary(const Tensor& x, const Tensor& cos, const Tensor& sin, int64_t seq_dim,
              bool inverse) {
  check_defined(x, "rotary", "x");
  TANDEM_CHECK(x.dim() == 4 && (seq_dim == 1 || seq_dim == 2),
               "[tensor::rotary] expected x of 4 dims, (B, S, H, D) with seq_dim 1 or (B, H, S, "
               "D) with seq_dim 2, got {} with seq_dim {}",
               x.shape(), seq_dim);
  TANDEM_CHECK(is_floating(x.dtype()), "[tensor::rotary] expected a floating x, got {}",
               dtype_name(x.dtype()));
  const int64_t s = x.shape()[static_cast<int>(seq_dim)], d = x.shape()[3];
  TANDEM_CHECK(d % 2 == 0, "[tensor::rotary] expected an even head dim, got {}", d);
  for (const auto& [t, name] : {std::pair{&cos, "cos"}, std::pair{&sin, "sin"}}) {
    check_defined(*t, "rotary", name);
    TANDEM_CHECK(t->shape() == Shape({s, d}),
                 "[tensor::rotary] expected {} of shape ({}, {}) for x of shape {}, got {}", name,
                 s, d, x.shape(), t->shape());
    TANDEM_CHECK(t->dtype() == x.dtype(), "[tensor::rotary] expected {} of x's dtype {}, got {}",
                 name, dtype_name(x.dtype()), dtype_name(t->dtype()));
    check_same_device(x, *t, "rotary", "x", name);
  }
  const Tensor xc = contiguous(x), cc = contiguous(cos), sc = contiguous(sin);
  Tensor out = empty(x.shape(), x.dtype(), x.device());
  if (out.numel() == 0) return out;
  const int64_t inner = seq_dim == 1 ? x.shape()[2] : 1;
  const TensorArg xa = arg_of(xc), ca = arg_of(cc), sa = arg_of(sc), oa = arg_of(out);
  detail::dispatch(
      x.device(), [=] { cpu::rotary(xa, ca, sa, s, inner, inverse, oa); },
      [=](void* st) { cuda::rotary(xa, ca, sa, s, inner, inverse, oa, st); }, xc, cc, sc, out);
  return out;
}

}  // namespace tandem::ops

namespace tandem {

std::shared_ptr<const DocumentBounds> DocumentBounds::make(
    std::vector<std::vector<int64_t>> cumulative) {
  TANDEM_CHECK(!cumulative.empty(),
               "[tensor::DocumentBounds] expected one list of bounds, or one per batch row, got "
               "none");
  for (size_t b = 0; b < cumulative.size(); ++b) {
    const std::vector<int64_t>& cu = cumulative[b];
    TANDEM_CHECK(cu.size() >= 2 && cu.front() == 0,
                 "[tensor::DocumentBounds] expected row {}'s bounds to start at 0 and hold at "
                 "least one document ({{0, ..., total}}), got {}",
                 b, fmt::join(cu, ", "));
    for (size_t d = 1; d < cu.size(); ++d) {
      TANDEM_CHECK(cu[d] >= cu[d - 1],
                   "[tensor::DocumentBounds] expected row {}'s bounds to never decrease, got {} "
                   "after {}",
                   b, cu[d], cu[d - 1]);
    }
  }
  auto bounds = std::make_shared<DocumentBounds>();
  bounds->cumulative = std::move(cumulative);
  return bounds;
}

std::shared_ptr<const DocumentBounds> DocumentBounds::from_lengths(
    const std::vector<std::vector<int64_t>>& lengths) {
  std::vector<std::vector<int64_t>> cumulative;
  for (const std::vector<int64_t>& row : lengths) {
    std::vector<int64_t> cu{0};
    for (int64_t n : row) {
      TANDEM_CHECK(n >= 0, "[tensor::DocumentBounds] expected document lengths >= 0, got {}", n);
      cu.push_back(cu.back() + n);
    }
    cumulative.push_back(std::move(cu));
  }
  return make(std::move(cumulative));
}

}  // namespace tandem
