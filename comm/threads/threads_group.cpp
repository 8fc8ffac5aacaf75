// SharedGroup's jobs and retirement, and the futex calls (threads_group.h).
#include "tandem/comm/threads/threads_group.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <climits>
#include <ctime>
#include <utility>

#include "tandem/runtime/logging.h"
#include "tandem/runtime/trace.h"

namespace tandem {
namespace threads_detail {

void futex_wait(std::atomic<uint32_t>& word, uint32_t expected, std::chrono::nanoseconds timeout) {
  static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t));
  const auto ns = timeout.count();
  timespec ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT_PRIVATE, expected, &ts, nullptr,
          0);
}

Clock::time_point coarse_now() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
  return Clock::time_point(std::chrono::duration_cast<Clock::duration>(
      std::chrono::seconds(ts.tv_sec) + std::chrono::nanoseconds(ts.tv_nsec)));
}

void futex_wake_all(std::atomic<uint32_t>& word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr,
          nullptr, 0);
}

}  // namespace threads_detail

void SharedGroup::open_jobs(Round& R, uint64_t use, uint64_t k, int me) {
  bool all = true;
  const bool mine = has_pieces(R.posts[me]);
  for (int r = 0; r < size; ++r) {
    if (posted[r].load() <= k) {
      all = false;
      continue;
    }
    if (mine) {
      for (int p = 0, parts = parts_of(R.posts[me], r, R.parts); p < parts; ++p)
        open(R.piece(me, r, p), use);
    }
    if (r != me && has_pieces(R.posts[r])) {
      for (int p = 0, parts = parts_of(R.posts[r], me, R.parts); p < parts; ++p)
        open(R.piece(r, me, p), use);
    }
  }
  if (all) {
    int split = 0;
    for (int r = 0; r < size; ++r)
      split += splits(R.posts[r], size) ? 1 : 0;
    R.split_ranks.store(split);
    for (int r = 0; r < size; ++r) {
      if (!has_pieces(R.posts[r])) open(R.piece(r, r), use);
    }
  }
  R.opened.fetch_add(1);
  notify();
  // This poster's count in `left` (post()): from here on the round may retire.
  if (R.left.fetch_sub(1) == 1) retire(R, use);
}

bool SharedGroup::run_jobs(Round& R, uint64_t use, int first) {
  // Jobs this pass ran, counted down in `left` together at its end (Note
  // [Threads jobs]).
  int64_t ran = 0;
  // False when the job was closed (not a job, or not runnable yet).
  auto run = [&](int r, int source, int part) {  // source -1: the second phase
    std::atomic<uint64_t>& claim = source >= 0 ? R.piece(r, source, part) : R.second(r);
    uint64_t open = open_in(use);
    const uint64_t state = claim.load();
    if (closed_in(state, use)) return false;
    if (state == open && claim.compare_exchange_strong(open, claimed_in(use))) {
      finish_job(R, use, claim, r, source, part);
      ++ran;
    }
    return true;
  };
  // Rank `first`'s own job: its whole job (claimed through its own piece's
  // flag) or its own piece, then its second phase; a closed one is skipped.
  // No post is read before its job is claimed: once the round retires, the
  // slot's next use rewrites the posts, and a driver that is not the
  // poster's own thread (the comm thread: Note [Progress without a waiter])
  // may still be here.
  run(first, first, 0);
  run(first, -1, 0);
  for (int source = 0; source < size; ++source) {
    for (int part = 0; part < R.parts; ++part) {
      // The parts of a piece open in order: when part `part` is closed for
      // every rank, so are the later ones (one opened since is found on the
      // next pass: its opener bumps `opened`, which wakes the drivers).
      bool any = false;
      for (int i = 0; i < size; ++i)
        any = run((first + i) % size, source, part) || any;
      if (!any) break;
    }
  }
  for (int i = 1; i < size; ++i)
    run((first + i) % size, -1, 0);
  if (ran == 0) return false;
  // Whoever ends the round's last pass retires it: then R is no longer ours.
  if (R.left.fetch_sub(ran) == ran) retire(R, use);
  return true;
}

void SharedGroup::finish_job(Round& R, uint64_t use, std::atomic<uint64_t>& claim, int r,
                             int source, int part) {
  bool first_phase = false;  // of a split all_reduce
  if ((R.state.load() & kSealed) == 0) {
    try {
      if (source < 0) {
        copy_peer_chunks(R, r);
      } else if (has_pieces(R.posts[r])) {
        copy_piece(R, r, source, part);
      } else {
        first_phase = splits(R.posts[r], size);
        run_whole(R, r);
      }
    } catch (...) {
      R.fail(r, std::current_exception());
    }
  }
  claim.store(done_in(use));
  // Still counted in `left` (run_jobs), so the posts stay.
  if (first_phase && R.split_done.fetch_add(1) + 1 == R.split_ranks.load()) {
    for (int q = 0; q < size; ++q) {
      if (splits(R.posts[q], size)) open(R.second(q), use);
    }
    R.opened.fetch_add(1);
    notify();
  }
}

void SharedGroup::wait_for_jobs(Round& R, uint64_t use) {
  for (size_t j = 0; j < R.num_claims(); ++j) {
    while (R.claims[j].load() == claimed_in(use))
      std::this_thread::yield();
  }
}

void SharedGroup::retire(Round& R, uint64_t use) {
  // Every job has ended: nothing else reads the posts or writes R.errors.
  std::string failed;
  for (int r = 0; r < size; ++r) {
    Post& p = R.posts[r];
    if (R.errors[r] && failed.empty()) {
      failed = fmt::format("rank {} failed in #{} {}: {}", r, p.entry.seq, collective_name(p.kind),
                           what_of(R.errors[r]));
    }
    if (p.start_us > 0 && trace_enabled()) {
      trace_complete("comm", fmt::format("{} #{}", collective_name(p.kind), p.entry.seq),
                     p.start_us, trace_now_us() - p.start_us,
                     fmt::format("\"seq\":{},\"group\":\"{}\"", p.entry.seq, name),
                     fmt::format("comm r{} {}", r, name));
    }
    p.input = Tensor();
    p.output = Tensor();
  }
  R.left.store(0);
  R.split_ranks.store(-1);
  R.split_done.store(0);
  if (!failed.empty()) abort(failed);
  for (int r = 0; r < size; ++r) {
    WorkPtr work = std::move(R.posts[r].work);
    try {
      work->finish(std::exchange(R.errors[r], nullptr));
    } catch (const std::exception& e) {  // a completion callback's: not the round's
      log_error("[comm::threads] a completion callback of {} threw: {}", work->description(),
                e.what());
    }
    // Dropped before the state moves on (Note [Threads jobs]).
  }
  R.state.store((use + 1) << kUseShift);
  notify();
}

}  // namespace tandem
