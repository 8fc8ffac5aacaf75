// Placements of a DTensor on each mesh dim (DESIGN §6): Shard(dim),
// Replicate(), Partial(op).
//
// Uneven shards follow chunk semantics (torch.chunk): n elements over k ranks
// give ceil(n/k) to the first ranks, the remainder to the next one, and
// nothing to the rest. chunk_range() is the one place that rule lives.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "tandem/comm/types.h"

namespace tandem {

struct Placement {
  enum class Kind : uint8_t { Shard, Replicate, Partial };
  Kind kind = Kind::Replicate;
  int64_t dim = 0;        // Shard: the tensor dim (non-negative once normalised)
  RedOp op = RedOp::Sum;  // Partial: how the pending values combine

  bool is_shard() const { return kind == Kind::Shard; }
  bool is_shard(int64_t d) const { return kind == Kind::Shard && dim == d; }
  bool is_replicate() const { return kind == Kind::Replicate; }
  bool is_partial() const { return kind == Kind::Partial; }
  std::string str() const;
  friend bool operator==(const Placement& a, const Placement& b) {
    if (a.kind != b.kind) return false;
    if (a.kind == Kind::Shard) return a.dim == b.dim;
    if (a.kind == Kind::Partial) return a.op == b.op;
    return true;
  }
  friend bool operator!=(const Placement& a, const Placement& b) { return !(a == b); }
};

// Placement constructors, spelled as in DESIGN §6 and PyTorch.
inline Placement Shard(int64_t dim) {
  return {Placement::Kind::Shard, dim, RedOp::Sum};
}
inline Placement Replicate() {
  return {Placement::Kind::Replicate, 0, RedOp::Sum};
}
inline Placement Partial(RedOp op = RedOp::Sum) {
  return {Placement::Kind::Partial, 0, op};
}

using Placements = std::vector<Placement>;
std::string placements_str(const Placements& p);

// The [start, start + length) of chunk `index` when `n` is split in `parts`.
std::pair<int64_t, int64_t> chunk_range(int64_t n, int64_t parts, int64_t index);

}  // namespace tandem
