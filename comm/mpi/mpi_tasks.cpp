// The tasks the MPI executor runs: collectives, point-to-point batches, the
// checked-mode handshake, the fingerprint board's set-up and splits (the
// duplicate of MPI_COMM_WORLD is in mpi_backend.cpp).
//
// A task is a chain of stages. A stage posts nonblocking MPI calls (post())
// and names what runs once they have all completed (then()); the executor
// calls advance(), which tests the requests and runs the next stage, until a
// stage calls done(). Everything a pending request may read or write lives in
// the task's Scratch, which an orphan keeps alive when the task is abandoned
// (Note [One MPI executor]).
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <optional>
#include <random>
#include <thread>

#include <fmt/ranges.h>

#include "tandem/comm/mpi/mpi_check.h"
#include "tandem/comm/mpi/mpi_group.h"
#include "tandem/runtime/config.h"
#include "tandem/runtime/logging.h"
#include "tandem/runtime/trace.h"
#include "tandem/tensor/kernels.h"

namespace tandem::mpi {
namespace {

using Clock = std::chrono::steady_clock;

// The checked-mode exchange: a fixed-size record per rank, then (only when
// they disagree) a fixed-size description per rank, or the split lists.
//
// An all_to_all also checks its split sizes in the same exchange: rank r
// adds h(r, q, rows r sends q) over q to `sent` and h(s, r, rows r expects
// from s) over s to `expected`; the sums over ranks agree exactly when every
// sender and receiver agree (but for a 2^-64 chance). Only when they do not,
// a second round gathers the lists to name the pair. So a checked all_to_all
// costs one small collective before the data moves, like any other (or
// none: Note [MPI fingerprint board]). Hello is in mpi_board.h.
constexpr size_t kDescBytes = 1024;

// h(sender, receiver, rows) of the split check (splitmix64's finaliser).
uint64_t split_term(int sender, int receiver, int64_t rows) {
  uint64_t z = static_cast<uint64_t>(rows) * 0x9e3779b97f4a7c15ull ^
               (static_cast<uint64_t>(sender) << 32 | static_cast<uint32_t>(receiver));
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Everything pending requests may touch.
struct Scratch {
  std::vector<Tensor> tensors;
  Hello hello{};
  std::vector<Hello> hellos;
  std::vector<char> desc, descs;
  std::vector<int64_t> splits, all_splits;  // this rank's input then output splits; every rank's
  std::vector<int> send_counts, send_displs, recv_counts, recv_displs;
  // The board's set-up (BoardTask): {node id, pid, nonce} then "mapped" per rank.
  std::vector<uint64_t> place, places;
  int32_t mapped = 0;
  std::vector<int32_t> all_mapped;
};

class StagedTask : public Task {
 public:
  StagedTask(std::shared_ptr<MpiProcessGroup> group, LedgerEntry entry)
      : group_(std::move(group)), entry_(std::move(entry)), scratch_(std::make_shared<Scratch>()) {}

  ~StagedTask() override {
    if (!begun_ || !trace_enabled()) return;
    try {
      trace_complete("comm", fmt::format("{} #{}", entry_.op, entry_.seq), start_us_,
                     trace_now_us() - start_us_,
                     fmt::format("\"seq\":{},\"group\":\"{}\"", entry_.seq, group_->options().name),
                     fmt::format("comm r{} mpi", group_->world_ranks()[group_->rank()]));
    } catch (...) {  // tracing must never fail a destructor
    }
  }

  std::string label() const override {
    return fmt::format("{} #{} {}", group_->where(), entry_.seq, entry_.op);
  }

  bool advance() final {
    const bool first = !begun_;
    if (first) {
      if (!ready()) return false;
      begun_ = true;
      started_ = Clock::now();
      deadline_ = started_ + group_->timeout();
      start_us_ = trace_enabled() ? trace_now_us() : 0;
    }
    try {
      if (first) begin();
      while (!done_) {
        if (poll_) {
          if (!poll_()) {
            if (Clock::now() > deadline_) {
              waiting_for_ = poll_what_();
              expire();
            }
            std::this_thread::yield();  // the ranks it waits for may need this core
            return false;
          }
          poll_ = nullptr;
        }
        if (!requests_.empty()) {
          int flag = 0;
          statuses_.resize(requests_.size());
          int rc = MPI_Testall(static_cast<int>(requests_.size()), requests_.data(), &flag,
                               statuses_.data());
          if (rc != MPI_SUCCESS) fail_mpi(rc);
          if (flag == 0) {
            if (Clock::now() > deadline_) expire();
            return false;
          }
          requests_.clear();
        }
        TANDEM_INTERNAL_ASSERT(next_ != nullptr, "{}: a stage posted nothing and named no next",
                               label());
        std::function<void()> next = std::move(next_);
        next_ = nullptr;
        next();
      }
    } catch (...) {
      // A stage that throws after posting leaves requests nobody will test:
      // the communicator is in an unknown state.
      if (!requests_.empty()) {
        abandon(fmt::format("rank {} failed in #{} {} with MPI requests pending: {}",
                            group_->rank(), entry_.seq, entry_.op,
                            what_of(std::current_exception())));
      }
      throw;
    }
    return true;
  }

 protected:
  // Called before begin() until true (the input produced).
  virtual bool ready() { return true; }
  // Posts the first stage, or finishes at once.
  virtual void begin() = 0;

  MPI_Request* post() {
    requests_.push_back(MPI_REQUEST_NULL);
    return &requests_.back();
  }
  // `next` runs once every request posted so far has completed; `waiting_for`
  // says what they are, for the watchdog report.
  void then(std::string waiting_for, std::function<void()> next) {
    waiting_for_ = std::move(waiting_for);
    next_ = std::move(next);
  }
  // `next` runs once `ready` returns true, tested at each pass; `waiting_for`
  // says what for when the deadline passes first.
  void poll_until(std::function<bool()> ready, std::function<std::string()> waiting_for,
                  std::function<void()> next) {
    poll_ = std::move(ready);
    poll_what_ = std::move(waiting_for);
    next_ = std::move(next);
  }
  void done() { done_ = true; }
  // Statuses of the requests of the stage that just completed, in post order.
  const std::vector<MPI_Status>& statuses() const { return statuses_; }
  MPI_Comm comm() const { return group_->comm(); }

  // Checked-mode exchange of this task's entry. `local` is an error this rank
  // found before the collective (or null); it fails every rank, naming this
  // one, instead of leaving the peers to time out. `splits`: an all_to_all's
  // input then output split sizes, checked in the same exchange (Hello).
  // Runs `next` when all agree.
  void handshake(std::exception_ptr local, std::function<void()> next,
                 const std::vector<int64_t>* splits = nullptr, int32_t even = -1) {
    local_ = local;
    Scratch& s = *scratch_;
    s.hello = Hello{entry_.fingerprint(), local ? 1 : 0, even, 0, 0};
    const int n = group_->size(), me = group_->rank();
    if (splits != nullptr) {
      s.splits = *splits;
      for (int q = 0; q < n; ++q) {
        s.hello.sent += split_term(me, q, s.splits[q]);
        s.hello.expected += split_term(q, me, s.splits[n + q]);
      }
    }
    s.hellos.assign(static_cast<size_t>(n), Hello{});
    if (Board* board = group_->board()) {
      handshake_on_board(*board, std::move(next));
      return;
    }
    TANDEM_MPI_CHECK(MPI_Iallgather(&s.hello, sizeof(Hello), MPI_BYTE, s.hellos.data(),
                                    sizeof(Hello), MPI_BYTE, comm(), post()));
    then("the checked-mode fingerprint exchange",
         [this, next = std::move(next)]() mutable { compare(std::move(next)); });
  }

  // The same exchange through the group's board (Note [MPI fingerprint board]).
  void handshake_on_board(Board& board, std::function<void()> next) {
    const uint64_t h = group_->next_handshake();
    Board* b = &board;  // the group, which owns it, outlives this task
    auto written = [this, b, h, next = std::move(next)]() mutable {
      b->write(h, scratch_->hello);
      poll_until([b, h] { return b->complete(h); },
                 [b, h] {
                   return fmt::format(
                       "the checked-mode fingerprints of ranks [{}] (handshake {} on the "
                       "shared-memory board, Note [MPI fingerprint board])",
                       fmt::join(b->not_written(h), ","), h);
                 },
                 [this, b, h, next = std::move(next)]() mutable {
                   b->read(h, scratch_->hellos);
                   compare(std::move(next));
                 });
    };
    poll_until([b, h] { return b->slot_free(h); },
               [b, h] {
                 return fmt::format(
                     "ranks [{}] to read handshake {} of the shared-memory board, whose slot "
                     "handshake {} reuses (Note [MPI fingerprint board])",
                     fmt::join(b->not_read(h), ","), h - Board::kSlots, h);
               },
               std::move(written));
  }

  // Decides on the exchanged table (the same on every rank).
  void compare(std::function<void()> next) {
    const Scratch& s = *scratch_;
    bool agree = std::all_of(s.hellos.begin(), s.hellos.end(), [&](const Hello& h) {
      return h.fingerprint == s.hello.fingerprint && h.failed == 0;
    });
    if (!agree) {
      describe();  // every rank saw the same table, so every rank gets here
      return;
    }
    uint64_t sent = 0, expected = 0;
    for (const Hello& h : s.hellos) {
      sent += h.sent;
      expected += h.expected;
    }
    if (sent != expected) {
      gather_splits();  // likewise on every rank
      return;
    }
    all_even_ = std::all_of(s.hellos.begin(), s.hellos.end(),
                            [&](const Hello& h) { return h.even >= 0 && h.even == s.hello.even; });
    next();
  }

  std::shared_ptr<MpiProcessGroup> group_;
  LedgerEntry entry_;
  std::shared_ptr<Scratch> scratch_;
  // Point-to-point requests can be cancelled when abandoned; collectives cannot.
  bool p2p_ = false;
  // Every rank's handshake said its all_to_all counts are even and the same.
  bool all_even_ = false;

 private:
  // Second round of the handshake: every rank's entry (and error), then the error.
  void describe() {
    Scratch& s = *scratch_;
    std::string mine = entry_.str();
    if (local_) mine += " failed: " + what_of(local_);
    s.desc.assign(kDescBytes, '\0');
    std::memcpy(s.desc.data(), mine.data(), std::min(mine.size(), kDescBytes - 1));
    s.descs.assign(kDescBytes * static_cast<size_t>(group_->size()), '\0');
    TANDEM_MPI_CHECK(MPI_Iallgather(s.desc.data(), static_cast<int>(kDescBytes), MPI_BYTE,
                                    s.descs.data(), static_cast<int>(kDescBytes), MPI_BYTE, comm(),
                                    post()));
    then("the checked-mode description exchange", [this] { raise_disagreement(); });
  }

  // Second round of an all_to_all whose split sizes disagree: every rank's
  // lists, then the error naming the first pair that disagrees.
  void gather_splits() {
    Scratch& s = *scratch_;
    const int n = group_->size();
    s.all_splits.assign(2 * static_cast<size_t>(n) * static_cast<size_t>(n), 0);
    TANDEM_MPI_CHECK(MPI_Iallgather(s.splits.data(), 2 * n, MPI_INT64_T, s.all_splits.data(), 2 * n,
                                    MPI_INT64_T, comm(), post()));
    then("the exchange of all_to_all split sizes", [this] { raise_split_disagreement(); });
  }

  [[noreturn]] void raise_split_disagreement() {
    const Scratch& s = *scratch_;
    const int n = group_->size(), me = group_->rank();
    auto list = [&](int r) { return s.all_splits.data() + 2 * static_cast<size_t>(n) * r; };
    for (int q = 0; q < n; ++q) {
      for (int sender = 0; sender < n; ++sender) {
        const int64_t sent = list(sender)[q], expected = list(q)[n + sender];
        if (sent == expected) continue;
        std::string what = fmt::format(
            "split sizes disagree: rank {} sends {} rows to rank {}, which expects {} rows from it",
            sender, sent, q, expected);
        if (q == me) throw Error(fmt::format("[comm::all_to_all] {}: {}", group_->where(), what));
        throw CommAbortedError(fmt::format("[comm::mpi] {}: #{} {} failed on rank {}: {}",
                                           group_->where(), entry_.seq, entry_.op, q, what));
      }
    }
    TANDEM_INTERNAL_ASSERT(false, "{}: split hashes disagree but the lists agree", label());
  }

  [[noreturn]] void raise_disagreement() {
    const Scratch& s = *scratch_;
    auto desc_of = [&](int r) {
      const char* d = s.descs.data() + static_cast<size_t>(r) * kDescBytes;
      return std::string(d, strnlen(d, kDescBytes));
    };
    const int me = group_->rank();
    for (int r = 0; r < group_->size(); ++r) {
      if (s.hellos[r].fingerprint != s.hello.fingerprint) {
        throw Error(fmt::format(
            "[comm::checked] {}: collectives diverge: rank {} launched {} while rank {} launched "
            "{} (same position in the group's launch order; check that every rank issues the "
            "same collectives in the same order with the same shapes)",
            group_->where(), me, desc_of(me), r, desc_of(r)));
      }
    }
    if (local_) std::rethrow_exception(local_);
    for (int r = 0; r < group_->size(); ++r) {
      if (s.hellos[r].failed != 0) {
        throw CommAbortedError(fmt::format("[comm::mpi] {}: #{} {} failed on rank {}: {}",
                                           group_->where(), entry_.seq, entry_.op, r, desc_of(r)));
      }
    }
    TANDEM_INTERNAL_ASSERT(false, "{}: handshake disagreement without a cause", label());
  }

  [[noreturn]] void fail_mpi(int rc) {
    std::string detail = error_string(rc);
    if (rc == MPI_ERR_IN_STATUS) {
      for (size_t i = 0; i < statuses_.size(); ++i) {
        int e = statuses_[i].MPI_ERROR;
        if (e != MPI_SUCCESS && e != MPI_ERR_PENDING) {
          detail += fmt::format("; request {}: {}", i, error_string(e));
        }
      }
    }
    TANDEM_FAIL("[comm::mpi] {}: MPI failed while waiting for {}: {}", label(), waiting_for_,
                detail);
  }

  [[noreturn]] void expire() {
    auto waited =
        std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - started_).count();
    std::string consequence =
        p2p_ ? "Its pending sends and receives were cancelled, but a late message could still "
               "match a later receive, so this communicator is now unusable"
             : "An MPI collective cannot be cancelled, so this communicator is now unusable";
    std::string report = fmt::format(
        "[comm::watchdog] {} waited {} ms in #{} {} for {} (the group's world ranks are [{}]; at "
        "least one of them has not joined). {}: later calls on it fail at once. Last collectives "
        "of this rank:\n{}",
        group_->where(), waited, entry_.seq, entry_.op, waiting_for_,
        fmt::join(group_->world_ranks(), ","), consequence, group_->ledger().tail_str(8));
    abandon(fmt::format("rank {} timed out after {} ms in #{} {} waiting for {}", group_->rank(),
                        waited, entry_.seq, entry_.op, waiting_for_));
    log_error("{}", report);
    throw TimeoutError(report);
  }

  // Gives the pending requests to an orphan and marks the channel unusable.
  void abandon(const std::string& reason) {
    Orphan orphan{{}, scratch_};
    for (MPI_Request& r : requests_) {
      if (r == MPI_REQUEST_NULL) continue;
      if (p2p_) MPI_Cancel(&r);
      orphan.requests.push_back(r);
    }
    requests_.clear();
    next_ = nullptr;
    poll_ = nullptr;
    if (!orphan.requests.empty()) group_->executor().adopt(std::move(orphan));
    group_->channel()->mark_unusable(reason);
  }

  std::vector<MPI_Request> requests_;
  std::vector<MPI_Status> statuses_;
  std::function<bool()> poll_;  // a stage that waits on the board, not on requests
  std::function<std::string()> poll_what_;
  std::function<void()> next_;
  std::string waiting_for_;
  std::exception_ptr local_;
  bool begun_ = false;
  bool done_ = false;
  Clock::time_point started_, deadline_;
  int64_t start_us_ = 0;
};

// ---- collectives and point-to-point batches ----

class CollectiveTask final : public StagedTask {
 public:
  CollectiveTask(std::shared_ptr<MpiProcessGroup> group, Collective c)
      : StagedTask(std::move(group), c.entry), c_(std::move(c)) {
    p2p_ = c_.kind == CollectiveKind::BatchP2P;
  }

