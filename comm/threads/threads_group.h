// The state the members of a threads-backend group share: the ring of
// rounds, the sleepers' futex word, failures, and the p2p mailbox; and the
// world of groups of one run_ranks() call. Private to comm/threads (Note
// [Threads rounds] in threads_backend.cpp).
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <fmt/format.h>

#include "tandem/comm/threads/threads_jobs.h"

namespace tandem {
namespace threads_detail {

using Clock = std::chrono::steady_clock;

// Clock::now() to within a scheduler tick (CLOCK_MONOTONIC_COARSE, the same
// clock steady_clock reads on Linux, a few ns instead of tens in a VM): what a
// launch stamps its post with, for a watchdog deadline of seconds.
Clock::time_point coarse_now();

// Sleeps while `word` holds `expected`, at most `timeout` (a wake-up may be
// spurious: callers re-check). Linux futexes: one syscall to sleep, one to
// wake every sleeper, and no mutex for the woken threads to queue on.
void futex_wait(std::atomic<uint32_t>& word, uint32_t expected, std::chrono::nanoseconds timeout);
void futex_wake_all(std::atomic<uint32_t>& word);

// Note [Threads waits]
// ~~~~~~~~~~~~~~~~~~~~
// A driver waits for the last post of a round and for jobs running on other
// threads (the end of a phase, or of the round). It first yields its core up
// to kSpinYields times, then sleeps on the group's futex word `wake_seq`,
// bounded by its deadline. Whatever a sleeper may wait for (the last post,
// the end of a phase, a retirement, an abort, an exit) bumps `wake_seq` and
// wakes every sleeper, only when there are some: `sleepers` is read after the
// change and incremented before the sleeper's last check, all sequentially
// consistent, so a sleeper either sees the change or is woken. Every wake-up
// re-checks why the thread waits.
//
// Why yield before sleeping: with more rank threads than cores (4 on the
// suite's 2), what a waiter needs is usually done by a runnable peer on its
// own core, and a yield hands the core to it at once, while a sleeper that
// is woken waits for the peer's time slice to end (tens of microseconds, or
// a whole slice). 8 yields beat 2 on all_gathers of 4 ranks on 2 cores, and
// neither more yields, a time bound on them nor pause loops did better (the
// README's benchmark section, "Measurements behind design choices", has the
// figures). (With a comm thread per rank,
// as before Note [Threads rounds], long spinning was slower: the spinners
// then handed the core to each other instead of to the late rank.)
constexpr int kSpinYields = 8;

template <class F>
bool spin_until(F&& done) {
  for (int i = 0; i < kSpinYields; ++i) {
    if (done()) return true;
    std::this_thread::yield();
  }
  return done();
}

// A message of the p2p mailbox: the sender's tensor, read in place by the
// receiver, who then sets `consumed`.
struct Message {
  Tensor data;
  LedgerEntry entry;
  std::shared_ptr<std::atomic<bool>> consumed;
};

}  // namespace threads_detail

using namespace threads_detail;

// The state one group shares between its member rank threads.
struct SharedGroup {
  SharedGroup(std::string group_name, std::vector<int> world_members)
      : name(std::move(group_name)),
        size(static_cast<int>(world_members.size())),
        members(std::move(world_members)),
        posted(static_cast<size_t>(size)),
        exit_reasons(static_cast<size_t>(size)) {
    for (uint64_t i = 0; i < kRounds; ++i)
      rounds.push_back(std::make_unique<Round>(size));
  }

  std::string name;
  int size;
  std::vector<int> members;  // world ranks
  std::mutex mu;             // guards the strings and the mailbox; `cv` sleeps on it
  std::condition_variable cv;
  // The ring of rounds (Note [Threads rounds]) and its sleepers (Note [Threads waits]).
  std::vector<std::unique_ptr<Round>> rounds;
  std::atomic<int> sleepers{0};
  std::atomic<uint32_t> wake_seq{0};  // their futex word: bumped to wake them
  std::vector<std::atomic<uint64_t>>
      posted;  // rounds posted, by group rank (the watchdog's report)
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

