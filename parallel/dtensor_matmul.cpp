// Sharding rules of the DTensor ops that contract over a dim: matmul, linear
// (a matmul with the weight transposed) and embedding (a table lookup, in
// effect a matmul of one-hot indices with the table, so a table sharded along
// the vocabulary gives a Partial sum as Shard(K) does). dtensor_ops.cpp has
// the elementwise, reduction and shape rules; dtensor_ops.h the table of all.
#include "tandem/autograd/ops.h"
#include "tandem/parallel/dtensor_ops.h"
#include "tandem/parallel/dtensor_rules.h"
#include "tandem/runtime/error.h"

namespace tandem {

using dtensor_detail::check_same_mesh;
using dtensor_detail::move;
using dtensor_detail::out_dim;
using dtensor_detail::with_f;

DTensor matmul(const DTensor& a0, const DTensor& b0) {
  check_same_mesh(a0, b0, "matmul");
  DTensor a = a0, b = b0;
  const int ra = a.shape().size(), rb = b.shape().size();
  TANDEM_CHECK(ra >= 2 && rb >= 2,
               "[parallel::matmul] expected operands of rank >= 2, got {} and {}", a.shape(),
               b.shape());
  // Global output shape.
  Shape ba, bb;
  for (int i = 0; i < ra - 2; ++i)
    ba.push_back(a.shape()[i]);
  for (int i = 0; i < rb - 2; ++i)
    bb.push_back(b.shape()[i]);
  Shape shape = broadcast_shapes(ba, bb, "matmul");
  shape.push_back(a.shape()[ra - 2]);
  shape.push_back(b.shape()[rb - 1]);
  const int ro = shape.size();
  Placements out(static_cast<size_t>(a.mesh().ndim()), Replicate());
  for (int m = 0; m < a.mesh().ndim(); ++m) {
    for (int attempt = 0; attempt < 4; ++attempt) {
      const Placement pa = a.placements()[m], pb = b.placements()[m];
      const bool a_k = pa.is_shard(ra - 1), b_k = pb.is_shard(rb - 2), b_n = pb.is_shard(rb - 1);
      const bool a_rows = pa.is_shard() && !a_k;  // a batch dim or M
      const bool b_batch = pb.is_shard() && !b_k && !b_n;
      if (pa.is_replicate() && pb.is_replicate()) {
        out[m] = Replicate();
      } else if (a_k && b_k) {
        out[m] = Partial();
      } else if (a_k && pb.is_replicate()) {
        b = move(b, m, Shard(rb - 2), "matmul");
        continue;
      } else if (b_k && pa.is_replicate()) {
        a = move(a, m, Shard(ra - 1), "matmul");
        continue;
      } else if (a_rows && pb.is_replicate() && (pa.dim == ra - 2 || rb == 2)) {
        out[m] = Shard(out_dim(pa.dim, ra, ro));
      } else if (a_rows && b_batch && out_dim(pa.dim, ra, ro) == out_dim(pb.dim, rb, ro)) {
        out[m] = Shard(out_dim(pa.dim, ra, ro));
      } else if (b_n && pa.is_replicate()) {
        out[m] = Shard(ro - 1);
      } else if (pa.is_partial() && pb.is_replicate() && pa.op == RedOp::Sum) {
        out[m] = pa;
      } else if (pb.is_partial() && pa.is_replicate() && pb.op == RedOp::Sum) {
        out[m] = pb;
      } else {
        // No rule: gather b first (it is usually the smaller weight), then a.
        if (!pb.is_replicate()) {
          b = move(b, m, Replicate(), "matmul");
        } else {
          a = move(a, m, Replicate(), "matmul");
        }
        continue;
      }
      break;
    }
  }
  Tensor local = tandem::matmul(with_f(a, out), with_f(b, out));
  return DTensor::make(local, a.mesh(), out, shape);
}

DTensor linear(const DTensor& x, const DTensor& w, const DTensor& b) {
  DTensor y = matmul(x, transpose(w, 0, 1));
  return b.defined() ? add(y, b) : y;
}

DTensor embedding(const DTensor& weight, const DTensor& indices0) {
  check_same_mesh(weight, indices0, "embedding");
  DTensor idx = indices0;
  Shape shape = idx.shape();
  shape.push_back(weight.shape()[1]);
  const int ro = shape.size();
  Placements out(static_cast<size_t>(weight.mesh().ndim()), Replicate());
  Tensor w = weight.to_local();
  Tensor local_idx = idx.to_local();
  Tensor mask;
  for (int m = 0; m < weight.mesh().ndim(); ++m) {
    const Placement pw = weight.placements()[m];
    if (pw.is_replicate()) {
      TANDEM_CHECK(!idx.placements()[m].is_partial(),
                   "[parallel::embedding] expected indices that are not Partial, got {}",
                   idx.placements()[m].str());
      out[m] = idx.placements()[m];
    } else if (pw.is_shard(1) && idx.placements()[m].is_replicate()) {
      out[m] = Shard(ro - 1);
    } else if (pw.is_shard(0) && idx.placements()[m].is_replicate()) {
      // Vocab-parallel: this rank owns rows [start, start + len); others give 0.
      auto [start, len] =
          chunk_range(weight.shape()[0], weight.mesh().size(m), weight.mesh().coordinate()[m]);
      Tensor shifted = ops::sub(ops::to(local_idx, DType::I64), static_cast<double>(start));
      Tensor owned = ops::mul(ops::to(ops::ge(shifted, 0.0), DType::I64),
                              ops::to(ops::lt(shifted, static_cast<double>(len)), DType::I64));
      local_idx = ops::mul(shifted, owned);
      mask = ops::to(ops::unsqueeze(owned, -1), w.dtype());
      out[m] = Partial();
    } else {
      TANDEM_FAIL(
          "[parallel::embedding] expected a Replicate, Shard(0) or Shard(1) table with "
          "Replicate indices (or a Replicate table), got table {} and indices {} on mesh "
          "dim {}",
          pw.str(), idx.placements()[m].str(), m);
    }
  }
  Tensor wl = with_f(DTensor::make(w, weight.mesh(), weight.placements(), weight.shape()), out);
  Tensor local = tandem::embedding(wl, local_idx);
  if (mask.defined()) local = tandem::mul(local, mask);
  return DTensor::make(local, weight.mesh(), out, shape);
}

}  // namespace tandem
