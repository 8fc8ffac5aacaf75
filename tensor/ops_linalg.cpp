// Front end: matmul (numpy semantics) and the BLAS thread setting.
//
// Operands reach the GEMM kernel without copies whenever one of their last two
// dims has unit stride (a transposed view becomes trans_a/trans_b) and their
// batch dims collapse to one stride (broadcast batch dims get stride 0).
// Otherwise the operand is made contiguous, or the batch is issued as several
// GEMM calls.
#include <cblas.h>

#include <algorithm>
#include <mutex>

#include "tandem/tensor/cpu/parallel.h"
#include "tandem/tensor/dispatch.h"
#include "tandem/tensor/ops.h"

namespace tandem::ops {

using detail::dispatch;

namespace {

struct MatrixOperand {
  Tensor t;    // possibly a strided view
  bool trans;  // stored as the transpose of the logical (rows, cols)
  int64_t ld;  // row stride of the stored matrix
};

// Makes the last two dims of `t` usable by GEMM: unit stride along one of them.
MatrixOperand as_matrix(const Tensor& t) {
  int n = t.dim();
  int64_t rows = t.shape()[n - 2], cols = t.shape()[n - 1];
  int64_t rs = t.strides()[n - 2], cs = t.strides()[n - 1];
  // BLAS needs unit stride along one dim and a leading dim covering the other.
  if ((cs == 1 || cols == 1) && (rs >= cols || rows == 1)) {
    return {t, false, std::max<int64_t>({rs, cols, 1})};
  }
  if ((rs == 1 || rows == 1) && (cs >= rows || cols == 1)) {
    return {t, true, std::max<int64_t>({cs, rows, 1})};
  }
  Tensor c = contiguous(t);
  return {c, false, cols};
}

// OpenBLAS starts with one thread per core. It always runs single-threaded
// inside the CPU kernels' own chunks (Note [CPU kernel threads] in
// tensor/cpu/parallel.h), applied before the first product.
void apply_default_threads() {
  static std::once_flag once;
  std::call_once(once, [] { openblas_set_num_threads(1); });
}

// The batch dims of `t`: all but the last two.
Shape extract_batch_dims(const Tensor& t) {
  Shape batch;
  for (int i = 0; i < t.dim() - 2; ++i)
    batch.push_back(t.shape()[i]);
  return batch;
}

// `batch` followed by the matrix dims (rows, cols).
Shape append_matrix_dims(Shape batch, int64_t rows, int64_t cols) {
  batch.push_back(rows);
  batch.push_back(cols);
  return batch;
}

// One batch stride per operand, where the batch dims collapse to one.
struct BatchStrides {
  bool single = true;
  int64_t a = 0, b = 0;
};

// Collapse the batch dims of both operands to one stride each if possible.
BatchStrides collapse_batch(const Shape& batch, const MatrixOperand& ma, const MatrixOperand& mb) {
  const int nb = batch.size();
  BatchStrides s;
  int64_t expect_a = -1, expect_b = -1;
  for (int i = nb - 1; i >= 0; --i) {
    if (batch[i] == 1) continue;
    int64_t da = ma.t.strides()[i], db = mb.t.strides()[i];
    if (expect_a < 0) {
      s.a = da;
      s.b = db;
    } else if (da != expect_a || db != expect_b) {
      s.single = false;
      break;
    }
    expect_a = da * batch[i];
    expect_b = db * batch[i];
  }
  return s;
}

// One GEMM call of `batch_count` products, its operands and output starting
// at the given element offsets.
void issue_gemm(const GemmArgs& g, int64_t batch_count, const MatrixOperand& ma,
                const MatrixOperand& mb, const Tensor& out, int64_t a_off, int64_t b_off,
                int64_t c_off) {
  const size_t es = dtype_size(g.dtype);
  GemmArgs call = g;
  call.batch = batch_count;
  call.a = static_cast<const char*>(ma.t.raw_data()) + a_off * static_cast<int64_t>(es);
  call.b = static_cast<const char*>(mb.t.raw_data()) + b_off * static_cast<int64_t>(es);
  call.c = static_cast<char*>(out.raw_data()) + c_off * static_cast<int64_t>(es);
  dispatch(
      out.device(), [=] { cpu::gemm(call); }, [=](void* s) { cuda::gemm(call, s); }, ma.t, mb.t,
      out);
}

// The products of every batch element: one batched GEMM call when the batch
// layout collapses, else one call per element.
void issue_batch(GemmArgs g, const Shape& batch, const MatrixOperand& ma, const MatrixOperand& mb,
                 const Tensor& out) {
  const int nb = batch.size();
  const int64_t count = batch.numel();
  const BatchStrides strides = collapse_batch(batch, ma, mb);
  if (strides.single) {
    g.stride_a = strides.a;
    g.stride_b = strides.b;
    issue_gemm(g, count, ma, mb, out, 0, 0, 0);
    return;
  }
  // Uncollapsible batch layout: one GEMM per batch element.
  for (int64_t i = 0; i < count; ++i) {
    int64_t rem = i, a_off = 0, b_off = 0;
    for (int d = nb - 1; d >= 0; --d) {
      int64_t idx = rem % batch[d];
      rem /= batch[d];
      a_off += idx * ma.t.strides()[d];
      b_off += idx * mb.t.strides()[d];
    }
    issue_gemm(g, 1, ma, mb, out, a_off, b_off, i * g.m * g.n);
  }
}

}  // namespace

void set_num_threads(int n) {
  TANDEM_CHECK(n >= 1, "[tensor::set_num_threads] expected n >= 1, got {}", n);
  apply_default_threads();
  cpu::set_num_threads(n);
}

int num_threads() {
  return cpu::num_threads();
}

const char* cpu_vector_isa() {
  return cpu::vector_isa();
}

Tensor matmul(const Tensor& a_in, const Tensor& b_in) {
  apply_default_threads();
  TANDEM_CHECK(a_in.defined() && b_in.defined(), "[tensor::matmul] expected defined tensors");
  TANDEM_CHECK(a_in.dim() >= 1 && b_in.dim() >= 1,
               "[tensor::matmul] expected operands of rank >= 1, got {} and {}", a_in.shape(),
               b_in.shape());
  TANDEM_CHECK(a_in.device() == b_in.device(),
               "[tensor::matmul] expected operands on one device, got {} and {}", a_in.device(),
               b_in.device());
  DType dt = promote(a_in.dtype(), b_in.dtype());
  TANDEM_CHECK(is_floating(dt), "[tensor::matmul] expected floating operands, got {} and {}",
               dtype_name(a_in.dtype()), dtype_name(b_in.dtype()));
  Tensor a = to(a_in, dt), b = to(b_in, dt);
  const bool a_vec = a.dim() == 1, b_vec = b.dim() == 1;
  if (a_vec) a = unsqueeze(a, 0);
  if (b_vec) b = unsqueeze(b, 1);
  const int64_t m = a.shape()[a.dim() - 2], k = a.shape()[a.dim() - 1];
  const int64_t n = b.shape()[b.dim() - 1];
  TANDEM_CHECK(b.shape()[b.dim() - 2] == k,
               "[tensor::matmul] expected a.shape[-1] == b.shape[-2], got {} vs {} (a={}, b={})", k,
               b.shape()[b.dim() - 2], a_in.shape(), b_in.shape());

  Shape batch = broadcast_shapes(extract_batch_dims(a), extract_batch_dims(b), "matmul");
  MatrixOperand ma = as_matrix(expand(a, append_matrix_dims(batch, m, k)));
  MatrixOperand mb = as_matrix(expand(b, append_matrix_dims(batch, k, n)));
  Tensor out = empty(append_matrix_dims(batch, m, n), dt, a.device());

  GemmArgs g{};
  g.dtype = dt;
  g.m = m;
  g.n = n;
  g.k = k;
  g.lda = ma.ld;
  g.ldb = mb.ld;
  g.ldc = n;
  g.trans_a = ma.trans;
  g.trans_b = mb.trans;
  g.stride_c = m * n;
  if (out.numel() > 0 && k == 0) {
    fill_(out, 0.0);  // an empty sum
  } else if (out.numel() > 0) {
    issue_batch(g, batch, ma, mb, out);
  }
  if (a_vec) out = squeeze(out, -2);
  if (b_vec) out = squeeze(out, -1);
  return out;
}

}  // namespace tandem::ops
