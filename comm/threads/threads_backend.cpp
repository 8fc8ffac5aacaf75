#include "tandem/comm/threads/threads_backend.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <optional>
#include <set>
#include <thread>
#include <utility>

#include <fmt/ranges.h>

#include "tandem/comm/threads/threads_group.h"
#include "tandem/runtime/error.h"
#include "tandem/runtime/logging.h"
#include "tandem/runtime/task_queue.h"
#include "tandem/runtime/trace.h"
#include "tandem/tensor/dtype.h"

namespace tandem {

// Note [Threads rounds]
// ~~~~~~~~~~~~~~~~~~~~~
// The work of a collective is what a naive shared-memory version does: every
// rank copies (or reduces) what it needs from its peers' inputs into its own
// output, once all inputs are there, and nobody reuses an input before every
// peer has read it. What costs beyond that is hand-offs between threads: on
// the small shared machines the suite runs on, one sleep and wake-up costs as
// much as copying a megabyte. So collectives do not go through a comm thread:
//
// - launch() *posts* the rank's part (input, output, ledger entry, Work) in
//   round k of the group, its k-th collective (a ring of kRounds rounds per
//   group), and bumps the round's arrival count. It never waits for anyone.
// - The round's work is a set of *jobs* that never wait: rank r's output is
//   written by its jobs, one per peer for an all_gather or all_to_all (each
//   runnable once r and that peer have posted), else one once every rank
//   has posted (Note [Threads jobs]; a split all_reduce has a second one,
//   Note [Threads reductions]). Any thread may run any job after claiming
//   it (a compare-and-swap on a flag tagged with the round's use of its ring
//   slot, so a late thread cannot claim a job of the slot's next round).
// - Whoever *drives* the round claims the open jobs (in the order of Note
//   [Threads job order]) and runs them: a thread in Work::synchronize() or
//   wait() (so the waiting ranks do the copies, as in the naive version),
//   Work::is_completed() (without waiting), the comm thread for a Work no
//   thread of this backend waits on (a wrapper's, or one with a completion
//   callback) and for a Work asked to progress_in_background() (an async
//   collective whose launcher computes meanwhile: Note [Progress without a
//   waiter] in parallel/collectives.cpp), and the group's destructor. A driver whose own jobs are
//   taken runs a late peer's instead of sleeping until that peer is scheduled.
// - The thread that finishes the last job *retires* the round: it finishes
//   every member's Work (no input is read any more), releases the posts and
//   frees the ring slot.
// A synchronous collective therefore waits at most twice, as the naive
// version does (for the last post and for the last job), with no thread hop.
// Once every member has posted, any single driver completes the round, so a
// rank that launches and never waits holds nobody up. (Before, each rank's
// comm thread ran the collective between two barriers: a launch and a wait
// cost two hand-offs between threads, over twice the context switches of
// the naive version, and lost to it at 1-4 MiB.)
//
// The comm thread (a TaskQueue per rank and group) remains for what has to
// wait before it can post: an input produced on an asynchronous stream (the
// launch's ready event), a ring slot still in use, point-to-point batches
// (a mailbox; a batch first completes this rank's earlier collectives, as when
// the comm thread ran everything in launch order), and every launch queued
// behind one of those, so that each rank posts in launch order. It posts such
// a collective and then drives it.
//
// Failures. A round that some member has not posted is *sealed* (a flag in
// its state word, set by compare-and-swap only while the count is short) by a
// driver that finds the group aborted, a member exited, or its deadline
// passed (the watchdog: posted at + the group's timeout); a sealed round runs
// no further job, and each rank fails its own Work in it once the jobs in
// flight have ended. A round every member posted always runs to completion,
// since its jobs cannot block. An error inside a
// job (checked mode's fingerprint comparison, all_to_all split sizes that
// disagree) fails that rank's Work and aborts the group, as a local failure
// did when the comm thread ran the collective.

namespace {

class ThreadsProcessGroup;

// One collective this rank posted.
struct Ticket {
  uint64_t round = 0;
  uint64_t seq = 0;  // in the ledger
  CollectiveKind kind = CollectiveKind::Barrier;
  Clock::time_point posted_at;
};

// Note [Threads group lifetime]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A ThreadsWork never owns its group. If it did (a shared_ptr locked for the
// drive), the group's destructor would run wherever the last driver let go,
// which may be an async stream's executor running Work::wait()'s task after
// the rank dropped the group; the destructor waits for the comm thread, which
// may be waiting for a launch's ready event recorded on that very stream
// (Note [Stream ordering]): a deadlock. Works reach their group through a
// GroupAnchor instead, and the group's destructor, wherever it runs, ends in
// this order: (1) it stops hand-offs to its comm thread (a Work observed by
// a callback alone is then left to step 3), (2) drains the comm thread, while
// waiters keep driving their rounds (a waiter that merely waited could hold
// up, on its stream, the ready event of a post the comm thread still has to
// make), (3) drives every round of its rank to its end, finishing every
// Work, and (4) waits for the drivers still inside and clears the anchor.
struct GroupAnchor {
  std::mutex mu;
  std::condition_variable cv;
  ThreadsProcessGroup* group = nullptr;  // null once the group is going
  int drivers = 0;
  bool comm_thread_open = true;

