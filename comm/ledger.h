// The per-group ledger of launched collectives (DESIGN §5).
//
// Note [Checked launch order]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Every collective a group launches is appended here at issue time, under the
// process's issue lock, with a sequence number: op, dtype, element counts,
// peer/root, issuing thread and an optional tag. Its fingerprint (a hash of
// everything that must agree across ranks) is exchanged before the collective
// runs when the group is in checked mode; a mismatch raises an error on every
// rank naming the first divergent call of each side, instead of a hang or
// silent garbage. The watchdog prints the ledger tail when a wait expires.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace tandem {

struct LedgerEntry {
  uint64_t seq = 0;
  std::string op;  // "all_reduce", "send", ...
  std::string dtype;
  std::vector<int64_t> counts;  // element counts (shape, or split sizes)
  int peer = -1;                // root or peer, -1 when none
  std::string thread;           // issuing thread
  std::string tag;
  // What must agree across ranks (op, dtype, counts, peer/root semantics).
  uint64_t fingerprint() const;
  std::string str() const;
};

class Ledger {
 public:
  explicit Ledger(size_t capacity = 256) : capacity_(capacity) {}
  // Appends and returns the entry with its sequence number filled in.
  LedgerEntry append(LedgerEntry entry);
  std::vector<LedgerEntry> tail(size_t n) const;
  std::string tail_str(size_t n) const;
  uint64_t size() const;
  // Fingerprint of the whole history (a running hash), for end-of-step checks.
  uint64_t history_fingerprint() const;

 private:
  size_t capacity_;
  mutable std::mutex mu_;
  // The last capacity_ entries, a ring: entry `seq` sits at seq % capacity_
  // and is overwritten in place, so a launch copies into strings and a vector
  // that already have their capacity instead of allocating.
  std::vector<LedgerEntry> entries_;
  uint64_t next_seq_ = 0;
  uint64_t running_ = 1469598103934665603ull;
};

}  // namespace tandem
