#include "comm/threads/threads_backend.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstring>
#include <ctime>
#include <deque>
#include <map>
#include <set>
#include <thread>
#include <type_traits>
#include <utility>

#include <fmt/ranges.h>

#include "runtime/error.h"
#include "runtime/logging.h"
#include "runtime/task_queue.h"
#include "runtime/trace.h"
#include "tensor/dtype.h"

namespace tandem {
namespace {

// A message of the p2p mailbox: the sender's tensor, read in place by the
// receiver, who then sets `consumed`.
struct Message {
  Tensor data;
  LedgerEntry entry;
  std::shared_ptr<std::atomic<bool>> consumed;
};

// Sleeps while `word` holds `expected`, at most `timeout` (a wake-up may be
// spurious: callers re-check). Linux futexes: one syscall to sleep, one to
// wake every sleeper, and no mutex for the woken threads to queue on.
void futex_wait(std::atomic<uint32_t>& word, uint32_t expected, std::chrono::nanoseconds timeout) {
  static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t));
  const auto ns = timeout.count();
  timespec ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT_PRIVATE, expected, &ts, nullptr,
          0);
}

void futex_wake_all(std::atomic<uint32_t>& word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr,
          nullptr, 0);
}

// Note [Threads barrier]
// ~~~~~~~~~~~~~~~~~~~~~~~
// A collective meets its group two or three times, so the barrier's wake-up
// latency is most of the cost of a small collective. It is a generation
// counter: the last rank to arrive resets the count and bumps the
// generation; the others first yield their core a couple of times
// (kSpinYields: a peer that is runnable on the same core gets there without
// a sleep and a wake-up), then sleep on the group's futex
// word `wake_seq`, bounded by the group's timeout. The last arrival bumps
// `wake_seq` and wakes the sleepers only when there are some (`sleepers` is
// read after the generation store and incremented before the sleeper's last
// check, all sequentially consistent, so a sleeper either sees the new
// generation or is woken). Aborts and exits bump `wake_seq` too, and every
// wake-up re-checks why the rank waits. Longer spinning (up to 50 us of
// yields, or pause loops) measured no faster, or much slower, on the small
// shared machines the suite runs on: there the spinners mostly hand the core
// to each other instead of to the rank that is late.
constexpr int kSpinYields = 2;

template <class F>
bool spin_until(F&& done) {
  for (int i = 0; i < kSpinYields; ++i) {
    if (done()) return true;
    std::this_thread::yield();
  }
  return done();
}

// Note [Threads reductions]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// out[i] = in_0[i] op in_1[i] op ... op in_{n-1}[i] in rank order, stored in
// the dtype after every step (exactly what a chain of reduce_into() calls
// computes, with the same arithmetic), then divided by n for Avg. Every rank,
// and every way of splitting the elements between ranks, so produces the
// same bits. The partial result of a block of elements stays in cache while
// the ranks' inputs stream through, instead of one pass over the whole
// output per rank.
//
// An all_reduce of at least kSplitAllReduceBytes is split, reduce-scatter
// style: after the first barrier each rank reduces 1/n of the elements into
// its own output, meets the others again, and copies the other chunks from
// their outputs. Each rank then reads about 2x the buffer instead of n x, at
// the price of a third barrier, which only pays off for large buffers.
constexpr int64_t kReduceBlock = 8192;
constexpr size_t kSplitAllReduceBytes = 256 * 1024;

// y[i] = f(...f(f(start[i], x[0][i]), x[1][i])..., x[k-1][i]) for k <= 3,
// stored as T after every step. `start` may be `y`.
template <class T, class A, class F>
void accumulate(T* y, const T* start, const T* const* x, int k, int64_t m, F f) {
  switch (k) {
    case 1:
      for (int64_t i = 0; i < m; ++i)
        y[i] = static_cast<T>(f(A(start[i]), A(x[0][i])));
      return;
    case 2:
      for (int64_t i = 0; i < m; ++i) {
        T t = static_cast<T>(f(A(start[i]), A(x[0][i])));
        y[i] = static_cast<T>(f(A(t), A(x[1][i])));
      }
      return;
    default:
      for (int64_t i = 0; i < m; ++i) {
        T t = static_cast<T>(f(A(start[i]), A(x[0][i])));
        t = static_cast<T>(f(A(t), A(x[1][i])));
        y[i] = static_cast<T>(f(A(t), A(x[2][i])));
      }
      return;
  }
}