  // Runs fn(group) unless the group is going (it finishes the Work then).
  template <class F>
  void with_group(F&& fn) {
    ThreadsProcessGroup* g;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (group == nullptr) return;
      g = group;
      ++drivers;
    }
    fn(*g);  // never throws: drive() reports through the Work
    std::lock_guard<std::mutex> lock(mu);
    if (--drivers == 0) cv.notify_all();
  }

  // Runs fn(group), which must not block, while the comm thread takes work.
  template <class F>
  void with_comm_thread(F&& fn) {
    std::lock_guard<std::mutex> lock(mu);
    if (group != nullptr && comm_thread_open) fn(*group);
  }

  void close_comm_thread() {
    std::lock_guard<std::mutex> lock(mu);
    comm_thread_open = false;
  }

  void clear() {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return drivers == 0; });
    group = nullptr;
  }
};

// The Work of a collective that launch() posted: waiting on it, or asking
// whether it completed, drives its round (Note [Threads rounds]).
class ThreadsWork final : public Work {
 public:
  ThreadsWork(std::string description, std::shared_ptr<GroupAnchor> anchor)
      : Work(std::move(description)), anchor_(std::move(anchor)) {}

  void synchronize() override;
  bool is_completed() override;
  // A Work observed only through its callbacks has no waiter to drive it:
  // the comm thread does.
  void on_completion(std::function<void()> fn) override;
  // The comm thread runs the round's copies as they open (Note [Progress
  // without a waiter] in parallel/collectives.cpp).
  void progress_in_background() override;

  // Set by launch() when it posted the collective itself, before the Work
  // reaches anyone else. Works the comm thread posts are driven by it.
  void posted_as(const Ticket& ticket) {
    ticket_ = ticket;
    posted_ = true;
  }

 private:
  std::shared_ptr<GroupAnchor> anchor_;  // Note [Threads group lifetime]
  Ticket ticket_;
  bool posted_ = false;
  std::atomic<bool> handed_off_{false};
  std::atomic<bool> progressing_{false};
};

class ThreadsProcessGroup final : public ProcessGroup {
 public:
  ThreadsProcessGroup(std::shared_ptr<ThreadsWorld> world, std::string key, int rank,
                      std::vector<int> world_ranks, ProcessGroupOptions options)
      : ProcessGroup(rank, static_cast<int>(world_ranks.size()), world_ranks, options),
        world_(std::move(world)),
        key_(std::move(key)),
        shared_(world_->group(key_, options.name, world_ranks)),
        where_(where()),
        queue_(std::make_unique<TaskQueue>(fmt::format("comm r{} {}", rank, options.name))),
        anchor_(std::make_shared<GroupAnchor>()) {
    anchor_->group = this;
  }

  // Every collective of this rank ends before its members go: the comm
  // thread's (deferred posts, p2p, driven Works) first, then the rounds
  // posted at launch that nobody waited for.
  ~ThreadsProcessGroup() override {
    // In the order of Note [Threads group lifetime].
    anchor_->close_comm_thread();
    queue_.reset();
    drain(UINT64_MAX);
    anchor_->clear();
  }

  std::string backend_name() const override { return "threads"; }

  void abort(const std::string& reason) override {
    shared_->abort(fmt::format("rank {} aborted the group: {}", rank(), reason));
  }

