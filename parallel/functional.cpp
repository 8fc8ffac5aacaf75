#include "tandem/parallel/functional.h"

#include <algorithm>

#include "tandem/autograd/function.h"
#include "tandem/runtime/error.h"
#include "tandem/tensor/ops.h"

namespace tandem {
namespace {

std::vector<int64_t> even(int64_t extent, int n, const char* op, int64_t dim) {
  TANDEM_CHECK(extent % n == 0,
               "[parallel::{}] expected dim {} ({}) divisible by the group size {} (pass lengths "
               "for uneven splits)",
               op, dim, extent, n);
  return std::vector<int64_t>(static_cast<size_t>(n), extent / n);
}

Tensor pad_to(const Tensor& x, int64_t dim, int64_t size) {
  if (x.shape()[dim] == size) return x;
  Shape pad = x.shape();
  pad[dim] = size - x.shape()[dim];
  return ops::cat({x, ops::zeros(pad, x.dtype(), x.device())}, dim);
}

struct AllToAllDims final : Function {
  ProcessGroupPtr group;
  int64_t scatter_dim, gather_dim;
  std::vector<int64_t> scatter_lengths, gather_lengths;
  const char* name() const override { return "AllToAllBackward"; }
  std::vector<Tensor> forward(FunctionCtx&, const std::vector<Tensor>& in) override {
    return {launch_all_to_all_dims(in[0], group, scatter_dim, gather_dim, scatter_lengths,
                                   gather_lengths)
                .wait()};
  }
  std::vector<Tensor> backward(FunctionCtx&, const std::vector<Tensor>& g) override {
    return {launch_all_to_all_dims(g[0], group, gather_dim, scatter_dim, gather_lengths,
                                   scatter_lengths)
                .wait()};
  }
};

struct AllGatherDim final : Function {
  ProcessGroupPtr group;
  int64_t dim;
  std::vector<int64_t> lengths;
  const char* name() const override { return "AllGatherBackward"; }
  std::vector<Tensor> forward(FunctionCtx&, const std::vector<Tensor>& in) override {
    return {launch_all_gather_dim(in[0], group, dim, lengths).wait()};
  }
  std::vector<Tensor> backward(FunctionCtx&, const std::vector<Tensor>& g) override {
    return {reduce_scatter_dim(g[0], group, dim, lengths)};
  }
};

struct ReduceScatterDim final : Function {
  ProcessGroupPtr group;
  int64_t dim;
  std::vector<int64_t> lengths;
  const char* name() const override { return "ReduceScatterBackward"; }
  std::vector<Tensor> forward(FunctionCtx&, const std::vector<Tensor>& in) override {
    const int n = group->size(), me = group->rank();
    const int64_t block = *std::max_element(lengths.begin(), lengths.end());
    std::vector<Tensor> pieces;
    int64_t offset = 0;
    for (int r = 0; r < n; ++r) {
      pieces.push_back(pad_to(ops::narrow(in[0], dim, offset, lengths[r]), dim, block));
      offset += lengths[r];
    }
    WorkPtr w =
        group->reduce_scatter(ops::cat(pieces, dim), {RedOp::Sum, dim, "reduce_scatter_dim"});
    w->wait();
    return {ops::contiguous(ops::narrow(w->result(), dim, 0, lengths[me]))};
  }
  std::vector<Tensor> backward(FunctionCtx&, const std::vector<Tensor>& g) override {
    return {launch_all_gather_dim(g[0], group, dim, lengths).wait()};
  }
};

}  // namespace

Tensor PendingTensor::wait() {
  work->wait();
  return finish(work->result());
}

std::vector<int64_t> gather_lengths(const Tensor& x, const ProcessGroupPtr& group, int64_t dim) {
  int d = wrap_dim(dim, x.dim(), "gather_lengths");
  WorkPtr w = group->all_gather(
      ops::full(Shape{1}, static_cast<double>(x.shape()[d]), DType::I64, x.device()),
      {0, "lengths"});
  w->wait();
  return w->result().to_vector<int64_t>();
}

PendingTensor launch_all_to_all_dims(const Tensor& x, const ProcessGroupPtr& group,
                                     int64_t scatter_dim, int64_t gather_dim,
                                     const std::vector<int64_t>& scatter_lengths_in,
                                     const std::vector<int64_t>& gather_lengths_in) {
  const int n = group->size(), me = group->rank();
  const int sd = wrap_dim(scatter_dim, x.dim(), "all_to_all_dims");
  const int gd = wrap_dim(gather_dim, x.dim(), "all_to_all_dims");
  TANDEM_CHECK(sd != gd,
               "[parallel::all_to_all_dims] expected different scatter and gather dims, "
               "got {} twice",
               sd);
  std::vector<int64_t> sl = scatter_lengths_in.empty()
                                ? even(x.shape()[sd], n, "all_to_all_dims", sd)
                                : scatter_lengths_in;
  std::vector<int64_t> gl = gather_lengths_in.empty()
                                ? std::vector<int64_t>(static_cast<size_t>(n), x.shape()[gd])
                                : gather_lengths_in;
  TANDEM_CHECK(static_cast<int>(sl.size()) == n && static_cast<int>(gl.size()) == n &&
                   gl[me] == x.shape()[gd],
               "[parallel::all_to_all_dims] expected {} lengths each and this rank's gather "
               "length {} to match its tensor {}, got {} scatter / {} gather lengths",
               n, me < static_cast<int>(gl.size()) ? gl[me] : -1, x.shape(), sl.size(), gl.size());
  int64_t total = 0;
  for (int64_t v : sl)
    total += v;
  TANDEM_CHECK(total == x.shape()[sd],
               "[parallel::all_to_all_dims] expected scatter lengths summing to {} (dim {} of {}), "
               "got {}",
               x.shape()[sd], sd, x.shape(), total);
  // Scatter dim first; then each destination's piece is a contiguous run.
  Tensor moved = ops::contiguous(ops::transpose(x, 0, sd));
  const int gpos = gd == 0 ? sd : gd;  // where the gather dim sits after the swap
  const int64_t per_row = x.shape()[sd] > 0 ? moved.numel() / x.shape()[sd] : 0;
  int64_t other = 1;  // elements per (scatter row, gather element), excluding both dims
  for (int i = 1; i < moved.dim(); ++i) {
    if (i != gpos) other *= moved.shape()[i];
  }
  std::vector<int64_t> in_splits, out_splits;
  for (int r = 0; r < n; ++r) {
    in_splits.push_back(sl[r] * per_row);
    out_splits.push_back(sl[me] * gl[r] * other);
  }
  WorkPtr w = group->all_to_all_single(ops::reshape(moved, Shape{-1}),
                                       {in_splits, out_splits, "all_to_all_dims"});
  Shape piece = moved.shape();
  const int64_t my_rows = sl[me];
  return {w, [=](const Tensor& flat) {
            std::vector<Tensor> parts;
            int64_t offset = 0;
            for (int r = 0; r < n; ++r) {
              Shape shape = piece;
              shape[0] = my_rows;
              shape[gpos] = gl[r];
              parts.push_back(ops::reshape(ops::narrow(flat, 0, offset, out_splits[r]), shape));
              offset += out_splits[r];
            }
            return ops::contiguous(ops::transpose(ops::cat(parts, gpos), 0, sd));
          }};
}

PendingTensor launch_all_gather_dim(const Tensor& x, const ProcessGroupPtr& group, int64_t dim,
                                    const std::vector<int64_t>& lengths_in) {
  const int n = group->size();
  const int d = wrap_dim(dim, x.dim(), "all_gather_dim");
  std::vector<int64_t> lengths =
      lengths_in.empty() ? std::vector<int64_t>(static_cast<size_t>(n), x.shape()[d]) : lengths_in;
  TANDEM_CHECK(static_cast<int>(lengths.size()) == n && lengths[group->rank()] == x.shape()[d],
               "[parallel::all_gather_dim] expected {} lengths with this rank's equal to its "
               "extent {} (dim {} of {}), got {} lengths",
               n, x.shape()[d], d, x.shape(), lengths.size());
  const int64_t block = *std::max_element(lengths.begin(), lengths.end());
  WorkPtr w = group->all_gather(pad_to(x, d, block), {d, "all_gather_dim"});
  return {w, [=](const Tensor& y) {
            bool even_lengths =
                std::all_of(lengths.begin(), lengths.end(), [&](int64_t l) { return l == block; });
            if (even_lengths) return y;
            std::vector<Tensor> parts;
            for (int r = 0; r < n; ++r)
              parts.push_back(ops::narrow(y, d, r * block, lengths[r]));
            return ops::cat(parts, d);
          }};
}

Tensor all_to_all_dims(const Tensor& x, const ProcessGroupPtr& group, int64_t scatter_dim,
                       int64_t gather_dim, std::vector<int64_t> scatter_lengths,
                       std::vector<int64_t> gather_lengths) {
  auto f = std::make_shared<AllToAllDims>();
  f->group = group;
  f->scatter_dim = wrap_dim(scatter_dim, x.dim(), "all_to_all_dims");
  f->gather_dim = wrap_dim(gather_dim, x.dim(), "all_to_all_dims");
  const int n = group->size();
  f->scatter_lengths = scatter_lengths.empty()
                           ? even(x.shape()[f->scatter_dim], n, "all_to_all_dims", f->scatter_dim)
                           : scatter_lengths;
  f->gather_lengths = gather_lengths.empty()
                          ? std::vector<int64_t>(static_cast<size_t>(n), x.shape()[f->gather_dim])
                          : gather_lengths;
  return Function::apply(f, {x})[0];
}

Tensor all_gather_dim(const Tensor& x, const ProcessGroupPtr& group, int64_t dim,
                      std::vector<int64_t> lengths) {
  auto f = std::make_shared<AllGatherDim>();
  f->group = group;
  f->dim = wrap_dim(dim, x.dim(), "all_gather_dim");
  f->lengths = lengths.empty()
                   ? std::vector<int64_t>(static_cast<size_t>(group->size()), x.shape()[f->dim])
                   : lengths;
  return Function::apply(f, {x})[0];
}

Tensor reduce_scatter_dim(const Tensor& x, const ProcessGroupPtr& group, int64_t dim,
                          std::vector<int64_t> lengths) {
  auto f = std::make_shared<ReduceScatterDim>();
  f->group = group;
  f->dim = wrap_dim(dim, x.dim(), "reduce_scatter_dim");
  f->lengths = lengths.empty()
                   ? even(x.shape()[f->dim], group->size(), "reduce_scatter_dim", f->dim)
                   : lengths;
  int64_t total = 0;
  for (int64_t l : f->lengths)
    total += l;
  TANDEM_CHECK(
      total == x.shape()[f->dim],
      "[parallel::reduce_scatter_dim] expected lengths summing to {} (dim {} of {}), got {}",
      x.shape()[f->dim], f->dim, x.shape(), total);
  return Function::apply(f, {x})[0];
}

}  // namespace tandem