// `inputs` point at the first element to reduce of each rank's input. Up to
// three ranks are folded in per pass over a block, with the elementwise
// kernels' arithmetic (tensor/cpu/elementwise.cpp), so the bits are those of
// reduce_into() chains.
void reduce_ranks(RedOp op, DType dtype, const std::vector<const void*>& inputs, void* out,
                  int64_t count) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = std::conditional_t<std::is_same_v<T, bool>, int32_t, acc_t<T>>;
    const int n = static_cast<int>(inputs.size());
    auto run = [&](auto f) {
      std::vector<const T*> x(static_cast<size_t>(n));
      for (int64_t b = 0; b < count; b += kReduceBlock) {
        const int64_t m = std::min(kReduceBlock, count - b);
        for (int r = 0; r < n; ++r)
          x[r] = static_cast<const T*>(inputs[r]) + b;
        T* y = static_cast<T*>(out) + b;
        if (n == 1) std::copy(x[0], x[0] + m, y);
        for (int done = 1; done < n; done += 3) {
          accumulate<T, A>(y, done == 1 ? x[0] : y, x.data() + done, std::min(3, n - done), m, f);
        }
        if (op == RedOp::Avg) {
          if constexpr (std::is_integral_v<A>) {
            for (int64_t i = 0; i < m; ++i)
              y[i] = static_cast<T>(A(y[i]) / static_cast<A>(n));
          } else {
            const A d = static_cast<A>(n);
            for (int64_t i = 0; i < m; ++i)
              y[i] = static_cast<T>(A(y[i]) / d);
          }
        }
      }
    };
    switch (op) {
      case RedOp::Sum:
      case RedOp::Avg:
        run([](A a, A v) { return static_cast<A>(a + v); });
        break;
      case RedOp::Max:
        run([](A a, A v) { return a != a ? a : (a > v ? a : v); });
        break;
      case RedOp::Min:
        run([](A a, A v) { return a != a ? a : (a < v ? a : v); });
        break;
    }
  });
}

// Elements [lo, hi) of `count` that rank r reduces in a split all_reduce.
std::pair<int64_t, int64_t> chunk_of(int r, int n, int64_t count) {
  const int64_t per = (count + n - 1) / n;
  const int64_t lo = std::min<int64_t>(r * per, count);
  return {lo, std::min(lo + per, count)};
}

struct Slot {
  CollectiveKind kind = CollectiveKind::Barrier;
  Tensor input;
  Tensor output;  // read by peers in the second phase of a split all_reduce
  LedgerEntry entry;
  uint64_t fingerprint = 0;  // of entry
  std::vector<int64_t> input_splits, output_splits;
  int root = -1;
};

}  // namespace

// The state one group shares between its member rank threads.
struct SharedGroup {
  SharedGroup(std::string group_name, std::vector<int> world_members)
      : name(std::move(group_name)),
        size(static_cast<int>(world_members.size())),
        members(std::move(world_members)),
        slots(static_cast<size_t>(size)),
        arrivals(static_cast<size_t>(size)),
        exit_reasons(static_cast<size_t>(size)) {}