  void fail(std::exception_ptr error) noexcept override { c_.work->finish(error); }

 protected:
  bool ready() override {
    if (c_.ready.query()) return true;
    auto now = Clock::now();
    if (!waiting_since_) waiting_since_ = now;
    TANDEM_CHECK(now - *waiting_since_ < wait_timeout(),
                 "[comm::mpi] {}: expected the input to be produced within {} ms, got a stream "
                 "that is stalled or failed",
                 label(), wait_timeout().count());
    return false;
  }

  void begin() override {
    Scratch& s = *scratch_;
    s.tensors = {c_.input, c_.output};
    for (const P2POp& op : c_.p2p)
      s.tensors.push_back(op.tensor);
    for (const Tensor& t : c_.p2p_outputs)
      s.tensors.push_back(t);
    std::exception_ptr local;
    try {
      validate();
    } catch (...) {
      local = std::current_exception();
    }
    if (!group_->options().checked || p2p_) {
      if (local) std::rethrow_exception(local);
      start();
    } else if (c_.kind == CollectiveKind::AllToAll) {
      std::vector<int64_t> splits = c_.input_splits;
      splits.insert(splits.end(), c_.output_splits.begin(), c_.output_splits.end());
      handshake(
          local, [this] { start(); }, &splits, local ? -1 : even_count());
    } else {
      handshake(local, [this] { start(); });
    }
  }

