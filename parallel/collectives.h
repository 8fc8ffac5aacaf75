// Collectives on local tensors along any dim, with uneven lengths: the one
// home of the plumbing that redistribute, context parallelism and expert
// parallelism share (DESIGN §5-§8).
//
// Three layers:
//
//   launch_*          start a collective now and return a PendingTensor:
//                     the work in flight and the finish that turns its raw
//                     buffer into the caller's tensor. Not differentiable.
//   all_to_all_dims,  the differentiable forms, each with its gradient
//   all_gather_dim,   convention below; they wait before returning.
//   reduce_scatter_dim
//   Exchange          one collective split into Open/Launch/Wait autograd
//                     nodes, so that a caller can issue it (in forward and in
//                     backward) inside a window of its choosing while other
//                     work runs: Note [Exchange windows].
//
// Lengths: `lengths[r]` is rank r's extent of the dim (empty = equal extents,
// or an even split where the dim is being cut). Every rank passes the same
// lists. Any length may be zero: an empty shard still takes part.
//
// Gradient conventions of the differentiable forms:
//   all_to_all_dims    forward: cut `scatter_dim` into pieces of
//                      send_lengths, send piece j to rank j, join what
//                      arrives along `gather_dim` in rank order (piece from r
//                      has extent recv_lengths[r] there). Gradient: the
//                      reverse all-to-all (scatter gather_dim with
//                      recv_lengths, gather scatter_dim with send_lengths).
//   all_gather_dim     forward: every rank's tensor joined along `dim`.
//                      Gradient: reduce-scatter (sum), since every rank's
//                      consumers contributed to every block.
//   reduce_scatter_dim forward: sum over ranks, keep this rank's block of
//                      `dim`. Gradient: all-gather.
//
// Note [One copy per collective]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Backends move flat buffers along dim 0. A launcher therefore packs the
// local tensor into the one flat buffer the backend sends (skipped when the
// pieces already are contiguous runs of it: every dim before the cut has
// extent 1 and the tensor is contiguous) and unpacks the received buffer with
// one strided copy into the result (skipped on the same condition for the
// joined dim, where the result is a reshape of the buffer). Padding for
// uneven lengths happens inside the pack, never as a separate cat.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tandem/comm/process_group.h"
#include "tandem/tensor/tensor.h"

namespace tandem {

// `x` with zeros appended along `dim` up to extent `size` (x itself when it
// has that extent already).
Tensor pad_dim(const Tensor& x, int64_t dim, int64_t size);

// A collective in flight.
struct PendingTensor {
  WorkPtr work;
  std::function<Tensor(const Tensor&)> finish;  // applied to work->result(); empty: as is

  bool launched() const { return work != nullptr; }
  bool ready() const;
  // Asks the backend to move the data while the caller goes on computing,
  // with no thread waiting on it (Note [Progress without a waiter]).
  void progress_in_background() const;
  // The raw result buffer, before it is filled: for hooks that pass it on
  // without reading it (Note [Exchange windows]).
  Tensor in_flight() const;
  // Waits, then returns finish(raw result).
  Tensor wait();
};

PendingTensor launch_all_gather(const Tensor& x, const ProcessGroupPtr& group, int64_t dim,
                                std::vector<int64_t> lengths = {},
                                const std::string& tag = "all_gather_dim");
PendingTensor launch_reduce_scatter(const Tensor& x, const ProcessGroupPtr& group, int64_t dim,
                                    std::vector<int64_t> lengths = {}, RedOp op = RedOp::Sum,
                                    const std::string& tag = "reduce_scatter_dim");
// scatter_dim may equal gather_dim (rows to and from every rank, as expert
// parallelism sends them); recv_lengths are then required.
PendingTensor launch_all_to_all(const Tensor& x, const ProcessGroupPtr& group, int64_t scatter_dim,
                                int64_t gather_dim, std::vector<int64_t> send_lengths = {},
                                std::vector<int64_t> recv_lengths = {},
                                const std::string& tag = "all_to_all_dims");
PendingTensor launch_all_reduce(const Tensor& x, const ProcessGroupPtr& group,
                                RedOp op = RedOp::Sum, const std::string& tag = "all_reduce");

Tensor all_to_all_dims(const Tensor& x, const ProcessGroupPtr& group, int64_t scatter_dim,
                       int64_t gather_dim, std::vector<int64_t> send_lengths = {},
                       std::vector<int64_t> recv_lengths = {});
Tensor all_gather_dim(const Tensor& x, const ProcessGroupPtr& group, int64_t dim,
                      std::vector<int64_t> lengths = {});
Tensor reduce_scatter_dim(const Tensor& x, const ProcessGroupPtr& group, int64_t dim,
                          std::vector<int64_t> lengths = {});

// Every rank's extent of `dim` (one small blocking all_gather).
std::vector<int64_t> gather_lengths(const Tensor& x, const ProcessGroupPtr& group, int64_t dim);

// Note [Exchange windows]
// ~~~~~~~~~~~~~~~~~~~~~~~
// A dual-pipe window pairs one thread's collectives with the other thread's
// compute (DESIGN §8), and asynchronous context parallelism issues a
// collective as soon as its input exists and waits for it where its result is
// needed. Either way a collective must be *issued* at one point and *waited*
// at a later one, in backward as in forward. One differentiable collective is
// therefore three nodes:
//
//   x → Open → [work or hooks] → Launch → [work or hooks] → Wait → y
//
//               forward                 backward
//   Open        identity                wait for the reverse collective
//   Launch      issue the collective    issue the reverse collective
//               (or adopt the one that  on the gradient of y
//               exchange_start issued)
//   Wait        wait for it, finish     identity
//
// Both launches ask for progress in the background, so the window's compute
// overlaps the copies on every backend (Note [Progress without a waiter]).
//
// Launch returns the collective's raw buffer before it is filled (and its
// backward the reverse one's); only code that passes it on without reading
// it may sit between Launch and Wait (forward) or Launch and Open (backward).
// Nodes recorded later run earlier in backward, so recording every Launch and
// Wait of a group of exchanges after all of their Opens issues every reverse
// collective before the first Open waits.
//
// The shared Exchange is the per-call state (launchers, pending works); the
// nodes of that forward own it, so concurrent forwards on two threads never
// share one (Note [MoE per-call state]). All three nodes are recorded
// whenever grad mode is on, even on a rank whose input does not require
// grad, so every rank runs the same collectives in backward.
struct Exchange {
  using Launcher = std::function<PendingTensor(const Tensor&)>;
  Launcher forward;   // x → y
  Launcher backward;  // dy → dx
  std::string what;   // names the exchange in errors
  PendingTensor forward_pending, backward_pending;
};

Tensor exchange_open(const std::shared_ptr<Exchange>& ex, const Tensor& x);
// Issues the forward collective on `x` now, without recording a node: the
// Launch recorded later adopts it.
void exchange_start(const std::shared_ptr<Exchange>& ex, const Tensor& x);
Tensor exchange_launch(const std::shared_ptr<Exchange>& ex, const Tensor& x);
Tensor exchange_wait(const std::shared_ptr<Exchange>& ex, const Tensor& in_flight);
// Waits for a collective exchange_start issued whose result nobody reads, and
// forgets it; no node is recorded, so the exchange's Open passes its gradient
// through.
void exchange_drop(const std::shared_ptr<Exchange>& ex);

}  // namespace tandem