  std::string name;
  int size;
  std::vector<int> members;  // world ranks
  std::mutex mu;             // guards the strings and the mailbox; `cv` sleeps on it
  std::condition_variable cv;
  // The collective barrier (Note [Threads barrier]).
  std::atomic<uint64_t> generation{0};
  std::atomic<int> arrived{0};
  std::atomic<int> sleepers{0};       // members sleeping in the barrier
  std::atomic<uint32_t> wake_seq{0};  // their futex word: bumped to wake them
  // Each rank's own slot, written by it before a barrier and read by the
  // others after it (the barrier orders the accesses).
  std::vector<Slot> slots;
  std::vector<std::atomic<uint64_t>> arrivals;  // barriers entered, by group rank
  // Set once, under `mu`, after abort_reason is written.
  std::atomic<bool> aborted{false};
  std::string abort_reason;
  // Members whose rank function returned (by group rank; empty = still
  // running). No collective can complete once one has gone, but p2p between
  // the others still can, so an exit is not an abort. Written under `mu`,
  // before first_exited is set.
  std::vector<std::string> exit_reasons;
  std::atomic<int> first_exited{-1};
  std::map<std::tuple<int, int, int>, std::deque<Message>> mail;  // (src, dst, tag)

  void abort(const std::string& reason) {
    std::lock_guard<std::mutex> lock(mu);
    abort_locked(reason);
  }
  void abort_locked(const std::string& reason) {
    if (!aborted.load()) {
      abort_reason = reason;
      aborted.store(true);
    }
    cv.notify_all();
    wake_barrier();
  }
  // Wakes every rank sleeping in the barrier (it re-checks why it waits).
  void wake_barrier() {
    wake_seq.fetch_add(1);
    futex_wake_all(wake_seq);
  }
  [[noreturn]] void throw_aborted(const std::string& who) {
    throw CommAbortedError(
        fmt::format("[comm] {} failed: group '{}' was aborted: {}", who, name, abort_reason));
  }
  void member_exited(int group_rank, const std::string& reason) {
    std::lock_guard<std::mutex> lock(mu);
    if (exit_reasons[group_rank].empty()) exit_reasons[group_rank] = reason;
    if (first_exited.load() < 0) first_exited.store(group_rank);
    cv.notify_all();
    wake_barrier();
  }
  bool exited(int group_rank) const { return !exit_reasons[group_rank].empty(); }
  [[noreturn]] void throw_exited(const std::string& who, int group_rank) {
    throw CommAbortedError(
        fmt::format("[comm] {} failed: in group '{}', {}", who, name, exit_reasons[group_rank]));
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
        if (exited_.count(members[i]))
          g->member_exited(static_cast<int>(i), exit_reason(members[i]));
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
    for (auto& [key, g] : groups_)
      g->abort(reason);
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
    return fmt::format(
        "rank {} returned from its rank function and will not join further "
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

  void abort(const std::string& reason) override {
    shared_->abort(fmt::format("rank {} aborted the group: {}", rank(), reason));
  }

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
        case CollectiveKind::BatchP2P:
          run_p2p(c);
          break;
        default:
          run_collective(c);
          break;
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
      trace_complete("comm", fmt::format("{} #{}", name, c.entry.seq), start,
                     trace_now_us() - start,
                     fmt::format("\"seq\":{},\"group\":\"{}\"", c.entry.seq, options().name),
                     fmt::format("comm r{} {}", rank(), options().name));
    }
  }