 private:
  // Checks that would otherwise surface as an MPI error on one rank only.
  void validate() {
    if (c_.input.defined()) count_of(c_.input.numel(), collective_name(c_.kind));
    if (c_.output.defined()) count_of(c_.output.numel(), collective_name(c_.kind));
    for (const P2POp& op : c_.p2p) {
      TANDEM_CHECK(op.tag_id >= 0 && op.tag_id <= 32767,
                   "[comm::p2p] expected a tag_id in [0, 32767] (MPI's guaranteed tag range), got "
                   "{} ({})",
                   op.tag_id, group_->where());
    }
  }

  // The element count this rank sends to and receives from every rank, when
  // it is the same for all (else -1).
  int32_t even_count() const {
    int64_t row = 1;
    for (int d = 1; d < c_.input.dim(); ++d)
      row *= c_.input.shape()[d];
    const int64_t rows = c_.input_splits.empty() ? 0 : c_.input_splits[0];
    for (size_t r = 0; r < c_.input_splits.size(); ++r) {
      if (c_.input_splits[r] != rows || c_.output_splits[r] != rows) return -1;
    }
    const int64_t count = rows * row;
    return count <= INT32_MAX ? static_cast<int32_t>(count) : -1;
  }

  // The collective itself.
  void start() {
    const Tensor& in = c_.input;
    const Tensor& out = c_.output;
    const char* name = collective_name(c_.kind);
    switch (c_.kind) {
      case CollectiveKind::AllReduce: {
        Reduction red = reduction_for(in.dtype(), c_.op);
        Tensor send = widen(in, red), recv = result_buffer(out, red);
        TANDEM_MPI_CHECK(MPI_Iallreduce(send.raw_data(), recv.raw_data(),
                                        count_of(in.numel(), name), red.type, red.op, comm(),
                                        post()));
        then("the all_reduce to complete", [this, recv] { finish_reduction(recv); });
        return;
      }
      case CollectiveKind::ReduceScatter: {
        Reduction red = reduction_for(in.dtype(), c_.op);
        Tensor send = widen(in, red), recv = result_buffer(out, red);
        TANDEM_MPI_CHECK(MPI_Ireduce_scatter_block(send.raw_data(), recv.raw_data(),
                                                   count_of(out.numel(), name), red.type, red.op,
                                                   comm(), post()));
        then("the reduce_scatter to complete", [this, recv] { finish_reduction(recv); });
        return;
      }
      case CollectiveKind::Broadcast: {
        if (group_->rank() == c_.peer && out.nbytes() > 0) {
          std::memcpy(out.raw_data(), in.raw_data(), out.nbytes());
        }
        TANDEM_MPI_CHECK(MPI_Ibcast(out.raw_data(), count_of(out.numel(), name),
                                    move_type(out.dtype()), c_.peer, comm(), post()));
        then(fmt::format("the broadcast from rank {} to complete", c_.peer), [this] { succeed(); });
        return;
      }
      case CollectiveKind::AllGather: {
        MPI_Datatype type = move_type(in.dtype());
        int n = count_of(in.numel(), name);
        TANDEM_MPI_CHECK(
            MPI_Iallgather(in.raw_data(), n, type, out.raw_data(), n, type, comm(), post()));
        then("the all_gather to complete", [this] { succeed(); });
        return;
      }
      case CollectiveKind::AllToAll: {
        post_all_to_all();
        then("the all_to_all to complete", [this] { succeed(); });
        return;
      }
      case CollectiveKind::Barrier: {
        TANDEM_MPI_CHECK(MPI_Ibarrier(comm(), post()));
        then("every rank to reach the barrier", [this] { succeed(); });
        return;
      }
      case CollectiveKind::BatchP2P: {
        post_p2p();
        return;
      }
      default:
        group_->unsupported_kind(c_.kind);
    }
  }

