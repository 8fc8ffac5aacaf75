#include "tandem/parallel/collectives.h"

#include <algorithm>
#include <numeric>

#include <fmt/ranges.h>

#include "tandem/autograd/function.h"
#include "tandem/runtime/error.h"
#include "tandem/tensor/ops.h"

namespace tandem {
namespace {

int64_t sum_of(const std::vector<int64_t>& v) {
  return std::accumulate(v.begin(), v.end(), int64_t{0});
}

int64_t max_of(const std::vector<int64_t>& v) {
  return v.empty() ? 0 : *std::max_element(v.begin(), v.end());
}

// Elements before dim d: 1 when every piece cut along d is one contiguous run.
int64_t outer_size(const Shape& s, int d) {
  int64_t outer = 1;
  for (int i = 0; i < d; ++i)
    outer *= s[i];
  return outer;
}

Shape with_extent(Shape s, int d, int64_t extent) {
  s[d] = extent;
  return s;
}

Tensor flat(const Tensor& x) {
  return ops::reshape(x, Shape{x.numel()});
}

void check_count(const std::vector<int64_t>& lengths, int n, const char* op, const char* what) {
  TANDEM_CHECK(static_cast<int>(lengths.size()) == n,
               "[parallel::{}] expected {} {} (one per rank of the group), got {}", op, n, what,
               lengths.size());
  for (int64_t l : lengths)
    TANDEM_CHECK(l >= 0, "[parallel::{}] expected non-negative {}, got {}", op, what, l);
}

// Lengths that cut an extent: an even split when none are given.
std::vector<int64_t> cut_lengths(std::vector<int64_t> lengths, int64_t extent, int n,
                                 const char* op, int d) {
  if (lengths.empty()) {
    TANDEM_CHECK(extent % n == 0,
                 "[parallel::{}] expected dim {} ({}) divisible by the group size {} (pass "
                 "lengths for uneven splits)",
                 op, d, extent, n);
    return std::vector<int64_t>(static_cast<size_t>(n), extent / n);
  }
  check_count(lengths, n, op, "lengths");
  TANDEM_CHECK(sum_of(lengths) == extent,
               "[parallel::{}] expected lengths summing to the extent {} of dim {}, got {} ({})",
               op, extent, d, sum_of(lengths), fmt::join(lengths, ", "));
  return lengths;
}

// Every rank's extent of a dim: equal extents when none are given.
std::vector<int64_t> rank_lengths(std::vector<int64_t> lengths, int64_t extent, int n, int me,
                                  const char* op, int d) {
  if (lengths.empty()) return std::vector<int64_t>(static_cast<size_t>(n), extent);
  check_count(lengths, n, op, "lengths");
  TANDEM_CHECK(lengths[static_cast<size_t>(me)] == extent,
               "[parallel::{}] expected this rank's length {} to equal its extent {} of dim {}", op,
               lengths[static_cast<size_t>(me)], extent, d);
  return lengths;
}

void check_input(const Tensor& x, const ProcessGroupPtr& group, const char* op) {
  TANDEM_CHECK(group != nullptr, "[parallel::{}] expected a process group, got null", op);
  TANDEM_CHECK(x.defined() && x.dim() >= 1,
               "[parallel::{}] expected a defined tensor of rank >= 1, got {}", op,
               x.defined() ? fmt::format("{}", x.shape()) : "undefined");
}

// One differentiable collective: forward and backward are launchers, each
// waited at once.
struct CollectiveFunction final : Function {
  const char* node_name = "";
  Exchange::Launcher forward_launch, backward_launch;
  const char* name() const override { return node_name; }
  std::vector<Tensor> forward(FunctionCtx&, const std::vector<Tensor>& in) override {
    return {forward_launch(in[0]).wait()};
  }
  std::vector<Tensor> backward(FunctionCtx&, const std::vector<Tensor>& g) override {
    return {backward_launch(g[0]).wait()};
  }
};

Tensor collective(const Tensor& x, const char* name, Exchange::Launcher forward,
                  Exchange::Launcher backward) {
  auto fn = std::make_shared<CollectiveFunction>();
  fn->node_name = name;
  fn->forward_launch = std::move(forward);
  fn->backward_launch = std::move(backward);
  return Function::apply(fn, {x})[0];
}

}  // namespace

Tensor pad_dim(const Tensor& x, int64_t dim, int64_t size) {
  const int d = wrap_dim(dim, x.dim(), "pad_dim");
  TANDEM_CHECK(size >= x.shape()[d],
               "[parallel::pad_dim] expected a size >= {} (dim {} of {}), got {}", x.shape()[d], d,
               x.shape(), size);
  if (x.shape()[d] == size) return x;
  Tensor out = ops::zeros(with_extent(x.shape(), d, size), x.dtype(), x.device());
  if (x.numel() > 0) ops::copy_(ops::narrow(out, d, 0, x.shape()[d]), x);
  return out;
}

bool PendingTensor::ready() const {
  return !work || work->is_completed();
}

// Note [Progress without a waiter]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// An asynchronous collective hides only if something moves its data while
// the launching thread computes. NCCL's kernels and MPI's executor thread
// (Note [MPI progress]) do that on their own. The threads backend's copies
// are run by whoever drives the round, normally a waiter (Note [Threads
// rounds]), which for a collective waited only after the compute would put
// every copy after it: "async" would overlap nothing.
// Work::progress_in_background() therefore hands the round to the group's
// comm thread, which sleeps until the last peer has posted and then runs the
// copies alongside the rank's compute; a waiter that arrives first still
// helps, and only a waiter finishes the Work or reports its failure (the comm
// thread holds no reference to it, so a finished collective's buffers are
// never kept alive by that thread). Only the windows of Exchange ask for
// this: a collective waited at once is fastest driven by its waiter, with no
// hand-off between threads.
void PendingTensor::progress_in_background() const {
  TANDEM_CHECK(work != nullptr, "[parallel::PendingTensor] expected a launched collective");
  work->progress_in_background();
}

Tensor PendingTensor::in_flight() const {
  TANDEM_CHECK(work != nullptr, "[parallel::PendingTensor] expected a launched collective");
  return work->result();
}

Tensor PendingTensor::wait() {
  TANDEM_CHECK(work != nullptr, "[parallel::PendingTensor] expected a launched collective");
  work->wait();
  Tensor raw = work->result();
  return finish ? finish(raw) : raw;
}

PendingTensor launch_all_gather(const Tensor& x, const ProcessGroupPtr& group, int64_t dim,
                                std::vector<int64_t> lengths_in, const std::string& tag) {
  check_input(x, group, "all_gather_dim");
  const int n = group->size();
  const int d = wrap_dim(dim, x.dim(), "all_gather_dim");
  const std::vector<int64_t> lengths =
      rank_lengths(std::move(lengths_in), x.shape()[d], n, group->rank(), "all_gather_dim", d);
  // Every rank sends one block of the longest extent (Note [One copy per
  // collective]): padded inside the send buffer when this rank's is shorter.
  const int64_t longest = max_of(lengths);
  const Shape block = with_extent(x.shape(), d, longest);
  const int64_t block_numel = block.numel();
  Tensor send;
  if (x.shape()[d] == longest) {
    send = flat(x);
  } else {
    send = ops::zeros(Shape{block_numel}, x.dtype(), x.device());
    if (x.numel() > 0) ops::copy_(ops::narrow(ops::reshape(send, block), d, 0, x.shape()[d]), x);
  }
  WorkPtr w = group->all_gather(send, {0, tag});
  const Shape full = with_extent(x.shape(), d, sum_of(lengths));
  const bool even =
      std::all_of(lengths.begin(), lengths.end(), [&](int64_t l) { return l == longest; });
  const bool joined = even && outer_size(x.shape(), d) == 1;
  return {w, [=](const Tensor& received) {
            if (joined) return ops::reshape(received, full);
            Tensor out = empty(full, received.dtype(), received.device());
            int64_t offset = 0;
            for (int r = 0; r < n; ++r) {
              const int64_t len = lengths[static_cast<size_t>(r)];
              if (len > 0 && block_numel > 0) {
                Tensor from =
                    ops::reshape(ops::narrow(received, 0, r * block_numel, block_numel), block);
                ops::copy_(ops::narrow(out, d, offset, len), ops::narrow(from, d, 0, len));
              }
              offset += len;
            }
            return out;
          }};
}

PendingTensor launch_reduce_scatter(const Tensor& x, const ProcessGroupPtr& group, int64_t dim,
                                    std::vector<int64_t> lengths_in, RedOp op,
                                    const std::string& tag) {
  check_input(x, group, "reduce_scatter_dim");
  const int n = group->size(), me = group->rank();
  const int d = wrap_dim(dim, x.dim(), "reduce_scatter_dim");
  const std::vector<int64_t> lengths =
      cut_lengths(std::move(lengths_in), x.shape()[d], n, "reduce_scatter_dim", d);
  const int64_t longest = max_of(lengths);
  const Shape block = with_extent(x.shape(), d, longest);
  const int64_t block_numel = block.numel();
  const bool even =
      std::all_of(lengths.begin(), lengths.end(), [&](int64_t l) { return l == longest; });
  Tensor send;
  if (even && outer_size(x.shape(), d) == 1 && x.is_contiguous()) {
    send = flat(x);
  } else {
    // Rank r's piece of dim d into block r, zero tails where it is shorter.
    const Shape buffer{n * block_numel};
    send = even ? empty(buffer, x.dtype(), x.device()) : ops::zeros(buffer, x.dtype(), x.device());
    int64_t offset = 0;
    for (int r = 0; r < n; ++r) {
      const int64_t len = lengths[static_cast<size_t>(r)];
      if (len > 0 && block_numel > 0) {
        Tensor to = ops::reshape(ops::narrow(send, 0, r * block_numel, block_numel), block);
        ops::copy_(ops::narrow(to, d, 0, len), ops::narrow(x, d, offset, len));
      }
      offset += len;
    }
  }
  WorkPtr w = group->reduce_scatter(send, {op, 0, tag});
  const int64_t mine = lengths[static_cast<size_t>(me)];
  return {w, [=](const Tensor& received) {
            Tensor b = ops::reshape(received, block);
            return mine == longest ? b : ops::contiguous(ops::narrow(b, d, 0, mine));
          }};
}

PendingTensor launch_all_to_all(const Tensor& x, const ProcessGroupPtr& group, int64_t scatter_dim,
                                int64_t gather_dim, std::vector<int64_t> send_in,
                                std::vector<int64_t> recv_in, const std::string& tag) {
  check_input(x, group, "all_to_all_dims");
  const int n = group->size(), me = group->rank();
  const int sd = wrap_dim(scatter_dim, x.dim(), "all_to_all_dims");
  const int gd = wrap_dim(gather_dim, x.dim(), "all_to_all_dims");
  const std::vector<int64_t> send =
      cut_lengths(std::move(send_in), x.shape()[sd], n, "all_to_all_dims", sd);
  std::vector<int64_t> recv;
  if (sd == gd) {
    TANDEM_CHECK(!recv_in.empty(),
                 "[parallel::all_to_all_dims] expected receive lengths when the scatter and "
                 "gather dims are the same (dim {}), got none",
                 sd);
    check_count(recv_in, n, "all_to_all_dims", "receive lengths");
    recv = std::move(recv_in);
  } else {
    recv = rank_lengths(std::move(recv_in), x.shape()[gd], n, me, "all_to_all_dims", gd);
  }
  if (sd == 0 && gd == 0) {
    // Rows to and from every rank: the backend's own layout, no copy.
    return {group->all_to_all_single(x, {send, recv, tag}), nullptr};
  }
  // Piece j of dim sd goes to rank j, packed in rank order (Note [One copy
  // per collective]).
  std::vector<int64_t> in_splits, out_splits;
  Tensor buffer;
  const bool packed = outer_size(x.shape(), sd) == 1 && x.is_contiguous();
  buffer = packed ? flat(x) : empty(Shape{x.numel()}, x.dtype(), x.device());
  int64_t offset = 0, at = 0;
  for (int j = 0; j < n; ++j) {
    const int64_t len = send[static_cast<size_t>(j)];
    const Shape piece = with_extent(x.shape(), sd, len);
    const int64_t count = piece.numel();
    if (!packed && count > 0)
      ops::copy_(ops::reshape(ops::narrow(buffer, 0, at, count), piece),
                 ops::narrow(x, sd, offset, len));
    in_splits.push_back(count);
    offset += len;
    at += count;
  }
  // The piece from rank r: this rank's extent of sd, rank r's of gd.
  const Shape mine = with_extent(x.shape(), sd, send[static_cast<size_t>(me)]);
  std::vector<Shape> pieces;
  for (int r = 0; r < n; ++r) {
    pieces.push_back(with_extent(mine, gd, recv[static_cast<size_t>(r)]));
    out_splits.push_back(pieces.back().numel());
  }
  WorkPtr w = group->all_to_all_single(buffer, {in_splits, out_splits, tag});
  const Shape out_shape = with_extent(mine, gd, sum_of(recv));
  const bool joined = outer_size(out_shape, gd) == 1;
  return {w, [=](const Tensor& received) {
            if (joined) return ops::reshape(received, out_shape);
            Tensor out = empty(out_shape, received.dtype(), received.device());
            int64_t off = 0, pos = 0;
            for (int r = 0; r < n; ++r) {
              const int64_t len = recv[static_cast<size_t>(r)];
              const int64_t count = out_splits[static_cast<size_t>(r)];
              if (count > 0)
                ops::copy_(ops::narrow(out, gd, off, len),
                           ops::reshape(ops::narrow(received, 0, pos, count), pieces[r]));
              off += len;
              pos += count;
            }
            return out;
          }};
}

PendingTensor launch_all_reduce(const Tensor& x, const ProcessGroupPtr& group, RedOp op,
                                const std::string& tag) {
  check_input(x, group, "all_reduce");
  return {group->all_reduce(x, {op, tag}), nullptr};
}

std::vector<int64_t> gather_lengths(const Tensor& x, const ProcessGroupPtr& group, int64_t dim) {
  check_input(x, group, "gather_lengths");
  int d = wrap_dim(dim, x.dim(), "gather_lengths");
  WorkPtr w = group->all_gather(
      ops::full(Shape{1}, static_cast<double>(x.shape()[d]), DType::I64, x.device()),
      {0, "lengths"});
  w->wait();
  return w->result().to_vector<int64_t>();
}

Tensor all_to_all_dims(const Tensor& x, const ProcessGroupPtr& group, int64_t scatter_dim,
                       int64_t gather_dim, std::vector<int64_t> send_lengths,
                       std::vector<int64_t> recv_lengths) {
  check_input(x, group, "all_to_all_dims");
  const int n = group->size();
  const int sd = wrap_dim(scatter_dim, x.dim(), "all_to_all_dims");
  const int gd = wrap_dim(gather_dim, x.dim(), "all_to_all_dims");
  TANDEM_CHECK(sd != gd,
               "[parallel::all_to_all_dims] expected different scatter and gather dims, got {} "
               "twice (rows to and from every rank: launch_all_to_all)",
               sd);
  // Resolved here, so that backward swaps the same lists.
  std::vector<int64_t> send =
      cut_lengths(std::move(send_lengths), x.shape()[sd], n, "all_to_all_dims", sd);
  std::vector<int64_t> recv =
      rank_lengths(std::move(recv_lengths), x.shape()[gd], n, group->rank(), "all_to_all_dims", gd);
  return collective(
      x, "AllToAllBackward",
      [=](const Tensor& t) { return launch_all_to_all(t, group, sd, gd, send, recv); },
      [=](const Tensor& g) { return launch_all_to_all(g, group, gd, sd, recv, send); });
}

Tensor all_gather_dim(const Tensor& x, const ProcessGroupPtr& group, int64_t dim,
                      std::vector<int64_t> lengths_in) {
  check_input(x, group, "all_gather_dim");
  const int d = wrap_dim(dim, x.dim(), "all_gather_dim");
  std::vector<int64_t> lengths = rank_lengths(std::move(lengths_in), x.shape()[d], group->size(),
                                              group->rank(), "all_gather_dim", d);
  return collective(
      x, "AllGatherBackward",
      [=](const Tensor& t) { return launch_all_gather(t, group, d, lengths); },
      [=](const Tensor& g) { return launch_reduce_scatter(g, group, d, lengths); });
}

Tensor reduce_scatter_dim(const Tensor& x, const ProcessGroupPtr& group, int64_t dim,
                          std::vector<int64_t> lengths_in) {
  check_input(x, group, "reduce_scatter_dim");
  const int d = wrap_dim(dim, x.dim(), "reduce_scatter_dim");
  std::vector<int64_t> lengths =
      cut_lengths(std::move(lengths_in), x.shape()[d], group->size(), "reduce_scatter_dim", d);
  return collective(
      x, "ReduceScatterBackward",
      [=](const Tensor& t) { return launch_reduce_scatter(t, group, d, lengths); },
      [=](const Tensor& g) { return launch_all_gather(g, group, d, lengths); });
}

}  // namespace tandem