  // Meets every member (bounded; Note [Threads barrier]). On timeout the
  // group is aborted with a report of who arrived, who did not, and this
  // rank's ledger tail.
  void arrive(const Collective& c, const char* phase) {
    SharedGroup& g = *shared_;
    auto who = [&] {
      return fmt::format("rank {} at #{} {}", rank(), c.entry.seq, collective_name(c.kind));
    };
    if (g.aborted.load()) g.throw_aborted(who());
    if (int gone = g.first_exited.load(); gone >= 0) g.throw_exited(who(), gone);
    const uint64_t gen = g.generation.load();
    const uint64_t entered = g.arrivals[rank()].fetch_add(1) + 1;
    if (g.arrived.fetch_add(1) + 1 == g.size) {
      g.arrived.store(0);  // before the release: nobody arrives at the next barrier earlier
      g.generation.store(gen + 1);
      if (g.sleepers.load() > 0) g.wake_barrier();
      return;
    }
    // A member that exited has drained its own collectives, so it can never
    // arrive here.
    auto released = [&] {
      return g.generation.load() != gen || g.aborted.load() || g.first_exited.load() >= 0;
    };
    const auto deadline = std::chrono::steady_clock::now() + timeout();
    bool woken = spin_until(released);
    while (!woken) {
      const uint32_t seq = g.wake_seq.load();
      const auto left = deadline - std::chrono::steady_clock::now();
      if (left <= std::chrono::steady_clock::duration::zero()) break;
      g.sleepers.fetch_add(1);
      if (!released()) futex_wait(g.wake_seq, seq, left);
      g.sleepers.fetch_sub(1);
      woken = released();
    }
    if (!woken) {
      std::lock_guard<std::mutex> lock(g.mu);
      std::vector<int> arrived_ranks, missing_ranks;
      for (int r = 0; r < g.size; ++r) {
        (g.arrivals[r].load() >= entered ? arrived_ranks : missing_ranks).push_back(r);
      }
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
    if (g.generation.load() == gen) {
      if (g.aborted.load()) g.throw_aborted(who());
      g.throw_exited(who(), g.first_exited.load());
    }
  }

  void check_fingerprints(const Collective& c) {
    if (!options().checked) return;
    SharedGroup& g = *shared_;
    const Slot& mine = g.slots[rank()];
    for (int r = 0; r < g.size; ++r) {
      const Slot& other = g.slots[r];
      if (other.fingerprint != mine.fingerprint) {
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
    Slot& s = g.slots[rank()];
    s.kind = c.kind;
    s.input = c.input;
    s.output = c.output;
    s.entry = c.entry;
    s.fingerprint = c.entry.fingerprint();
    s.input_splits = c.input_splits;
    s.output_splits = c.output_splits;
    s.root = c.peer;
    arrive(c, "posting inputs");
    // Whether this all_reduce is split (Note [Threads reductions]) depends
    // only on what rank 0 posted, so every rank meets the same barriers even
    // when checked mode is off and the ranks disagree.
    const Slot& first = g.slots[0];
    const bool split = g.size > 1 && first.kind == CollectiveKind::AllReduce &&
                       first.input.nbytes() >= kSplitAllReduceBytes;
    const bool mine_split = split && c.kind == CollectiveKind::AllReduce;
    std::exception_ptr local;
    try {
      check_fingerprints(c);
      if (mine_split) {
        reduce_own_chunk(c);
      } else {
        compute(c);
      }
    } catch (...) {
      local = std::current_exception();
    }
    if (split) {
      // Chunks stay in the outputs until every rank has copied them.
      arrive(c, "reducing chunks");
      if (mine_split && !local) {
        try {
          copy_peer_chunks(c);
        } catch (...) {
          local = std::current_exception();
        }
      }
    }
    // Inputs stay posted until every rank has read them.
    arrive(c, "reading peers");
    s.input = Tensor();
    s.output = Tensor();
    if (local) std::rethrow_exception(local);
  }

  // First phase of a split all_reduce: this rank's chunk of every input,
  // reduced into the same chunk of its output.
  void reduce_own_chunk(Collective& c) {
    SharedGroup& g = *shared_;
    const int64_t count = c.input.numel();
    for (int r = 0; r < g.size; ++r) {
      const Slot& peer = g.slots[r];
      // Only reachable with checked mode off; guards the reads below.
      TANDEM_CHECK(peer.kind == CollectiveKind::AllReduce && peer.input.numel() == count &&
                       peer.input.dtype() == c.input.dtype(),
                   "[comm::all_reduce] {}: rank {} posted {} while rank {} all_reduces {} {} "
                   "(checked mode is off)",
                   where(), r, peer.entry.str(), rank(), dtype_name(c.input.dtype()),
                   c.input.shape());
    }
    auto [lo, hi] = chunk_of(rank(), g.size, count);
    if (hi <= lo) return;
    const size_t element = c.input.element_size();
    std::vector<const void*> inputs(static_cast<size_t>(g.size));
    for (int r = 0; r < g.size; ++r) {
      inputs[r] = static_cast<const char*>(g.slots[r].input.raw_data()) + lo * element;
    }
    reduce_ranks(c.op, c.input.dtype(), inputs,
                 static_cast<char*>(c.output.raw_data()) + lo * element, hi - lo);
  }

  // Second phase: the other ranks' reduced chunks, from their outputs.
  void copy_peer_chunks(Collective& c) {
    SharedGroup& g = *shared_;
    const int64_t count = c.output.numel();
    const size_t element = c.output.element_size();
    for (int r = 0; r < g.size; ++r) {
      auto [lo, hi] = chunk_of(r, g.size, count);
      if (r == rank() || hi <= lo) continue;
      std::memcpy(static_cast<char*>(c.output.raw_data()) + lo * element,
                  static_cast<const char*>(g.slots[r].output.raw_data()) + lo * element,
                  static_cast<size_t>(hi - lo) * element);
    }
  }

  // Reads the peers' posted inputs into c.output. Runs between the two barriers.
  void compute(Collective& c) {
    SharedGroup& g = *shared_;
    auto bytes_of = [](const Tensor& t) { return t.nbytes(); };
    switch (c.kind) {
      case CollectiveKind::Barrier:
        return;
      case CollectiveKind::AllReduce: {
        std::vector<const void*> inputs(static_cast<size_t>(g.size));
        for (int r = 0; r < g.size; ++r)
          inputs[r] = g.slots[r].input.raw_data();
        reduce_ranks(c.op, c.output.dtype(), inputs, c.output.raw_data(), c.output.numel());
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
        const size_t offset = static_cast<size_t>(rank()) * bytes_of(c.output);
        std::vector<const void*> inputs(static_cast<size_t>(g.size));
        for (int r = 0; r < g.size; ++r) {
          inputs[r] = static_cast<const char*>(g.slots[r].input.raw_data()) + offset;
        }
        reduce_ranks(c.op, c.output.dtype(), inputs, c.output.raw_data(), c.output.numel());
        return;
      }
      case CollectiveKind::AllToAll: {
        const int64_t row_bytes =
            c.input.shape()[0] > 0
                ? static_cast<int64_t>(bytes_of(c.input)) / c.input.shape()[0]
                : static_cast<int64_t>(
                      c.output.shape()[0] > 0 ? bytes_of(c.output) / c.output.shape()[0] : 0);
        std::vector<int64_t> out_row(static_cast<size_t>(g.size) + 1, 0);  // prefix sums
        for (int r = 0; r < g.size; ++r) {
          const Slot& peer = g.slots[r];
          TANDEM_CHECK(peer.input_splits[rank()] == c.output_splits[r],
                       "[comm::all_to_all] {}: split sizes disagree: rank {} sends {} rows to rank "
                       "{}, which expects {} rows from it",
                       where(), r, peer.input_splits[rank()], rank(), c.output_splits[r]);
          out_row[r + 1] = out_row[r] + c.output_splits[r];
        }
        char* out = static_cast<char*>(c.output.raw_data());
        for (int r = 0; r < g.size; ++r) {
          const Slot& peer = g.slots[r];
          int64_t offset = 0;
          for (int k = 0; k < rank(); ++k)
            offset += peer.input_splits[k];
          const int64_t n = c.output_splits[r] * row_bytes;
          if (n > 0) {
            std::memcpy(out + out_row[r] * row_bytes,
                        static_cast<const char*>(peer.input.raw_data()) + offset * row_bytes,
                        static_cast<size_t>(n));
          }
        }
        return;
      }
      default:
        unsupported(collective_name(c.kind));
    }
  }

  void run_p2p(Collective& c) {
    SharedGroup& g = *shared_;
    std::vector<std::pair<int, std::shared_ptr<std::atomic<bool>>>> sent;  // (peer, received)
    {
      std::lock_guard<std::mutex> lock(g.mu);
      std::string who = fmt::format("rank {} at #{} p2p", rank(), c.entry.seq);
      if (g.aborted.load()) g.throw_aborted(who);
      for (const P2POp& op : c.p2p) {
        if (g.exited(op.peer)) g.throw_exited(who, op.peer);
      }
      for (const P2POp& op : c.p2p) {
        if (op.kind != P2POp::Kind::Send) continue;
        auto flag = std::make_shared<std::atomic<bool>>(false);
        LedgerEntry e = c.entry;
        e.dtype = dtype_name(op.tensor.dtype());
        e.counts = op.tensor.shape().vec();
        g.mail[{rank(), op.peer, op.tag_id}].push_back(Message{op.tensor, e, flag});
        sent.emplace_back(op.peer, flag);
      }
      g.cv.notify_all();
    }
    size_t recv_index = 0;
    for (const P2POp& op : c.p2p) {
      if (op.kind != P2POp::Kind::Recv) continue;
      const Tensor& out = c.p2p_outputs[recv_index++];
      std::unique_lock<std::mutex> lock(g.mu);
      auto& box = g.mail[{op.peer, rank(), op.tag_id}];
      auto ready = [&] { return !box.empty() || g.aborted.load() || g.exited(op.peer); };
      if (!g.cv.wait_for(lock, timeout(), ready)) {
        std::string report = fmt::format(
            "[comm::watchdog] {} waited {} ms in #{} recv from rank {} (tag {}) and nothing "
            "came. Last collectives of this rank:\n{}",
            where(), timeout().count(), c.entry.seq, op.peer, op.tag_id, ledger().tail_str(8));
        g.abort_locked(fmt::format("rank {} timed out in #{} recv from rank {}", rank(),
                                   c.entry.seq, op.peer));
        log_error("{}", report);
        throw TimeoutError(report);
      }
      if (box.empty()) {
        std::string who = fmt::format("rank {} at #{} recv", rank(), c.entry.seq);
        if (g.aborted.load()) g.throw_aborted(who);
        g.throw_exited(who, op.peer);  // an exited rank's sends were all received
      }
      Message m = std::move(box.front());
      box.pop_front();
      lock.unlock();
      if (m.data.shape() != out.shape() || m.data.dtype() != out.dtype()) {
        m.consumed->store(true);
        {
          std::lock_guard<std::mutex> relock(g.mu);  // no lost wake-up of the sender
          g.cv.notify_all();
        }
        TANDEM_FAIL("[comm::recv] {}: rank {} sent {} {} but rank {} expected {} {} (tag {})",
                    where(), op.peer, dtype_name(m.data.dtype()), m.data.shape(), rank(),
                    dtype_name(out.dtype()), out.shape(), op.tag_id);
      }
      std::memcpy(out.raw_data(), m.data.raw_data(), out.nbytes());
      m.consumed->store(true);
      std::lock_guard<std::mutex> relock(g.mu);
      g.cv.notify_all();
    }
    // Sends complete once received (the input may be reused afterwards).
    std::unique_lock<std::mutex> lock(g.mu);
    for (auto& [peer, flag] : sent) {
      // Named captures: clang 14 (the fuzz build) cannot capture structured bindings.
      auto received = [&, &flag = flag, peer = peer] {
        return flag->load() || g.aborted.load() || g.exited(peer);
      };
      if (!g.cv.wait_for(lock, timeout(), received)) {
        std::string report = fmt::format(
            "[comm::watchdog] {} waited {} ms in #{} for a send to be received. Last "
            "collectives of this rank:\n{}",
            where(), timeout().count(), c.entry.seq, ledger().tail_str(8));
        g.abort_locked(fmt::format("rank {} timed out in #{} send", rank(), c.entry.seq));
        throw TimeoutError(report);
      }
      if (!flag->load()) {
        std::string who = fmt::format("rank {} at #{} send", rank(), c.entry.seq);
        if (g.aborted.load()) g.throw_aborted(who);
        g.throw_exited(who, peer);
      }
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
  for (int r = 0; r < world_size; ++r)
    ranks[r] = r;
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
  for (auto& t : threads)
    t.join();
  if (first_root_cause) std::rethrow_exception(first_root_cause);
  if (first) std::rethrow_exception(first);
}

}  // namespace tandem