  void succeed() {
    c_.work->finish();
    done();
  }

  // bf16/f16 are reduced in f32 (mpi_check.h, Reduction). The f32 buffers
  // live in the scratch: MPI reads and writes them until the request completes.
  Tensor widen(const Tensor& t, const Reduction& red) {
    if (!red.via_f32) return t;
    Tensor wide = empty(t.shape(), DType::F32, Device::cpu());
    cpu::copy(arg_of(t), arg_of(wide));
    scratch_->tensors.push_back(wide);
    return wide;
  }
  Tensor result_buffer(const Tensor& out, const Reduction& red) {
    if (!red.via_f32) return out;
    Tensor wide = empty(out.shape(), DType::F32, Device::cpu());
    scratch_->tensors.push_back(wide);
    return wide;
  }
  void finish_reduction(const Tensor& result) {
    finish_average(c_.op, result, group_->size());  // divide before the one rounding
    if (!result.is_alias_of(c_.output)) cpu::copy(arg_of(result), arg_of(c_.output));
    succeed();
  }

  void post_all_to_all() {
    Scratch& s = *scratch_;
    const Tensor& in = c_.input;
    const Tensor& out = c_.output;
    int64_t row = 1;
    for (int d = 1; d < in.dim(); ++d)
      row *= in.shape()[d];
    const size_t n = static_cast<size_t>(group_->size());
    s.send_counts.resize(n);
    s.send_displs.resize(n);
    s.recv_counts.resize(n);
    s.recv_displs.resize(n);
    int64_t send_at = 0, recv_at = 0;
    for (size_t r = 0; r < n; ++r) {
      s.send_counts[r] = count_of(c_.input_splits[r] * row, "all_to_all");
      s.send_displs[r] = count_of(send_at, "all_to_all");
      s.recv_counts[r] = count_of(c_.output_splits[r] * row, "all_to_all");
      s.recv_displs[r] = count_of(recv_at, "all_to_all");
      send_at += c_.input_splits[r] * row;
      recv_at += c_.output_splits[r] * row;
    }
    MPI_Datatype type = move_type(in.dtype());
    if (all_even_) {
      // The same count everywhere (checked mode's handshake said so): the
      // plain all-to-all, which MPI may run faster.
      TANDEM_MPI_CHECK(MPI_Ialltoall(in.raw_data(), s.send_counts[0], type, out.raw_data(),
                                     s.recv_counts[0], type, comm(), post()));
      return;
    }
    TANDEM_MPI_CHECK(MPI_Ialltoallv(in.raw_data(), s.send_counts.data(), s.send_displs.data(), type,
                                    out.raw_data(), s.recv_counts.data(), s.recv_displs.data(),
                                    type, comm(), post()));
  }