  // Drives round t.round (Note [Threads rounds]) until it is over for this
  // rank: retired (every Work of it finished) or failed (`work` finished
  // with the error). Returns false instead of waiting when `blocking` is
  // false and the round is not over. Never throws: errors go to `work`.
  bool drive(const Ticket& t, Work& work, bool blocking) noexcept {
    SharedGroup& g = *shared_;
    Round& R = g.round(t.round);
    const uint64_t use = t.round / kRounds;
    // The watchdog: every member must have posted within the timeout.
    const Clock::time_point deadline = t.posted_at + timeout();
    std::optional<Clock::time_point> jobs_deadline;
    try {
      for (;;) {
        uint64_t s = R.state.load();
        const uint64_t opened = R.opened.load();
        if (use_of(s) != use) return true;  // retired: the retirer finished `work`
        if ((s & kSealed) != 0) {
          fail_sealed(t, work);
          return true;
        }
        if (g.run_jobs(R, use, rank())) continue;
        auto moved = [&] { return R.state.load() != s || R.opened.load() != opened || g.broken(); };
        if (posted_of(s) == g.size) {
          if (!blocking) return false;
          // The last jobs run on other threads, or open with the last
          // publications: wait for them, or for the retirement.
          if (!jobs_deadline) jobs_deadline = Clock::now() + timeout();
          if (!g.wait_until(moved, *jobs_deadline)) {
            throw TimeoutError(fmt::format(
                "[comm::watchdog] {} waited {} ms in #{} {} for the copies of other threads to "
                "finish (every rank had posted)",
                where_, timeout().count(), t.seq, collective_name(t.kind)));
          }
          continue;
        }
        // Some member has not posted yet.
        if (g.broken()) {
          if (!R.state.compare_exchange_strong(s, s | kSealed)) continue;
          fail_sealed(t, work);
          return true;
        }
        if (Clock::now() >= deadline) {
          if (time_out(t, s, work)) return true;
          continue;
        }
        if (!blocking) return false;
        g.wait_until(moved, deadline);
      }
    } catch (...) {
      work.finish(std::current_exception());
      return true;
    }
  }

  // Runs drive() on the comm thread, for a Work no thread of this backend waits on.
  void drive_on_comm_thread(const Ticket& t, WorkPtr work) {
    queue_->push([this, t, work] { drive(t, *work, true); });
  }

  // On the comm thread: runs the jobs of round t as they open, until the
  // round retires, is sealed, or its watchdog deadline passes, or every job
  // has been claimed. Finishing the Work and reporting a failure are left to
  // its waiter, so the task holds no Work (Note [Progress without a waiter]).
  void progress_on_comm_thread(const Ticket& t) {
    queue_->push([this, t] { progress(t); });
  }

  void progress(const Ticket& t) noexcept {
    SharedGroup& g = *shared_;
    Round& R = g.round(t.round);
    const uint64_t use = t.round / kRounds;
    const Clock::time_point deadline = t.posted_at + timeout();
    try {
      for (;;) {
        const uint64_t s = R.state.load();
        const uint64_t opened = R.opened.load();
        if (use_of(s) != use || (s & kSealed) != 0 || g.broken()) return;
        if (g.run_jobs(R, use, rank())) continue;
        // Every member posted and no job is left to claim: the ones running
        // elsewhere retire the round.
        if (posted_of(s) == g.size || Clock::now() >= deadline) return;
        auto moved = [&] { return R.state.load() != s || R.opened.load() != opened || g.broken(); };
        g.wait_until(moved, deadline);
      }
    } catch (const std::exception& e) {
      g.abort(fmt::format("rank {}'s comm thread failed while copying #{} {}: {}", rank(), t.seq,
                          collective_name(t.kind), e.what()));
    }
  }

 protected:
  // Under the issue lock (Note [Issue lock]), so rounds are numbered in
  // launch order. Posts at once when nothing of this rank is queued before
  // it, the input is ready and the ring slot is free; otherwise the comm
  // thread posts it (Note [Threads rounds]).
  void launch(Collective& c) override {
    if (c.kind == CollectiveKind::BatchP2P) {
      defer(std::move(c), 0);
      return;
    }
    const uint64_t k = next_round_++;
    if (deferred_.load() == 0 && slot_free(k) && c.ready.query()) {
      WorkPtr work = c.work;
      std::optional<Ticket> t = post(c, k);
      if (!t) return;
      if (auto* mine = dynamic_cast<ThreadsWork*>(work.get())) {
        mine->posted_as(*t);
      } else {
        drive_on_comm_thread(*t, std::move(work));  // a wrapper's Work (sim link)
      }
      return;
    }
    defer(std::move(c), k);
  }

