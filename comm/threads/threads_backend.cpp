#include "comm/threads/threads_backend.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <algorithm>
#include <map>
#include <set>
#include <thread>

#include <fmt/ranges.h>

#include "runtime/error.h"
#include "runtime/logging.h"
#include "runtime/task_queue.h"
#include "runtime/trace.h"
#include "tensor/kernels.h"

namespace tandem {
namespace {

// A message of the p2p mailbox: the sender's tensor, read in place by the
// receiver, who then sets `consumed`.
struct Message {
  Tensor data;
  LedgerEntry entry;
  std::shared_ptr<std::atomic<bool>> consumed;
};

struct Slot {
  Tensor input;
  LedgerEntry entry;
  std::vector<int64_t> input_splits, output_splits;
  int root = -1;
};

}  // namespace

// The state one group shares between its member rank threads.
struct SharedGroup {
  SharedGroup(std::string group_name, std::vector<int> world_members)
      : name(std::move(group_name)), size(static_cast<int>(world_members.size())),
        members(std::move(world_members)), slots(static_cast<size_t>(size)),
        arrived_mask(static_cast<size_t>(size), false), exit_reasons(static_cast<size_t>(size)) {}

  std::string name;
  int size;
  std::vector<int> members;  // world ranks
  std::mutex mu;
  std::condition_variable cv;
  uint64_t generation = 0;
  int arrived = 0;
  std::vector<Slot> slots;
  std::vector<bool> arrived_mask;
  bool aborted = false;
  std::string abort_reason;
  // Members whose rank function returned (by group rank; empty = still
  // running). No collective can complete once one has gone, but p2p between
  // the others still can, so an exit is not an abort.
  std::vector<std::string> exit_reasons;
  int first_exited = -1;
  std::map<std::tuple<int, int, int>, std::deque<Message>> mail;  // (src, dst, tag)

  void abort(const std::string& reason) {
    std::lock_guard<std::mutex> lock(mu);
    abort_locked(reason);
  }
  void abort_locked(const std::string& reason) {
    if (!aborted) {
      aborted = true;
      abort_reason = reason;
    }
    cv.notify_all();
  }
  [[noreturn]] void throw_aborted(const std::string& who) {
    throw CommAbortedError(
        fmt::format("[comm] {} failed: group '{}' was aborted: {}", who, name, abort_reason));
  }
  void member_exited(int group_rank, const std::string& reason) {
    std::lock_guard<std::mutex> lock(mu);
    if (exit_reasons[group_rank].empty()) exit_reasons[group_rank] = reason;
    if (first_exited < 0) first_exited = group_rank;
    cv.notify_all();
  }
  bool exited(int group_rank) const { return !exit_reasons[group_rank].empty(); }
  [[noreturn]] void throw_exited(const std::string& who, int group_rank) {
    throw CommAbortedError(fmt::format("[comm] {} failed: in group '{}', {}", who, name,
                                       exit_reasons[group_rank]));
  }
};

class ThreadsWorld {
 public:
  explicit ThreadsWorld(int size) : size_(size) {}
  std::shared_ptr<SharedGroup> group(const std::string& key, const std::string& name,
                                     const std::vector<int>& members) {
    std::lock_guard<std::mutex> lock(mu_);
    auto& g = groups_[key];
    if (!g) {
      g = std::make_shared<SharedGroup>(name, members);
      if (aborted_) g->abort(reason_);
      for (size_t i = 0; i < members.size(); ++i) {
        if (exited_.count(members[i])) g->member_exited(static_cast<int>(i), exit_reason(members[i]));
      }
    }
    return g;
  }
  // A rank whose function returned can never join another collective nor
  // p2p: its peers' calls that need it fail at once instead of timing out.
  void rank_exited(int rank) {
    std::lock_guard<std::mutex> lock(mu_);
    exited_.insert(rank);
    for (auto& [key, g] : groups_) {
      auto it = std::find(g->members.begin(), g->members.end(), rank);
      if (it != g->members.end()) {
        g->member_exited(static_cast<int>(it - g->members.begin()), exit_reason(rank));
      }
    }
  }
  void abort_all(const std::string& reason) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!aborted_) {
      aborted_ = true;
      reason_ = reason;
    }
    for (auto& [key, g] : groups_) g->abort(reason);
  }
  int size() const { return size_; }

 private:
  int size_;
  std::mutex mu_;
  std::map<std::string, std::shared_ptr<SharedGroup>> groups_;
  bool aborted_ = false;
  std::string reason_;
  std::set<int> exited_;

  static std::string exit_reason(int rank) {
    return fmt::format("rank {} returned from its rank function and will not join further "
                       "collectives of this group",
                       rank);
  }
};