  // All sends and receives of the batch are posted together, so their order
  // cannot deadlock; receives are checked for the size the caller expected.
  void post_p2p() {
    std::vector<int> senders, receivers;
    size_t recv_index = 0;
    for (const P2POp& op : c_.p2p) {
      const bool is_send = op.kind == P2POp::Kind::Send;
      const Tensor& t = is_send ? op.tensor : c_.p2p_outputs[recv_index++];
      MPI_Datatype type = move_type(t.dtype());
      int n = count_of(t.numel(), is_send ? "send" : "recv");
      if (is_send) {
        TANDEM_MPI_CHECK(MPI_Isend(t.raw_data(), n, type, op.peer, op.tag_id, comm(), post()));
        senders.push_back(op.peer);
      } else {
        TANDEM_MPI_CHECK(MPI_Irecv(t.raw_data(), n, type, op.peer, op.tag_id, comm(), post()));
        receivers.push_back(op.peer);
      }
    }
    then(fmt::format("sends to ranks [{}] and receives from ranks [{}] to complete",
                     fmt::join(senders, ","), fmt::join(receivers, ",")),
         [this] { check_received(); });
  }

  void check_received() {
    size_t recv_index = 0;
    for (size_t i = 0; i < c_.p2p.size(); ++i) {
      const P2POp& op = c_.p2p[i];
      if (op.kind != P2POp::Kind::Recv) continue;
      const Tensor& out = c_.p2p_outputs[recv_index++];
      int got = 0;
      TANDEM_MPI_CHECK(MPI_Get_count(&statuses()[i], move_type(out.dtype()), &got));
      TANDEM_CHECK(
          got == out.numel(),
          "[comm::recv] {}: expected {} elements ({} {}) from rank {} (tag {}), got {}",
          group_->where(), out.numel(), dtype_name(out.dtype()), out.shape(), op.peer, op.tag_id,
          got == MPI_UNDEFINED ? "a message of another element size" : std::to_string(got));
    }
    succeed();
  }