  // One per rank thread, not per process (Note [Issue lock]).
  std::mutex& issue_mutex() const override { return world_->issue_mutex(world_ranks()[rank()]); }

  WorkPtr make_work(std::string description) override {
    return std::make_shared<ThreadsWork>(std::move(description), anchor_);
  }

  // Every split is a new group, like a new communicator: two splits with the
  // same members share no rounds (each group object numbers its own). The
  // members agree on the key because they split their parent in the same
  // order (ProcessGroup::split).
  std::shared_ptr<ProcessGroup> make_subgroup(const std::vector<int>& ranks, int new_rank,
                                              const std::string& name) override {
    std::vector<int> members;
    std::string key = fmt::format("{}/{}:", key_, splits_made_++);
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
  std::string who(const Ticket& t) const {
    return fmt::format("rank {} at #{} {}", rank(), t.seq, collective_name(t.kind));
  }

  bool slot_free(uint64_t k) { return use_of(shared_->round(k).state.load()) == k / kRounds; }

  // Posts this rank's part of `c` as round k. Returns its ticket, or nullopt
  // when the group can no longer run collectives (the Work has then failed).
  std::optional<Ticket> post(Collective& c, uint64_t k) {
    SharedGroup& g = *shared_;
    Round& R = g.round(k);
    const uint64_t use = k / kRounds;
    const Ticket t{k, c.entry.seq, c.kind, coarse_now()};
    if (!slot_free(k)) {
      // Only on the comm thread, which has driven the slot's previous round:
      // its retirer may still be finishing it.
      auto freed = [&] { return slot_free(k) || g.broken(); };
      if (!g.wait_until(freed, Clock::now() + timeout()) && !g.broken()) {
        TANDEM_FAIL("[comm] {}: round {} still holds its ring slot after {} ms", who(t),
                    k - kRounds, timeout().count());
      }
    }
    if (g.broken()) {
      c.work->finish(g.failure(who(t)));
      return std::nullopt;
    }
    Post& p = R.posts[rank()];
    p.kind = c.kind;
    p.input = std::move(c.input);
    p.output = std::move(c.output);
    p.op = c.op;
    p.root = c.peer;
    p.entry = std::move(c.entry);
    p.fingerprint = p.entry.fingerprint();
    p.input_splits = std::move(c.input_splits);
    p.output_splits = std::move(c.output_splits);
    p.checked = options().checked;
    p.where = &where_;
    p.work = c.work;
    p.start_us = trace_enabled() ? trace_now_us() : 0;
    // Every job of this post is counted before a peer can run one, and
    // published after the count, plus one for this poster's open_jobs, which
    // reads the posts: the round cannot retire (and clear them) before it
    // ends (Note [Threads jobs]).
    R.left.fetch_add(jobs_of(p, g.size, R.parts) + 1);
    const uint64_t s = R.state.fetch_add(1);
    if ((s & kSealed) != 0) {  // sealed since the check above: the round will not run
      R.left.fetch_sub(1);     // no open_jobs; this post's own jobs keep `left` above 0
      fail_sealed(t, *c.work);
      return std::nullopt;
    }
    g.posted[rank()].store(k + 1);
    {
      std::lock_guard<std::mutex> lock(outstanding_mu_);
      while (!outstanding_.empty() && retired(outstanding_.front().first))
        outstanding_.pop_front();
      outstanding_.emplace_back(t, c.work);
    }
    g.open_jobs(R, use, k, rank());
    return t;
  }

  bool retired(const Ticket& t) const {
    return use_of(shared_->round(t.round).state.load()) != t.round / kRounds;
  }

  // Fails `work` in a sealed round, with the reason the round was sealed.
  void fail_sealed(const Ticket& t, Work& work) {
    SharedGroup& g = *shared_;
    // No peer may still read this rank's input (Note [Threads jobs]).
    g.wait_for_jobs(g.round(t.round), t.round / kRounds);
    // A driver that timed out aborts the group right after sealing.
    g.wait_until([&] { return g.broken(); }, Clock::now() + timeout());
    if (g.broken()) {
      work.finish(g.failure(who(t)));
    } else {
      work.finish(std::make_exception_ptr(CommAbortedError(
          fmt::format("[comm] {} failed: a peer gave up on it ({})", who(t), where_))));
    }
  }

  // The watchdog (Note [Bounded waits]): seals the round `t` if it is still
  // short of posts (its state is `s`), aborts the group with a report of who
  // posted and who did not, and fails `work` with that report. False when
  // the round changed meanwhile.
  bool time_out(const Ticket& t, uint64_t s, Work& work) {
    SharedGroup& g = *shared_;
    std::vector<int> arrived_ranks, missing_ranks;
    for (int r = 0; r < g.size; ++r)
      (g.posted[r].load() > t.round ? arrived_ranks : missing_ranks).push_back(r);
    if (!g.round(t.round).state.compare_exchange_strong(s, s | kSealed)) return false;
    std::string missing = fmt::format("{}", fmt::join(missing_ranks, ","));
    std::string report = fmt::format(
        "[comm::watchdog] {} waited {} ms in #{} {} for all {} ranks to post their inputs; "
        "arrived: [{}], missing: [{}]. Last collectives of this rank:\n{}",
        where_, timeout().count(), t.seq, collective_name(t.kind), g.size,
        fmt::join(arrived_ranks, ","), missing, ledger().tail_str(8));
    g.abort(fmt::format("rank {} timed out in #{} {} waiting for ranks [{}]", rank(), t.seq,
                        collective_name(t.kind), missing));
    log_error("{}", report);
    g.wait_for_jobs(g.round(t.round), t.round / kRounds);  // Note [Threads jobs]
    work.finish(std::make_exception_ptr(TimeoutError(report)));
    return true;
  }

  // Drives every round this rank posted, up to round `up_to`, to its end.
  void drain(uint64_t up_to) {
    std::vector<std::pair<Ticket, WorkPtr>> pending;
    {
      std::lock_guard<std::mutex> lock(outstanding_mu_);
      for (const auto& [t, weak] : outstanding_) {
        // A Work that is gone was released by its retired round.
        if (WorkPtr work = weak.lock(); work && t.round <= up_to) pending.emplace_back(t, work);
      }
    }
    for (const auto& [t, work] : pending)
      drive(t, *work, true);
  }

  // A launch the comm thread handles (Note [Threads rounds]); k is its round.
  void defer(Collective c, uint64_t k) {
    deferred_.fetch_add(1);
    LogContext context = current_log_context();
    // The task holds `this`, not a shared_ptr: the destructor drains the queue
    // before any member goes, and a task owning the group would run that
    // destructor on the queue's own thread when the caller let go first
    // (joining itself: std::system_error, terminate).
    queue_->push([this, c = std::move(c), k, context]() mutable {
      set_log_context(context);
      if (c.kind == CollectiveKind::BatchP2P) {
        execute_p2p(c);
        deferred_.fetch_sub(1);
      } else {
        post_later(c, k);
      }
    });
  }

  // On the comm thread: waits for the input and the ring slot, posts, then drives.
  void post_later(Collective& c, uint64_t k) {
    const WorkPtr work = c.work;
    const uint64_t seq = c.entry.seq;
    const CollectiveKind kind = c.kind;
    std::optional<Ticket> t;
    try {
      c.ready.synchronize();
      if (k >= kRounds) drain(k - kRounds);  // this rank's use of the slot
      t = post(c, k);
    } catch (...) {
      fail_locally(seq, kind, *work, std::current_exception());
    }
    deferred_.fetch_sub(1);  // later launches may post at once again
    if (t) drive(*t, *work, true);
  }

  // A failure of this rank's own making aborts the group, so that peers
  // fail instead of waiting.
  void fail_locally(uint64_t seq, CollectiveKind kind, Work& work, std::exception_ptr error) {
    shared_->abort(fmt::format("rank {} failed in #{} {}: {}", rank(), seq, collective_name(kind),
                               what_of(error)));
    work.finish(error);
  }

  void execute_p2p(Collective& c) {
    const int64_t start = trace_enabled() ? trace_now_us() : 0;
    try {
      c.ready.synchronize();
      drain(UINT64_MAX);  // this rank's earlier collectives first, in launch order
      run_p2p(c);
      c.work->finish();
    } catch (...) {
      fail_locally(c.entry.seq, c.kind, *c.work, std::current_exception());
    }
    if (trace_enabled()) {
      trace_complete("comm", fmt::format("{} #{}", collective_name(c.kind), c.entry.seq), start,
                     trace_now_us() - start,
                     fmt::format("\"seq\":{},\"group\":\"{}\"", c.entry.seq, options().name),
                     fmt::format("comm r{} {}", rank(), options().name));
    }
  }

  // (peer, received) of each send of a batch.
  using SentFlags = std::vector<std::pair<int, std::shared_ptr<std::atomic<bool>>>>;

  void run_p2p(Collective& c) {
    SentFlags sent = post_sends(c);
    size_t recv_index = 0;
    for (const P2POp& op : c.p2p) {
      if (op.kind != P2POp::Kind::Recv) continue;
      receive(c, op, c.p2p_outputs[recv_index++]);
    }
    wait_sends_received(c, sent);
  }

  // Puts every send of the batch in its peer's mailbox, after checking that
  // the group and the peers are still there.
  SentFlags post_sends(const Collective& c) {
    SharedGroup& g = *shared_;
    SentFlags sent;
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
    return sent;
  }

  // Waits for the peer's message of one recv and copies it into `out`.
  void receive(const Collective& c, const P2POp& op, const Tensor& out) {
    SharedGroup& g = *shared_;
    std::unique_lock<std::mutex> lock(g.mu);
    auto& box = g.mail[{op.peer, rank(), op.tag_id}];
    auto ready = [&] { return !box.empty() || g.aborted.load() || g.exited(op.peer); };
    if (!g.cv.wait_for(lock, timeout(), ready)) {
      std::string report = fmt::format(
          "[comm::watchdog] {} waited {} ms in #{} recv from rank {} (tag {}) and nothing "
          "came. Last collectives of this rank:\n{}",
          where(), timeout().count(), c.entry.seq, op.peer, op.tag_id, ledger().tail_str(8));
      g.abort_locked(
          fmt::format("rank {} timed out in #{} recv from rank {}", rank(), c.entry.seq, op.peer));
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
    if (m.data.shape() != out.shape() || m.data.dtype() != out.dtype() ||
        m.data.device() != out.device()) {
      m.consumed->store(true);
      {
        std::lock_guard<std::mutex> relock(g.mu);  // no lost wake-up of the sender
        g.cv.notify_all();
      }
      TANDEM_FAIL(
          "[comm::recv] {}: rank {} sent {} {} on {} but rank {} expected {} {} on {} (tag {})",
          where(), op.peer, dtype_name(m.data.dtype()), m.data.shape(), m.data.device(), rank(),
          dtype_name(out.dtype()), out.shape(), out.device(), op.tag_id);
    }
    move_bytes(out.device(), out.raw_data(), m.data.raw_data(), out.nbytes());
    m.consumed->store(true);
    std::lock_guard<std::mutex> relock(g.mu);
    g.cv.notify_all();
  }

  // Sends complete once received (the input may be reused afterwards).
  void wait_sends_received(const Collective& c, SentFlags& sent) {
    SharedGroup& g = *shared_;
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
  const std::string where_;  // where(), read by the peers' jobs (Post::where)
  std::unique_ptr<TaskQueue> queue_;
  std::shared_ptr<GroupAnchor> anchor_;  // Note [Threads group lifetime]
  uint64_t next_round_ = 0;              // under the issue lock
  uint64_t splits_made_ = 0;             // split() calls, serialized like the base's count
  std::atomic<int> deferred_{0};         // launches queued on the comm thread, not yet posted
  // Rounds this rank posted that may not have retired yet, oldest first.
  // Weak: the posts hold the Works until their rounds retire, and a Work
  // held here would hold its output past the caller's use, enlarging the
  // working set of a loop of collectives by a buffer per rank.
  std::mutex outstanding_mu_;
  std::deque<std::pair<Ticket, std::weak_ptr<Work>>> outstanding_;
};

void ThreadsWork::synchronize() {
  if (posted_ && !Work::is_completed()) {
    anchor_->with_group([&](ThreadsProcessGroup& group) {
      CommWaitScope waiting;
      group.drive(ticket_, *this, true);
    });
  }
  Work::synchronize();
}

bool ThreadsWork::is_completed() {
  if (posted_ && !Work::is_completed()) {
    anchor_->with_group([&](ThreadsProcessGroup& group) { group.drive(ticket_, *this, false); });
  }
  return Work::is_completed();
}

void ThreadsWork::progress_in_background() {
  if (posted_ && !Work::is_completed() && !progressing_.exchange(true)) {
    anchor_->with_comm_thread(
        [&](ThreadsProcessGroup& group) { group.progress_on_comm_thread(ticket_); });
  }
}

void ThreadsWork::on_completion(std::function<void()> fn) {
  Work::on_completion(std::move(fn));
  if (posted_ && !Work::is_completed() && !handed_off_.exchange(true)) {
    anchor_->with_comm_thread([&](ThreadsProcessGroup& group) {
      group.drive_on_comm_thread(ticket_, shared_from_this());
    });
  }
}

}  // namespace

namespace {

// What one rank's function threw: `induced` when it only reports another
// rank's failure (its group was aborted, or a peer left).
struct RankFailure {
  int rank = 0;
  std::exception_ptr error;
  bool induced = false;
};

// Rethrows `root` as an exception of its tandem type carrying `message`, so
// that a caller catching TimeoutError or CommAbortedError still does.
[[noreturn]] void rethrow_as(const std::exception_ptr& root, const std::string& message) {
  try {
    std::rethrow_exception(root);
  } catch (const CommAbortedError&) {
    throw CommAbortedError(message);
  } catch (const TimeoutError&) {
    throw TimeoutError(message);
  } catch (...) {
    throw Error(message);
  }
}

// Note [Rank failure report]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// Which rank fails first is a matter of timing, so run_ranks never reports
// "the first" failure. One failing rank: its exception is rethrown as is.
// Several: one exception lists every failing rank's message, root causes
// (errors of the rank's own) in rank order, then the ranks that only failed
// because a peer did (CommAbortedError), in rank order; its type is that of
// the first root cause (Error for foreign exceptions).
[[noreturn]] void report_failures(std::vector<RankFailure> failures, int world_size) {
  std::stable_sort(failures.begin(), failures.end(),
                   [](const RankFailure& a, const RankFailure& b) {
                     return a.induced != b.induced ? !a.induced : a.rank < b.rank;
                   });
  if (failures.size() == 1) std::rethrow_exception(failures[0].error);
  std::string message = fmt::format(
      "[comm::run_ranks] expected every rank to succeed, got {} of {} failing (root "
      "causes first, then ranks aborted by a peer's failure; each in rank order):",
      failures.size(), world_size);
  for (const RankFailure& f : failures) {
    message +=
        fmt::format("\n  rank {}{}: {}", f.rank, f.induced ? " (aborted)" : "", what_of(f.error));
  }
  rethrow_as(failures[0].error, message);
}

}  // namespace

void run_ranks(int world_size, const std::function<void(ProcessGroupPtr)>& fn,
               ProcessGroupOptions options) {
  TANDEM_CHECK(world_size >= 1, "[comm::run_ranks] expected world_size >= 1, got {}", world_size);
  auto world = std::make_shared<ThreadsWorld>(world_size);
  std::vector<int> ranks(static_cast<size_t>(world_size));
  for (int r = 0; r < world_size; ++r)
    ranks[r] = r;
  std::mutex mu;
  std::vector<RankFailure> failures;
  std::vector<std::thread> threads;
  // Tensors the caller made before this call, and those the ranks leave for
  // it, cross threads (Note [Thread hand-off]).
  const HandOff handed;
  for (int r = 0; r < world_size; ++r) {
    threads.emplace_back([&, r] {
      set_log_context(LogContext{r, world_size});
      set_thread_name(fmt::format("rank {}", r));
      try {
        handed.wait();
        auto group = std::make_shared<ThreadsProcessGroup>(world, "world", r, ranks, options);
        fn(group);
        current_stream(Device::cpu()).synchronize();
        group.reset();  // drains this rank's pending collectives
        world->rank_exited(r);
      } catch (const std::exception& e) {
        bool induced = dynamic_cast<const CommAbortedError*>(&e) != nullptr;
        {
          std::lock_guard<std::mutex> lock(mu);
          failures.push_back({r, std::current_exception(), induced});
        }
        world->abort_all(fmt::format("rank {} failed: {}", r, e.what()));
      }
    });
  }
  for (auto& t : threads)
    t.join();
  if (!failures.empty()) report_failures(std::move(failures), world_size);
}

}  // namespace tandem