namespace {

class ThreadsProcessGroup final : public ProcessGroup {
 public:
  ThreadsProcessGroup(std::shared_ptr<ThreadsWorld> world, std::string key, int rank,
                      std::vector<int> world_ranks, ProcessGroupOptions options)
      : ProcessGroup(rank, static_cast<int>(world_ranks.size()), world_ranks, options),
        world_(std::move(world)),
        key_(std::move(key)),
        shared_(world_->group(key_, options.name, world_ranks)),
        queue_(std::make_unique<TaskQueue>(fmt::format("comm r{} {}", rank, options.name))) {}

  ~ThreadsProcessGroup() override { queue_.reset(); }  // drains pending collectives first

  std::string backend_name() const override { return "threads"; }

 protected:
  void launch(Collective& c) override {
    // The task holds `this`, not a shared_ptr: the destructor drains the queue
    // before any member goes, and a task owning the group would run that
    // destructor on the queue's own thread when the caller let go first
    // (joining itself: std::system_error, terminate).
    LogContext context = current_log_context();
    queue_->push([this, c, context]() mutable {
      set_log_context(context);
      execute(c);
    });
  }

  std::shared_ptr<ProcessGroup> make_subgroup(const std::vector<int>& ranks, int new_rank,
                                              const std::string& name) override {
    std::vector<int> members;
    std::string key = key_ + "/";
    for (int r : ranks) {
      members.push_back(world_ranks()[r]);
      key += std::to_string(world_ranks()[r]) + ",";
    }
    if (new_rank < 0) return nullptr;
    ProcessGroupOptions o = options();
    o.name = name;
    return std::make_shared<ThreadsProcessGroup>(world_, key, new_rank, members, o);
  }

 private:
  void execute(Collective& c) {
    const char* name = collective_name(c.kind);
    int64_t start = trace_enabled() ? trace_now_us() : 0;
    try {
      c.ready.synchronize();
      switch (c.kind) {
        case CollectiveKind::BatchP2P: run_p2p(c); break;
        default: run_collective(c); break;
      }
      c.work->finish();
    } catch (...) {
      // A local failure aborts the group so that peers fail instead of waiting.
      std::string msg;
      try {
        throw;
      } catch (const std::exception& e) {
        msg = e.what();
      }
      shared_->abort(fmt::format("rank {} failed in #{} {}: {}", rank(), c.entry.seq, name, msg));
      c.work->finish(std::current_exception());
    }
    if (trace_enabled()) {
      trace_complete("comm", fmt::format("{} #{}", name, c.entry.seq), start, trace_now_us() - start,
                     fmt::format("\"seq\":{},\"group\":\"{}\"", c.entry.seq, options().name),
                     fmt::format("comm r{} {}", rank(), options().name));
    }
  }

