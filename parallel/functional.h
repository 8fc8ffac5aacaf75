// Differentiable collectives on local tensors, for layers that manage their
// own communication (context parallelism, expert parallelism). Each states its
// gradient convention:
//
//   all_to_all_dims   forward: split `scatter_dim` into per-rank pieces, send
//                     piece j to rank j, concatenate what arrives along
//                     `gather_dim` in rank order. Gradient: the reverse
//                     all-to-all (scatter gather_dim, gather scatter_dim).
//   all_gather_dim    forward: concatenate every rank's tensor along `dim`.
//                     Gradient: reduce-scatter (sum) — every rank's consumers
//                     contributed to every block.
//   reduce_scatter_dim  forward: sum over ranks, keep this rank's block of
//                     `dim`. Gradient: all-gather.
//
// Lengths may be uneven: `scatter_lengths[j]` is the extent of `scatter_dim`
// sent to rank j, `gather_lengths[r]` the extent of `gather_dim` on rank r
// (empty = even split / equal extents).
#pragma once

#include <vector>

#include "tandem/comm/process_group.h"
#include "tandem/tensor/tensor.h"

namespace tandem {

Tensor all_to_all_dims(const Tensor& x, const ProcessGroupPtr& group, int64_t scatter_dim,
                       int64_t gather_dim, std::vector<int64_t> scatter_lengths = {},
                       std::vector<int64_t> gather_lengths = {});
Tensor all_gather_dim(const Tensor& x, const ProcessGroupPtr& group, int64_t dim,
                      std::vector<int64_t> lengths = {});
Tensor reduce_scatter_dim(const Tensor& x, const ProcessGroupPtr& group, int64_t dim,
                          std::vector<int64_t> lengths = {});

// Non-differentiable building blocks (launch now, finish after wait()).
struct PendingTensor {
  WorkPtr work;
  std::function<Tensor(const Tensor&)> finish;
  Tensor wait();
};
PendingTensor launch_all_to_all_dims(const Tensor& x, const ProcessGroupPtr& group,
                                     int64_t scatter_dim, int64_t gather_dim,
                                     const std::vector<int64_t>& scatter_lengths,
                                     const std::vector<int64_t>& gather_lengths);
PendingTensor launch_all_gather_dim(const Tensor& x, const ProcessGroupPtr& group, int64_t dim,
                                    const std::vector<int64_t>& lengths);

// Every rank's extent of `dim` (one small all_gather).
std::vector<int64_t> gather_lengths(const Tensor& x, const ProcessGroupPtr& group, int64_t dim);

}  // namespace tandem