  Collective c_;
  std::optional<Clock::time_point> waiting_since_;
};

// ---- the checked exchange alone (control plane of other backends) ----

class CheckTask final : public StagedTask {
 public:
  CheckTask(std::shared_ptr<MpiProcessGroup> group, LedgerEntry entry, WorkPtr work)
      : StagedTask(std::move(group), std::move(entry)), work_(std::move(work)) {}
  void fail(std::exception_ptr error) noexcept override { work_->finish(error); }

 protected:
  void begin() override {
    handshake(nullptr, [this] {
      work_->finish();
      done();
    });
  }

 private:
  WorkPtr work_;
};

// ---- the fingerprint board's set-up ----

// This machine, as far as shared memory goes: the host name and the boot id.
uint64_t node_id() {
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  std::string id = host;
  std::ifstream boot("/proc/sys/kernel/random/boot_id");
  std::string boot_id;
  if (boot >> boot_id) id += "/" + boot_id;
  return std::hash<std::string>{}(id);
}

// Note [MPI fingerprint board]: where every rank is, then whether every rank
// mapped the board. Every rank sees the same two tables and so decides alike.
class BoardTask final : public StagedTask {
 public:
  explicit BoardTask(std::shared_ptr<MpiProcessGroup> group)
      : StagedTask(std::move(group), board_entry()) {}
  void fail(std::exception_ptr) noexcept override {}  // the group keeps the MPI handshake

