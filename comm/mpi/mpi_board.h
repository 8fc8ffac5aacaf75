// The shared-memory fingerprint board of an MPI group whose processes share
// one node (Note [MPI fingerprint board]). Private to comm/mpi.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace tandem::mpi {

// What each rank contributes to a checked-mode handshake (mpi_tasks.cpp):
// the fingerprint of its ledger entry and the split-size hashes of an
// all_to_all. Exchanged by MPI_Iallgather, or through the board.
struct Hello {
  uint64_t fingerprint;
  int32_t failed;  // 1 when this rank found an error before the collective
  // An all_to_all whose send and receive counts all equal this (else -1): when
  // every rank's does, the task runs MPI_Ialltoall instead of MPI_Ialltoallv.
  int32_t even;
  uint64_t sent;  // all_to_all split sizes (mpi_tasks.cpp); 0 for other collectives
  uint64_t expected;
};

// Note [MPI fingerprint board]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Checked mode compares every collective's fingerprint across the ranks
// before the data moves. Through MPI that is one small MPI_Iallgather per
// collective, which on a node of oversubscribed processes costs as much as
// moving a megabyte (every process must be scheduled to forward it). When
// all processes of a group share a node, the group maps a board instead: a
// POSIX shared-memory object with, per rank, a ring of kSlots records and a
// counter of the handshakes it has read.
//
// Handshake h (the group's h-th, counted on every rank in channel order, so
// the h-th handshakes of the ranks meet, as MPI matches the h-th collective
// of a communicator) uses slot h % kSlots:
// 1. wait until every rank has read handshake h - kSlots (its slot is free);
// 2. write this rank's Hello into its slot, then store h + 1 in the slot's
//    sequence word (release);
// 3. wait until every rank's slot holds sequence h + 1 (acquire), copy the
//    records, then store h + 1 in this rank's read counter (release).
// The comparison that follows is the one the MPI_Iallgather path makes, on
// the same table on every rank; a disagreement still gathers descriptions
// through MPI. Both waits are bounded by the task's deadline and name the
// ranks that have not written (or read) yet.
//
// Set-up (BoardTask, the first task of each new communicator when checked
// mode is on): an MPI_Iallgather of {node id, pid, nonce} decides whether
// every rank is on this node; if so each rank opens and maps the object
// named after group rank 0's pid and nonce (O_CREAT, so whoever comes first
// creates it zero-filled), a second MPI_Iallgather says whether every rank
// managed to, and group rank 0 unlinks the name (the mappings stay). A group
// spanning nodes, a failed mapping on any rank, or TANDEM_MPI_BOARD=0 keeps
// the MPI_Iallgather handshake; every rank makes the same choice.
class Board {
 public:
  static constexpr uint64_t kSlots = 64;

  // Maps `name` (creating it if needed) for `n` ranks; nullptr when the
  // object cannot be created or mapped (errno-based reason in `why`).
  static std::unique_ptr<Board> open(const std::string& name, int n, int me, std::string& why);
  static void unlink(const std::string& name);
  ~Board();
  Board(const Board&) = delete;
  Board& operator=(const Board&) = delete;

  // Step 1: every rank has read handshake h - kSlots.
  bool slot_free(uint64_t h) const;
  // Step 2.
  void write(uint64_t h, const Hello& hello);
  // Step 3: every rank has written handshake h.
  bool complete(uint64_t h) const;
  // Copies every rank's record of handshake h and marks it read.
  void read(uint64_t h, std::vector<Hello>& out);
  // Ranks that have not written handshake h (after a failed complete()), or
  // not read handshake h - kSlots (after a failed slot_free()).
  std::vector<int> not_written(uint64_t h) const;
  std::vector<int> not_read(uint64_t h) const;

 private:
  struct alignas(64) Slot {
    uint64_t seq;  // h + 1 once handshake h is written
    Hello hello;
  };
  struct alignas(64) Area {  // one per rank
    uint64_t read;           // handshakes read
    Slot slots[kSlots];
  };
  Board(void* base, size_t bytes, int n, int me) : base_(base), bytes_(bytes), n_(n), me_(me) {}
  Area& area(int r) const { return static_cast<Area*>(base_)[r]; }

  void* base_;
  size_t bytes_;
  int n_, me_;
};

}  // namespace tandem::mpi
