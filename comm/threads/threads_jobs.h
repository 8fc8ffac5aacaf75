// The rounds of the threads backend and the jobs that move their data:
// private to comm/threads. Note [Threads rounds] (threads_backend.cpp) says
// how a collective becomes a round; Note [Threads jobs] and Note [Threads
// reductions] (threads_jobs.cpp) what its jobs do.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "tandem/comm/process_group.h"

namespace tandem::threads_detail {

// The ring of rounds of a group (Note [Threads rounds] in threads_backend.cpp).
constexpr uint64_t kRounds = 8;

// A round's state word: the members that posted (bits 0-30), sealed (bit
// 31), and which use of its ring slot it is (bits 32-63; round k is use
// k / kRounds of slot k % kRounds).
constexpr uint64_t kCountMask = (uint64_t{1} << 31) - 1;
constexpr uint64_t kSealed = uint64_t{1} << 31;
constexpr int kUseShift = 32;
inline uint64_t use_of(uint64_t state) {
  return state >> kUseShift;
}
inline int posted_of(uint64_t state) {
  return static_cast<int>(state & kCountMask);
}
// A job's claim flag during use u of its slot: closed (not runnable yet, or
// not a job of this round), open, claimed (running), done. Flags only grow,
// so every value below open_in(u), whatever an earlier use of the slot left
// there, reads as closed in use u: retiring a round resets no flag.
inline bool closed_in(uint64_t flag, uint64_t u) {
  return flag < 4 * u + 1;
}
inline uint64_t open_in(uint64_t u) {
  return 4 * u + 1;
}
inline uint64_t claimed_in(uint64_t u) {
  return 4 * u + 2;
}
inline uint64_t done_in(uint64_t u) {
  return 4 * u + 3;
}

// One member's part of a round, written by that member before it bumps the
// round's count and read by the jobs after the count is full.
struct Post {
  CollectiveKind kind = CollectiveKind::Barrier;
  Tensor input;
  Tensor output;  // peers read it in the second phase of a split all_reduce
  RedOp op = RedOp::Sum;
  int root = -1;
  LedgerEntry entry;
  uint64_t fingerprint = 0;  // of entry
  std::vector<int64_t> input_splits, output_splits;
  bool checked = true;
  // The poster's where(); its group outlives the round (its destructor
  // drives its rounds to the end).
  const std::string* where = nullptr;
  WorkPtr work;
  int64_t start_us = 0;  // for the trace
};

// One collective of a group (Note [Threads rounds]).
struct Round {
  explicit Round(int n)
      : n(n),
        parts(max_parts(n)),
        claims(std::make_unique<std::atomic<uint64_t>[]>(num_claims())),
        posts(static_cast<size_t>(n)),
        errors(static_cast<size_t>(n)) {}
  // Parts a piece may be split into (Note [Threads job order]): 8, fewer
  // when n * n pieces are many already.
  static int max_parts(int n) { return std::max(1, std::min(8, 256 / (n * n))); }
  const int n;
  const int parts;
  std::atomic<uint64_t> state{0};
  // Jobs posted and not yet run: the round retires when it reaches 0 (Note
  // [Threads jobs]).
  std::atomic<int64_t> left{0};
  std::atomic<uint64_t> opened{0};  // bumped after jobs open: wakes the drivers' waits
  // Split all_reduce (Note [Threads reductions]): ranks that split, and
  // those whose first-phase job ended.
  std::atomic<int> split_ranks{-1};
  std::atomic<int> split_done{0};
  // Claim flags (Note [Threads jobs]): job (r * n + s) * parts + p is part p
  // of rank r's piece from rank s, job (r * n + r) * parts its whole part
  // when it has no pieces, job n * n * parts + r its second phase.
  std::unique_ptr<std::atomic<uint64_t>[]> claims;
  std::vector<Post> posts;
  std::mutex errors_mu;                    // the first error of a rank's jobs wins
  std::vector<std::exception_ptr> errors;  // by rank

  size_t num_claims() const { return static_cast<size_t>(n) * n * parts + n; }
  std::atomic<uint64_t>& piece(int r, int s, int p = 0) {
    return claims[(static_cast<size_t>(r) * n + s) * parts + p];
  }
  std::atomic<uint64_t>& second(int r) { return claims[static_cast<size_t>(n) * n * parts + r]; }
  void fail(int r, std::exception_ptr error) {
    std::lock_guard<std::mutex> lock(errors_mu);
    if (!errors[r]) errors[r] = std::move(error);
  }
};

// The device of a post's tensors (cpu for a barrier), and a copy of `nbytes`
// on it that has ended when the call returns (Note [Threads ranks on one
// CUDA device] in threads_jobs.cpp).
Device device_of(const Post& p);
void move_bytes(Device device, void* dst, const void* src, size_t nbytes);

// Kinds of jobs (Note [Threads jobs]).
bool has_pieces(const Post& p);
// Whether rank p's all_reduce is split into two phases (Note [Threads reductions]).
bool splits(const Post& p, int n);
// Parts of the piece `me` receives from `source` (1 for a piece under 4 MiB),
// from `me`'s own post, at most `max_parts` (Note [Threads job order]).
int parts_of(const Post& me, int source, int max_parts);
// Jobs a post adds to its round.
int64_t jobs_of(const Post& p, int n, int max_parts);

// The jobs. Each reads only the round's posts, never blocks, and throws on
// what checked mode (or, with it off, the job's own checks) finds.
// Part `part` of piece (index, source) of an all_gather or all_to_all.
void copy_piece(const Round& R, int index, int source, int part);
// Rank `index`'s whole part once every rank has posted: a reduction,
// broadcast or barrier, or the first phase of a split all_reduce.
void run_whole(const Round& R, int index);
// Second phase of a split all_reduce.
void copy_peer_chunks(Round& R, int index);

}  // namespace tandem::threads_detail
