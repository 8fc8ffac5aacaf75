// ProcessGroup: the collective front end shared by every backend (DESIGN §5).
//
// The public methods validate their input (shapes, dtypes, split sizes,
// peers), make it contiguous, allocate the output, append the call to the
// group's ledger under the process-wide issue lock (Note [Issue lock]) and hand
// one `Collective` to the backend's launch(). Backends implement launch() for
// the kinds they support and throw "backend X does not support Y" otherwise.
//
// Note [Issue lock]
// ~~~~~~~~~~~~~~~~~
// NCCL forbids concurrent enqueues from two threads on one device, and the
// dual-pipe schedule issues collectives from both worker threads. Every launch
// of a process therefore happens under one mutex, so the per-group order of
// launches is a total order per rank, which the ledger records and checked
// mode compares across ranks (Note [Checked launch order]). The threads
// backend's ranks stand for processes, so each rank thread set has a mutex of
// its own (ProcessGroup::issue_mutex()): its launches are ordered the same
// way, and the ranks do not queue on one another's launches (which showed in
// the small rows of `tandem-bench comm`). A simulated link takes its inner
// group's mutex, so launches through it and straight on the inner group stay
// one sequence.
#pragma once

#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "tandem/comm/ledger.h"
#include "tandem/comm/types.h"
#include "tandem/comm/work.h"
#include "tandem/runtime/stream.h"

namespace tandem {

struct ProcessGroupOptions {
  // Compare a fingerprint of every collective across ranks before running it.
  bool checked = true;
  // Bound of every wait inside the group; 0 = wait_timeout().
  std::chrono::milliseconds timeout{0};
  std::string name = "world";
};

enum class CollectiveKind : uint8_t {
  AllReduce,
  Broadcast,
  AllGather,
  ReduceScatter,
  AllToAll,
  Send,
  Recv,
  BatchP2P,
  Barrier
};
// The number of kinds, for collective_name's table: the last value + 1, not an
// enumerator (switches stay exhaustive).
constexpr int kCollectiveKindCount = static_cast<int>(CollectiveKind::Barrier) + 1;
const char* collective_name(CollectiveKind kind);

// One launched collective, as the backend sees it. Inputs are contiguous;
// gathers and scatters are along dim 0 (the front end moves other dims).
struct Collective {
  CollectiveKind kind = CollectiveKind::Barrier;
  LedgerEntry entry;
  Tensor input;
  Tensor output;  // allocated by the front end (undefined for send/barrier)
  RedOp op = RedOp::Sum;
  int peer = -1;  // root (broadcast) or peer (send/recv), group rank
  int tag_id = 0;
  std::vector<int64_t> input_splits, output_splits;  // all-to-all rows
  std::vector<P2POp> p2p;                            // batch: contiguous tensors
  std::vector<Tensor> p2p_outputs;                   // one per Recv op, in order
  // Recorded on the caller's stream after the input was produced (left
  // unrecorded, so complete, on an inline or idle CPU stream).
  Event ready;
  WorkPtr work;
};

class ProcessGroup : public std::enable_shared_from_this<ProcessGroup> {
 public:
  ProcessGroup(int rank, int size, std::vector<int> world_ranks, ProcessGroupOptions options);
  virtual ~ProcessGroup() = default;
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  // Rank in the world of each member, indexed by group rank.
  const std::vector<int>& world_ranks() const { return world_ranks_; }
  const ProcessGroupOptions& options() const { return options_; }
  std::chrono::milliseconds timeout() const;
  virtual std::string backend_name() const = 0;
  Ledger& ledger() { return ledger_; }
  // "rank=3/8 group=world backend=threads": the prefix of comm error
  // messages (formatted once, on first use: backend_name() is virtual).
  const std::string& where() const;

  WorkPtr all_reduce(const Tensor& t, const AllReduceOptions& options = {});
  WorkPtr broadcast(const Tensor& t, const BroadcastOptions& options = {});
  WorkPtr all_gather(const Tensor& t, const AllGatherOptions& options = {});
  WorkPtr reduce_scatter(const Tensor& t, const ReduceScatterOptions& options = {});
  WorkPtr all_to_all_single(const Tensor& t, const AllToAllOptions& options = {});
  WorkPtr send(const Tensor& t, const P2POptions& options);
  // `like` gives the shape and dtype; result() is the received tensor.
  WorkPtr recv(const Tensor& like, const P2POptions& options);
  // Sends and receives of one batch run together (no ordering deadlock);
  // results() are the received tensors in the order of the Recv ops.
  WorkPtr batch_isend_irecv(const std::vector<P2POp>& ops, const std::string& tag = "");
  WorkPtr barrier(const BarrierOptions& options = {});

  // Collective over this group: every member calls it with the same group
  // ranks, in the same order relative to its other splits. Members get the
  // new group (ranks renumbered in the given order); others get nullptr.
  std::shared_ptr<ProcessGroup> split(const std::vector<int>& ranks, const std::string& name = "");

  // Fails this group's pending and future collectives on every member with an
  // error naming this rank and `reason` (threads backend: at once; MPI/NCCL:
  // this rank's side only, peers then fail by their watchdog). For a rank
  // that gives up mid-step, so its peers fail promptly instead of timing out.
  virtual void abort(const std::string& reason) { (void)reason; }

 protected:
  virtual void launch(Collective& c) = 0;
  virtual std::shared_ptr<ProcessGroup> make_subgroup(const std::vector<int>& ranks, int new_rank,
                                                      const std::string& name) = 0;
  [[noreturn]] void unsupported(const char* what) const;
  // The lock every launch on this rank takes (Note [Issue lock]): the
  // process-wide comm_issue_mutex(), or one per rank where the ranks are
  // threads of one process (threads backend).
  virtual std::mutex& issue_mutex() const;
  // The Work a launch returns; a backend whose completion is a device event
  // (NCCL) returns a subclass whose wait() is stream-side.
  virtual WorkPtr make_work(std::string description) {
    return std::make_shared<Work>(std::move(description));
  }

 private:
  WorkPtr issue(Collective c, std::vector<Tensor> keep);
  LedgerEntry entry_for(const char* op, const Tensor& t, int peer, const std::string& tag) const;

  int rank_;
  int size_;
  std::vector<int> world_ranks_;
  ProcessGroupOptions options_;
  Ledger ledger_;
  uint64_t splits_ = 0;
  mutable std::once_flag where_once_;
  mutable std::string where_;
};

using ProcessGroupPtr = std::shared_ptr<ProcessGroup>;

// The process-wide issue lock (Note [Issue lock]).
std::mutex& comm_issue_mutex();

// Reduction helpers shared by the CPU backends: out = op(out, in) elementwise
// (same dtype, contiguous), and the final division for Avg.
void reduce_into(RedOp op, const Tensor& out, const Tensor& in);
void finish_average(RedOp op, const Tensor& out, int world);

}  // namespace tandem