  // Meets every member (bounded). On timeout the group is aborted with a
  // report of who arrived, who did not, and this rank's ledger tail.
  void arrive(const Collective& c, const char* phase) {
    SharedGroup& g = *shared_;
    std::unique_lock<std::mutex> lock(g.mu);
    std::string who = fmt::format("rank {} at #{} {}", rank(), c.entry.seq, collective_name(c.kind));
    if (g.aborted) g.throw_aborted(who);
    if (g.first_exited >= 0) g.throw_exited(who, g.first_exited);
    uint64_t gen = g.generation;
    g.arrived_mask[rank()] = true;
    if (++g.arrived == g.size) {
      g.arrived = 0;
      std::fill(g.arrived_mask.begin(), g.arrived_mask.end(), false);
      ++g.generation;
      g.cv.notify_all();
      return;
    }
    // A member that exited has drained its own collectives, so it can
    // never arrive here.
    auto released = [&] { return g.generation != gen || g.aborted || g.first_exited >= 0; };
    if (!g.cv.wait_for(lock, timeout(), released)) {
      std::vector<int> arrived_ranks, missing_ranks;
      for (int r = 0; r < g.size; ++r) (g.arrived_mask[r] ? arrived_ranks : missing_ranks).push_back(r);
      std::string arrived = fmt::format("{}", fmt::join(arrived_ranks, ","));
      std::string missing = fmt::format("{}", fmt::join(missing_ranks, ","));
      std::string report = fmt::format(
          "[comm::watchdog] {} waited {} ms in #{} {} ({}) for all {} ranks; arrived: [{}], "
          "missing: [{}]. Last collectives of this rank:\n{}",
          where(), timeout().count(), c.entry.seq, collective_name(c.kind), phase, g.size, arrived,
          missing, ledger().tail_str(8));
      g.abort_locked(fmt::format("rank {} timed out in #{} {} waiting for ranks [{}]", rank(),
                                 c.entry.seq, collective_name(c.kind), missing));
      log_error("{}", report);
      throw TimeoutError(report);
    }
    if (g.generation == gen) {
      if (g.aborted) g.throw_aborted(who);
      g.throw_exited(who, g.first_exited);
    }
  }

  void check_fingerprints(const Collective& c) {
    if (!options().checked) return;
    SharedGroup& g = *shared_;
    const Slot& mine = g.slots[rank()];
    for (int r = 0; r < g.size; ++r) {
      const Slot& other = g.slots[r];
      if (other.entry.fingerprint() != mine.entry.fingerprint()) {
        throw Error(fmt::format(
            "[comm::checked] {}: collectives diverge: rank {} launched {} while rank {} launched "
            "{} (same position in the group's launch order; check that every rank issues the "
            "same collectives in the same order with the same shapes)",
            where(), rank(), mine.entry.str(), r, other.entry.str()));
      }
    }
  }

  void run_collective(Collective& c) {
    SharedGroup& g = *shared_;
    {
      std::lock_guard<std::mutex> lock(g.mu);
      Slot& s = g.slots[rank()];
      s.input = c.input;
      s.entry = c.entry;
      s.input_splits = c.input_splits;
      s.output_splits = c.output_splits;
      s.root = c.peer;
    }
    arrive(c, "posting inputs");
    std::exception_ptr local;
    try {
      check_fingerprints(c);
      compute(c);
    } catch (...) {
      local = std::current_exception();
    }
    // Inputs stay posted until every rank has read them.
    arrive(c, "reading peers");
    {
      std::lock_guard<std::mutex> lock(g.mu);
      g.slots[rank()].input = Tensor();
    }
    if (local) std::rethrow_exception(local);
  }

