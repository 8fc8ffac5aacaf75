#include "tandem/comm/ledger.h"

#include <algorithm>

#include <fmt/format.h>

namespace tandem {
namespace {
uint64_t mix(uint64_t h, uint64_t v) {
  h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
  return h;
}
uint64_t hash_str(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s)
    h = (h ^ c) * 1099511628211ull;
  return h;
}
}  // namespace

uint64_t LedgerEntry::fingerprint() const {
  uint64_t h = mix(hash_str(op), hash_str(dtype));
  for (int64_t c : counts)
    h = mix(h, static_cast<uint64_t>(c));
  return mix(h, static_cast<uint64_t>(peer + 1));
}

std::string LedgerEntry::str() const {
  std::string counts_str;
  for (size_t i = 0; i < counts.size(); ++i)
    counts_str += fmt::format("{}{}", i ? "," : "", counts[i]);
  std::string s = fmt::format("#{} {}({}, [{}]", seq, op, dtype, counts_str);
  if (peer >= 0) s += fmt::format(", peer/root={}", peer);
  s += ")";
  if (!thread.empty()) s += " from " + thread;
  if (!tag.empty()) s += " tag=" + tag;
  return s;
}

LedgerEntry Ledger::append(LedgerEntry entry) {
  std::lock_guard<std::mutex> lock(mu_);
  entry.seq = next_seq_++;
  running_ = mix(running_, entry.fingerprint());
  if (capacity_ > 0) {
    const size_t slot = static_cast<size_t>(entry.seq % capacity_);
    if (slot == entries_.size()) {
      entries_.push_back(entry);
    } else {
      entries_[slot] = entry;
    }
  }
  return entry;
}

std::vector<LedgerEntry> Ledger::tail(size_t n) const {
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t count = std::min<uint64_t>({n, next_seq_, capacity_});
  std::vector<LedgerEntry> out;
  out.reserve(static_cast<size_t>(count));
  for (uint64_t seq = next_seq_ - count; seq < next_seq_; ++seq)
    out.push_back(entries_[static_cast<size_t>(seq % capacity_)]);
  return out;
}

std::string Ledger::tail_str(size_t n) const {
  std::string out;
  for (const LedgerEntry& e : tail(n))
    out += "    " + e.str() + "\n";
  return out.empty() ? "    (no collectives launched)\n" : out;
}

uint64_t Ledger::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return next_seq_;
}

uint64_t Ledger::history_fingerprint() const {
  std::lock_guard<std::mutex> lock(mu_);
  return running_;
}

}  // namespace tandem