 protected:
  void begin() override {
    Scratch& s = *scratch_;
    const int n = group_->size();
    std::random_device entropy;
    const uint64_t nonce = uint64_t{entropy()} << 32 | entropy();
    s.place = {node_id(), static_cast<uint64_t>(::getpid()), nonce};
    s.places.assign(3 * static_cast<size_t>(n), 0);
    TANDEM_MPI_CHECK(MPI_Iallgather(s.place.data(), 3, MPI_UINT64_T, s.places.data(), 3,
                                    MPI_UINT64_T, comm(), post()));
    then("every rank's node id (the fingerprint board's set-up)", [this] { map(); });
  }

 private:
  static LedgerEntry board_entry() {
    LedgerEntry e;
    e.op = "fingerprint board set-up";
    return e;
  }

  void map() {
    Scratch& s = *scratch_;
    const int n = group_->size();
    for (int r = 0; r < n; ++r) {
      if (s.places[3 * static_cast<size_t>(r)] != s.places[0]) {
        done();  // the group spans nodes: the MPI handshake stays
        return;
      }
    }
    name_ = fmt::format("/tandem-board-{}-{:016x}", s.places[1], s.places[2]);
    std::string why;
    board_ = Board::open(name_, n, group_->rank(), why);
    if (!board_)
      log_warn(
          "[comm::mpi] {}: no fingerprint board ({}); checked mode uses "
          "MPI_Iallgather",
          group_->where(), why);
    s.mapped = board_ ? 1 : 0;
    s.all_mapped.assign(static_cast<size_t>(n), 0);
    TANDEM_MPI_CHECK(MPI_Iallgather(&s.mapped, 1, MPI_INT32_T, s.all_mapped.data(), 1, MPI_INT32_T,
                                    comm(), post()));
    then("every rank's mapping of the fingerprint board", [this] { install(); });
  }