  // Reads the peers' posted inputs into c.output. Runs between the two barriers.
  void compute(Collective& c) {
    SharedGroup& g = *shared_;
    auto bytes_of = [](const Tensor& t) { return t.nbytes(); };
    switch (c.kind) {
      case CollectiveKind::Barrier: return;
      case CollectiveKind::AllReduce: {
        std::memcpy(c.output.raw_data(), g.slots[0].input.raw_data(), bytes_of(c.output));
        for (int r = 1; r < g.size; ++r) reduce_into(c.op, c.output, g.slots[r].input);
        finish_average(c.op, c.output, g.size);
        return;
      }
      case CollectiveKind::Broadcast: {
        const Tensor& src = g.slots[c.peer].input;
        std::memcpy(c.output.raw_data(), src.raw_data(), bytes_of(c.output));
        return;
      }
      case CollectiveKind::AllGather: {
        size_t chunk = bytes_of(c.input);
        for (int r = 0; r < g.size; ++r) {
          std::memcpy(static_cast<char*>(c.output.raw_data()) + r * chunk,
                      g.slots[r].input.raw_data(), chunk);
        }
        return;
      }
      case CollectiveKind::ReduceScatter: {
        size_t chunk = bytes_of(c.output);
        auto part = [&](int r) {
          const Tensor& in = g.slots[r].input;
          return Tensor(in.storage(), c.output.shape(), c.output.strides(),
                        in.storage_offset() + static_cast<int64_t>(rank()) * c.output.numel(),
                        in.dtype());
        };
        std::memcpy(c.output.raw_data(), part(0).raw_data(), chunk);
        for (int r = 1; r < g.size; ++r) reduce_into(c.op, c.output, part(r));
        finish_average(c.op, c.output, g.size);
        return;
      }
      case CollectiveKind::AllToAll: {
        const int64_t row_bytes =
            c.input.shape()[0] > 0 ? static_cast<int64_t>(bytes_of(c.input)) / c.input.shape()[0]
                                   : static_cast<int64_t>(c.output.shape()[0] > 0
                                                              ? bytes_of(c.output) / c.output.shape()[0]
                                                              : 0);
        char* out = static_cast<char*>(c.output.raw_data());
        for (int r = 0; r < g.size; ++r) {
          const Slot& peer = g.slots[r];
          TANDEM_CHECK(peer.input_splits[rank()] == c.output_splits[r],
                       "[comm::all_to_all] {}: split sizes disagree: rank {} sends {} rows to rank "
                       "{}, which expects {} rows from it",
                       where(), r, peer.input_splits[rank()], rank(), c.output_splits[r]);
          int64_t offset = 0;
          for (int j = 0; j < rank(); ++j) offset += peer.input_splits[j];
          const int64_t n = c.output_splits[r] * row_bytes;
          if (n > 0) {
            std::memcpy(out, static_cast<const char*>(peer.input.raw_data()) + offset * row_bytes,
                        static_cast<size_t>(n));
          }
          out += n;
        }
        return;
      }
      default:
        unsupported(collective_name(c.kind));
    }
  }