  Round& round(uint64_t k) { return *rounds[k % kRounds]; }

  // No collective can complete any more.
  bool broken() const { return aborted.load() || first_exited.load() >= 0; }
  // Why, for `who` ("rank 1 at #4 all_gather"); only when broken().
  std::exception_ptr failure(const std::string& who) const {
    if (aborted.load()) {
      return std::make_exception_ptr(CommAbortedError(
          fmt::format("[comm] {} failed: group '{}' was aborted: {}", who, name, abort_reason)));
    }
    return std::make_exception_ptr(CommAbortedError(fmt::format(
        "[comm] {} failed: in group '{}', {}", who, name, exit_reasons[first_exited.load()])));
  }

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
    wake_all();
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
    wake_all();
  }
  bool exited(int group_rank) const { return !exit_reasons[group_rank].empty(); }
  [[noreturn]] void throw_exited(const std::string& who, int group_rank) {
    throw CommAbortedError(
        fmt::format("[comm] {} failed: in group '{}', {}", who, name, exit_reasons[group_rank]));
  }

  // ---- waits (Note [Threads waits]) ----

  void wake_all() {
    wake_seq.fetch_add(1);
    futex_wake_all(wake_seq);
  }
  // After a change some thread may be sleeping for.
  void notify() {
    if (sleepers.load() > 0) wake_all();
  }
  // Until ready() or the deadline; false on timeout.
  template <class F>
  bool wait_until(F&& ready, Clock::time_point deadline) {
    if (spin_until(ready)) return true;
    for (;;) {
      const uint32_t seq = wake_seq.load();
      const auto left = deadline - Clock::now();
      if (left <= Clock::duration::zero()) return ready();
      sleepers.fetch_add(1);
      if (!ready()) futex_wait(wake_seq, seq, left);
      sleepers.fetch_sub(1);
      if (ready()) return true;
    }
  }

  // ---- jobs (Note [Threads jobs]) ----

  static void open(std::atomic<uint64_t>& claim, uint64_t use) {
    uint64_t flag = claim.load();
    while (closed_in(flag, use) && !claim.compare_exchange_weak(flag, open_in(use))) {
    }
  }

  // After rank `me` published its post of round k (use `use` of R): opens
  // the jobs that post makes runnable.
  // Ends by releasing the poster's count in `left`, which may retire R.
  void open_jobs(Round& R, uint64_t use, uint64_t k, int me);

  // Claims and runs the open jobs of R in use `use`; true when it ran any.
  // Rank `first`'s whole-part job and second phase come first (its output
  // then sits in its core's cache); pieces go source by source (Note
  // [Threads job order]).
  bool run_jobs(Round& R, uint64_t use, int first);

  // Runs the job of rank r from `source` (-1: its second phase), part
  // `part`, claimed by this thread. Its count in `left` is run_jobs'.
  void finish_job(Round& R, uint64_t use, std::atomic<uint64_t>& claim, int r, int source,
                  int part);

  // Waits until no job of R (use `use`) is running: before a Work of a
  // sealed round fails (Note [Threads jobs]). Jobs never block.
  void wait_for_jobs(Round& R, uint64_t use);

  // After the last job: finishes every member's Work (with its error, if
  // any; an error aborts the group, as any local failure does), releases the
  // posts and frees the ring slot for the next use.
  void retire(Round& R, uint64_t use);
};

class ThreadsWorld {
 public:
  explicit ThreadsWorld(int size) : size_(size), issue_mutexes_(static_cast<size_t>(size)) {}
  // Rank `world_rank`'s issue lock: the rank threads stand for processes
  // (Note [Issue lock]).
  std::mutex& issue_mutex(int world_rank) { return issue_mutexes_[world_rank]; }
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
  std::vector<std::mutex> issue_mutexes_;

  static std::string exit_reason(int rank) {
    return fmt::format(
        "rank {} returned from its rank function and will not join further "
        "collectives of this group",
        rank);
  }
};

}  // namespace tandem