  void install() {
    const Scratch& s = *scratch_;
    if (group_->rank() == 0) Board::unlink(name_);  // every rank has opened it, or gave up
    const bool all =
        std::all_of(s.all_mapped.begin(), s.all_mapped.end(), [](int32_t m) { return m == 1; });
    if (all) group_->set_board(std::move(board_));
    done();
  }

  std::string name_;
  std::unique_ptr<Board> board_;
};

// ---- split ----

class SplitTask final : public StagedTask {
 public:
  SplitTask(std::shared_ptr<MpiProcessGroup> group, LedgerEntry entry, int new_rank,
            std::promise<MPI_Comm> result)
      : StagedTask(std::move(group), std::move(entry)),
        new_rank_(new_rank),
        result_(std::move(result)) {}

  void fail(std::exception_ptr error) noexcept override {
    if (!delivered_) result_.set_exception(error);
    delivered_ = true;
  }

 protected:
  // The handshake runs in both modes: once every rank has reached this split
  // (and agrees on the rank list), the blocking MPI_Comm_split cannot hang.
  void begin() override {
    handshake(nullptr, [this] {
      MPI_Comm out = MPI_COMM_NULL;
      int color = new_rank_ >= 0 ? 0 : MPI_UNDEFINED;
      TANDEM_MPI_CHECK(MPI_Comm_split(comm(), color, std::max(new_rank_, 0), &out));
      if (out != MPI_COMM_NULL) TANDEM_MPI_CHECK(MPI_Comm_set_errhandler(out, MPI_ERRORS_RETURN));
      result_.set_value(out);
      delivered_ = true;
      done();
    });
  }

 private:
  int new_rank_;
  std::promise<MPI_Comm> result_;
  bool delivered_ = false;
};

}  // namespace

std::unique_ptr<Task> collective_task(std::shared_ptr<MpiProcessGroup> group, Collective c) {
  return std::make_unique<CollectiveTask>(std::move(group), std::move(c));
}

std::unique_ptr<Task> check_task(std::shared_ptr<MpiProcessGroup> group, LedgerEntry entry,
                                 WorkPtr work) {
  return std::make_unique<CheckTask>(std::move(group), std::move(entry), std::move(work));
}

std::unique_ptr<Task> split_task(std::shared_ptr<MpiProcessGroup> group, LedgerEntry entry,
                                 int new_rank, std::promise<MPI_Comm> result) {
  return std::make_unique<SplitTask>(std::move(group), std::move(entry), new_rank,
                                     std::move(result));
}

std::unique_ptr<Task> board_task(std::shared_ptr<MpiProcessGroup> group) {
  return std::make_unique<BoardTask>(std::move(group));
}

}  // namespace tandem::mpi