  void run_p2p(Collective& c) {
    SharedGroup& g = *shared_;
    std::vector<std::shared_ptr<std::atomic<bool>>> sent;
    {
      std::lock_guard<std::mutex> lock(g.mu);
      if (g.aborted) g.throw_aborted(fmt::format("rank {} at #{} p2p", rank(), c.entry.seq));
      for (const P2POp& op : c.p2p) {
        if (op.kind != P2POp::Kind::Send) continue;
        auto flag = std::make_shared<std::atomic<bool>>(false);
        LedgerEntry e = c.entry;
        e.dtype = dtype_name(op.tensor.dtype());
        e.counts = op.tensor.shape().vec();
        g.mail[{rank(), op.peer, op.tag_id}].push_back(Message{op.tensor, e, flag});
        sent.push_back(flag);
      }
      g.cv.notify_all();
    }
    size_t recv_index = 0;
    for (const P2POp& op : c.p2p) {
      if (op.kind != P2POp::Kind::Recv) continue;
      const Tensor& out = c.p2p_outputs[recv_index++];
      std::unique_lock<std::mutex> lock(g.mu);
      auto& box = g.mail[{op.peer, rank(), op.tag_id}];
      if (!g.cv.wait_for(lock, timeout(), [&] { return !box.empty() || g.aborted; })) {
        std::string report = fmt::format(
            "[comm::watchdog] {} waited {} ms in #{} recv from rank {} (tag {}) and nothing "
            "came. Last collectives of this rank:\n{}",
            where(), timeout().count(), c.entry.seq, op.peer, op.tag_id, ledger().tail_str(8));
        g.abort_locked(fmt::format("rank {} timed out in #{} recv from rank {}", rank(),
                                   c.entry.seq, op.peer));
        log_error("{}", report);
        throw TimeoutError(report);
      }
      if (box.empty()) g.throw_aborted(fmt::format("rank {} at #{} recv", rank(), c.entry.seq));
      Message m = std::move(box.front());
      box.pop_front();
      lock.unlock();
      if (m.data.shape() != out.shape() || m.data.dtype() != out.dtype()) {
        m.consumed->store(true);
        g.cv.notify_all();
        TANDEM_FAIL(
            "[comm::recv] {}: rank {} sent {} {} but rank {} expected {} {} (tag {})", where(),
            op.peer, dtype_name(m.data.dtype()), m.data.shape(), rank(), dtype_name(out.dtype()),
            out.shape(), op.tag_id);
      }
      std::memcpy(out.raw_data(), m.data.raw_data(), out.nbytes());
      m.consumed->store(true);
      std::lock_guard<std::mutex> relock(g.mu);
      g.cv.notify_all();
    }
    // Sends complete once received (the input may be reused afterwards).
    std::unique_lock<std::mutex> lock(g.mu);
    for (auto& flag : sent) {
      if (!g.cv.wait_for(lock, timeout(), [&] { return flag->load() || g.aborted; })) {
        std::string report = fmt::format(
            "[comm::watchdog] {} waited {} ms in #{} for a send to be received. Last "
            "collectives of this rank:\n{}",
            where(), timeout().count(), c.entry.seq, ledger().tail_str(8));
        g.abort_locked(fmt::format("rank {} timed out in #{} send", rank(), c.entry.seq));
        throw TimeoutError(report);
      }
      if (!flag->load()) g.throw_aborted(fmt::format("rank {} at #{} send", rank(), c.entry.seq));
    }
  }

  std::shared_ptr<ThreadsWorld> world_;
  std::string key_;
  std::shared_ptr<SharedGroup> shared_;
  std::unique_ptr<TaskQueue> queue_;
};

}  // namespace

void run_ranks(int world_size, const std::function<void(ProcessGroupPtr)>& fn,
               ProcessGroupOptions options) {
  TANDEM_CHECK(world_size >= 1, "[comm::run_ranks] expected world_size >= 1, got {}", world_size);
  auto world = std::make_shared<ThreadsWorld>(world_size);
  std::vector<int> ranks(static_cast<size_t>(world_size));
  for (int r = 0; r < world_size; ++r) ranks[r] = r;
  std::mutex mu;
  std::exception_ptr first, first_root_cause;
  std::vector<std::thread> threads;
  for (int r = 0; r < world_size; ++r) {
    threads.emplace_back([&, r] {
      set_log_context(LogContext{r, world_size});
      set_thread_name(fmt::format("rank {}", r));
      try {
        auto group = std::make_shared<ThreadsProcessGroup>(world, "world", r, ranks, options);
        fn(group);
        group.reset();  // drains this rank's pending collectives
        world->rank_exited(r);
      } catch (const std::exception& e) {
        bool induced = dynamic_cast<const CommAbortedError*>(&e) != nullptr;
        {
          std::lock_guard<std::mutex> lock(mu);
          if (!first) first = std::current_exception();
          if (!induced && !first_root_cause) first_root_cause = std::current_exception();
        }
        world->abort_all(fmt::format("rank {} failed: {}", r, e.what()));
      }
    });
  }
  for (auto& t : threads) t.join();
  if (first_root_cause) std::rethrow_exception(first_root_cause);
  if (first) std::rethrow_exception(first);
}

}  // namespace tandem
