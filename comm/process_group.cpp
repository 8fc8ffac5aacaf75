#include "tandem/comm/process_group.h"

#include <iterator>
#include <numeric>
#include <set>

#include "tandem/runtime/config.h"
#include "tandem/runtime/error.h"
#include "tandem/runtime/logging.h"
#include "tandem/runtime/trace.h"
#include "tandem/tensor/kernels.h"
#include "tandem/tensor/ops.h"

namespace tandem {

const char* red_op_name(RedOp op) {
  switch (op) {
    case RedOp::Sum:
      return "sum";
    case RedOp::Avg:
      return "avg";
    case RedOp::Max:
      return "max";
    case RedOp::Min:
      return "min";
  }
  return "?";
}

const char* collective_name(CollectiveKind kind) {
  static const char* names[] = {"all_reduce",     "broadcast",         "all_gather",
                                "reduce_scatter", "all_to_all",        "send",
                                "recv",           "batch_isend_irecv", "barrier"};
  static_assert(std::size(names) == kCollectiveKindCount, "one name per CollectiveKind");
  return names[static_cast<int>(kind)];
}

std::mutex& comm_issue_mutex() {
  static std::mutex mu;
  return mu;
}

std::mutex& ProcessGroup::issue_mutex() const {
  return comm_issue_mutex();
}

ProcessGroup::ProcessGroup(int rank, int size, std::vector<int> world_ranks,
                           ProcessGroupOptions options)
    : rank_(rank), size_(size), world_ranks_(std::move(world_ranks)), options_(std::move(options)) {
  TANDEM_CHECK(size > 0 && rank >= 0 && rank < size,
               "[comm::ProcessGroup] expected 0 <= rank < size, got rank={} size={}", rank, size);
  TANDEM_CHECK(static_cast<int>(world_ranks_.size()) == size,
               "[comm::ProcessGroup] expected {} world ranks, got {}", size, world_ranks_.size());
}

std::chrono::milliseconds ProcessGroup::timeout() const {
  return options_.timeout.count() > 0 ? options_.timeout : wait_timeout();
}

const std::string& ProcessGroup::where() const {
  std::call_once(where_once_, [this] {
    where_ =
        fmt::format("rank={}/{} group={} backend={}", rank_, size_, options_.name, backend_name());
  });
  return where_;
}

void ProcessGroup::unsupported(const char* what) const {
  TANDEM_FAIL("[comm::{}] backend {} does not support {} ({})", what, backend_name(), what,
              where());
}

LedgerEntry ProcessGroup::entry_for(const char* op, const Tensor& t, int peer,
                                    const std::string& tag) const {
  LedgerEntry e;
  e.op = op;
  if (t.defined()) {
    e.dtype = dtype_name(t.dtype());
    e.counts = t.shape().vec();
  }
  e.peer = peer;
  e.thread = thread_name();
  e.tag = tag;
  return e;
}

WorkPtr ProcessGroup::issue(Collective c, std::vector<Tensor> keep) {
  const char* name = collective_name(c.kind);
  // Built at every launch: plain appends, not a format string.
  std::string description = name;
  description += " (";
  description += where();
  description += ')';
  c.work = make_work(std::move(description));
  // The outputs live as long as the Work (result()); `keep` until it finishes.
  std::vector<Tensor> outputs;
  outputs.reserve(1 + c.p2p_outputs.size());
  if (c.output.defined()) outputs.push_back(c.output);
  for (const Tensor& t : c.p2p_outputs)
    outputs.push_back(t);
  c.work->set_outputs(std::move(outputs));
  if (!keep.empty()) c.work->keep_alive(std::move(keep));
  Device device = c.input.defined() ? c.input.device()
                  : c.p2p.empty()   ? Device::cpu()
                                    : c.p2p.front().tensor.device();
  // An inline CPU stream has run everything before this call: an event
  // recorded there would be complete at once, and one never recorded is.
  // So has an idle async one, whose record would still be queued behind
  // nothing and make the launch look unready (the threads backend would then
  // post it from its comm thread, a hand-off, instead of at once).
  const Stream& stream = current_stream(device);
  if (!stream.is_inline() && !(device.is_cpu() && stream.query())) c.ready.record(stream);
  WorkPtr work = c.work;
  std::lock_guard<std::mutex> lock(issue_mutex());
  c.entry = ledger_.append(std::move(c.entry));
  if (trace_enabled()) {
    trace_instant("comm", fmt::format("issue {} #{}", name, c.entry.seq),
                  fmt::format("\"group\":\"{}\",\"seq\":{}", options_.name, c.entry.seq));
  }
  launch(c);
  return work;
}

WorkPtr ProcessGroup::all_reduce(const Tensor& t, const AllReduceOptions& options) {
  TANDEM_CHECK(t.defined(), "[comm::all_reduce] expected a defined tensor ({})", where());
  Collective c;
  c.kind = CollectiveKind::AllReduce;
  c.input = ops::contiguous(t);
  c.output = empty(t.shape(), t.dtype(), t.device());
  c.op = options.op;
  c.entry = entry_for("all_reduce", t, -1, options.tag);
  c.entry.counts.push_back(static_cast<int64_t>(options.op));
  return issue(std::move(c), {});
}

WorkPtr ProcessGroup::broadcast(const Tensor& t, const BroadcastOptions& options) {
  TANDEM_CHECK(t.defined(), "[comm::broadcast] expected a defined tensor ({})", where());
  TANDEM_CHECK(options.root >= 0 && options.root < size_,
               "[comm::broadcast] expected root in [0, {}), got {} ({})", size_, options.root,
               where());
  Collective c;
  c.kind = CollectiveKind::Broadcast;
  c.input = ops::contiguous(t);
  c.output = empty(t.shape(), t.dtype(), t.device());
  c.peer = options.root;
  c.entry = entry_for("broadcast", t, options.root, options.tag);
  return issue(std::move(c), {});
}

WorkPtr ProcessGroup::all_gather(const Tensor& t, const AllGatherOptions& options) {
  TANDEM_CHECK(t.defined() && t.dim() >= 1,
               "[comm::all_gather] expected a tensor of rank >= 1, got {} ({})",
               t.defined() ? t.shape().str() : "undefined", where());
  int d = wrap_dim(options.dim, t.dim(), "all_gather");
  Collective c;
  c.kind = CollectiveKind::AllGather;
  c.input = ops::contiguous(ops::transpose(t, 0, d));  // gathers run along dim 0
  Shape out_shape = c.input.shape();
  out_shape[0] *= size_;
  c.output = empty(out_shape, t.dtype(), t.device());
  c.entry = entry_for("all_gather", t, -1, options.tag);
  c.entry.counts.push_back(d);
  Tensor gathered = c.output;
  WorkPtr w = issue(std::move(c), {});
  if (d != 0) w->set_outputs({ops::transpose(gathered, 0, d)});
  return w;
}

WorkPtr ProcessGroup::reduce_scatter(const Tensor& t, const ReduceScatterOptions& options) {
  TANDEM_CHECK(t.defined() && t.dim() >= 1,
               "[comm::reduce_scatter] expected a tensor of rank >= 1 ({})", where());
  int d = wrap_dim(options.dim, t.dim(), "reduce_scatter");
  TANDEM_CHECK(t.shape()[d] % size_ == 0,
               "[comm::reduce_scatter] expected dim {} ({}) divisible by the group size {}, got "
               "shape {} ({})",
               d, t.shape()[d], size_, t.shape(), where());
  Collective c;
  c.kind = CollectiveKind::ReduceScatter;
  c.input = ops::contiguous(ops::transpose(t, 0, d));
  Shape out_shape = c.input.shape();
  out_shape[0] /= size_;
  c.output = empty(out_shape, t.dtype(), t.device());
  c.op = options.op;
  c.entry = entry_for("reduce_scatter", t, -1, options.tag);
  c.entry.counts.push_back(d);
  c.entry.counts.push_back(static_cast<int64_t>(options.op));
  Tensor scattered = c.output;
  WorkPtr w = issue(std::move(c), {});
  if (d != 0) w->set_outputs({ops::transpose(scattered, 0, d)});
  return w;
}

WorkPtr ProcessGroup::all_to_all_single(const Tensor& t, const AllToAllOptions& options) {
  TANDEM_CHECK(t.defined() && t.dim() >= 1,
               "[comm::all_to_all] expected a tensor of rank >= 1 ({})", where());
  const int64_t rows = t.shape()[0];
  std::vector<int64_t> in = options.input_split_sizes, out = options.output_split_sizes;
  if (in.empty()) {
    TANDEM_CHECK(rows % size_ == 0,
                 "[comm::all_to_all] expected dim 0 ({}) divisible by the group size {} for even "
                 "splits ({})",
                 rows, size_, where());
    in.assign(static_cast<size_t>(size_), rows / size_);
  }
  if (out.empty())
    out = in.size() == static_cast<size_t>(size_) && options.input_split_sizes.empty()
              ? in
              : std::vector<int64_t>();
  TANDEM_CHECK(static_cast<int>(in.size()) == size_ && static_cast<int>(out.size()) == size_,
               "[comm::all_to_all] expected {} input and {} output split sizes, got {} and {} "
               "(uneven splits need both lists) ({})",
               size_, size_, in.size(), out.size(), where());
  int64_t in_total = 0, out_total = 0;
  for (int64_t s : in) {
    TANDEM_CHECK(s >= 0, "[comm::all_to_all] expected non-negative split sizes ({})", where());
    in_total += s;
  }
  for (int64_t s : out) {
    TANDEM_CHECK(s >= 0, "[comm::all_to_all] expected non-negative split sizes ({})", where());
    out_total += s;
  }
  TANDEM_CHECK(in_total == rows,
               "[comm::all_to_all] expected input split sizes summing to dim 0 ({}), got {} ({})",
               rows, in_total, where());
  Collective c;
  c.kind = CollectiveKind::AllToAll;
  c.input = ops::contiguous(t);
  Shape out_shape = t.shape();
  out_shape[0] = out_total;
  c.output = empty(out_shape, t.dtype(), t.device());
  c.input_splits = std::move(in);
  c.output_splits = std::move(out);
  Shape row = t.shape();
  row[0] = 1;
  c.entry = entry_for("all_to_all", Tensor(), -1, options.tag);
  c.entry.dtype = dtype_name(t.dtype());
  c.entry.counts = row.vec();  // per-rank split sizes legitimately differ across ranks
  return issue(std::move(c), {});
}

WorkPtr ProcessGroup::send(const Tensor& t, const P2POptions& options) {
  return batch_isend_irecv({P2POp::send(t, options.peer, options.tag_id)}, options.tag);
}

WorkPtr ProcessGroup::recv(const Tensor& like, const P2POptions& options) {
  return batch_isend_irecv({P2POp::recv(like, options.peer, options.tag_id)}, options.tag);
}

WorkPtr ProcessGroup::batch_isend_irecv(const std::vector<P2POp>& ops_in, const std::string& tag) {
  TANDEM_CHECK(!ops_in.empty(), "[comm::batch_isend_irecv] expected at least one op ({})", where());
  Collective c;
  c.kind = CollectiveKind::BatchP2P;
  c.entry = entry_for("p2p", Tensor(), -1, tag);
  std::vector<Tensor> keep;
  for (const P2POp& op : ops_in) {
    TANDEM_CHECK(op.tensor.defined(), "[comm::p2p] expected a defined tensor ({})", where());
    TANDEM_CHECK(op.peer >= 0 && op.peer < size_ && op.peer != rank_,
                 "[comm::p2p] expected a peer in [0, {}) other than self ({}), got {} ({})", size_,
                 rank_, op.peer, where());
    TANDEM_CHECK(op.tensor.device() == ops_in.front().tensor.device(),
                 "[comm::p2p] expected every op of a batch on one device, got {} (first op) and "
                 "{} ({})",
                 ops_in.front().tensor.device(), op.tensor.device(), where());
    P2POp copy = op;
    if (op.kind == P2POp::Kind::Send) {
      copy.tensor = ops::contiguous(op.tensor);
      keep.push_back(copy.tensor);
      if (!c.input.defined()) c.input = copy.tensor;
    } else {
      c.p2p_outputs.push_back(empty(op.tensor.shape(), op.tensor.dtype(), op.tensor.device()));
    }
    c.p2p.push_back(copy);
  }
  // P2P calls are not collective: their ledger entry is local, not compared.
  c.entry.counts = {static_cast<int64_t>(ops_in.size())};
  return issue(std::move(c), std::move(keep));
}

WorkPtr ProcessGroup::barrier(const BarrierOptions& options) {
  Collective c;
  c.kind = CollectiveKind::Barrier;
  c.entry = entry_for("barrier", Tensor(), -1, options.tag);
  return issue(std::move(c), {});
}

std::shared_ptr<ProcessGroup> ProcessGroup::split(const std::vector<int>& ranks,
                                                  const std::string& name) {
  std::set<int> seen;
  for (int r : ranks) {
    TANDEM_CHECK(r >= 0 && r < size_ && seen.insert(r).second,
                 "[comm::split] expected distinct group ranks in [0, {}), got {} ({})", size_, r,
                 where());
  }
  TANDEM_CHECK(!ranks.empty(), "[comm::split] expected at least one rank ({})", where());
  int new_rank = -1;
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (ranks[i] == rank_) new_rank = static_cast<int>(i);
  }
  std::string label = name.empty() ? fmt::format("{}.split{}", options_.name, splits_) : name;
  ++splits_;
  return make_subgroup(ranks, new_rank, label);
}

void reduce_into(RedOp op, const Tensor& out, const Tensor& in) {
  BinaryOp b = op == RedOp::Max   ? BinaryOp::Maximum
               : op == RedOp::Min ? BinaryOp::Minimum
                                  : BinaryOp::Add;
  TensorArg ao = arg_of(out), ai = arg_of(in);
  cpu::binary(b, ao, ai, ao);
}

void finish_average(RedOp op, const Tensor& out, int world) {
  if (op != RedOp::Avg) return;
  TensorArg ao = arg_of(out);
  cpu::binary_scalar(BinaryOp::Div, ao, static_cast<double>(world), false, ao);
}

}  // namespace tandem
