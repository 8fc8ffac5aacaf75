// The layout side of context parallelism (DESIGN §7): which sequence pieces a
// rank holds, how a whole sequence is sharded and gathered back, and the small
// helpers the CP hooks share for finding q/k/v among the attention arguments,
// replicating KV heads for Ulysses and restoring the global order of a
// load-balanced sequence (cp_internal.h).
#include <algorithm>
#include <numeric>

#include "tandem/autograd/ops.h"
#include "tandem/parallel/collectives.h"
#include "tandem/parallel/context_parallel.h"
#include "tandem/parallel/cp_internal.h"
#include "tandem/parallel/dtensor.h"
#include "tandem/runtime/error.h"

namespace tandem {

std::vector<SeqPiece> sequence_pieces(int64_t seq_len, int cp, int rank, bool load_balance) {
  if (!load_balance) {
    auto [start, len] = chunk_range(seq_len, cp, rank);
    return {{start, len}};
  }
  // Balanced chunks (lengths differ by at most one), so that the causal work
  // stays even when 2cp does not divide the sequence.
  const int64_t parts = 2 * cp, base = seq_len / parts, extra = seq_len % parts;
  auto piece = [&](int64_t i) {
    return SeqPiece{i * base + std::min(i, extra), base + (i < extra ? 1 : 0)};
  };
  return {piece(rank), piece(2 * cp - 1 - rank)};
}

std::vector<int64_t> sequence_positions(int64_t seq_len, int cp, int rank, bool load_balance) {
  TANDEM_CHECK(seq_len >= 0 && cp > 0 && rank >= 0 && rank < cp,
               "[parallel::sequence_positions] expected seq_len >= 0 and 0 <= rank < cp, got "
               "seq_len {}, rank {}, cp {}",
               seq_len, rank, cp);
  std::vector<int64_t> out;
  for (const SeqPiece& p : sequence_pieces(seq_len, cp, rank, load_balance)) {
    for (int64_t k = 0; k < p.length; ++k)
      out.push_back(p.start + k);
  }
  return out;
}

SequenceLayout shard_sequence_layout(int64_t seq_len, int cp, bool load_balance) {
  TANDEM_CHECK(seq_len >= 0 && cp > 0,
               "[parallel::shard_sequence_layout] expected seq_len >= 0 and cp > 0, got {} and {}",
               seq_len, cp);
  SequenceLayout layout;
  for (int r = 0; r < cp; ++r) {
    int64_t n = 0;
    for (const SeqPiece& p : sequence_pieces(seq_len, cp, r, load_balance))
      n += p.length;
    layout.lengths.push_back(n);
  }
  return layout;
}

Tensor shard_sequence(const Tensor& full, int64_t seq_dim, int cp, int rank, bool load_balance) {
  int d = wrap_dim(seq_dim, full.dim(), "shard_sequence");
  std::vector<Tensor> parts;
  for (const SeqPiece& p : sequence_pieces(full.shape()[d], cp, rank, load_balance)) {
    parts.push_back(narrow(full, d, p.start, p.length));
  }
  return parts.size() == 1 ? contiguous(parts[0]) : cat(parts, d);
}

Tensor unshard_sequence(const Tensor& local, int64_t seq_dim, const ProcessGroupPtr& group,
                        bool load_balance) {
  int d = wrap_dim(seq_dim, local.dim(), "unshard_sequence");
  const int cp = group->size();
  std::vector<int64_t> lengths = sequence_lengths(local, d, group, "unshard_sequence");
  Tensor gathered = all_gather_dim(local, group, d, lengths);
  if (!load_balance) return gathered;
  int64_t total = 0;
  for (int64_t l : lengths)
    total += l;
  return cp_detail::restore_sequence_order(gathered, d, lengths, total, cp);
}

int64_t causal_attention_pairs(int64_t seq_len, int cp, int rank, bool load_balance) {
  int64_t pairs = 0;
  for (const SeqPiece& p : sequence_pieces(seq_len, cp, rank, load_balance)) {
    for (int64_t i = p.start; i < p.start + p.length; ++i)
      pairs += i + 1;
  }
  return pairs;
}

namespace cp_detail {

namespace {

Tensor* qkv_slot(Args& args, const ContextParallel& cp, int i) {
  if (i < static_cast<int>(cp.qkv_names.size())) {
    if (Tensor* t = args.find(cp.qkv_names[i])) return t;
  }
  if (i < static_cast<int>(cp.qkv_positions.size())) {
    if (Tensor* t = args.at(static_cast<size_t>(cp.qkv_positions[i]))) return t;
  }
  return nullptr;
}

}  // namespace

CPCallState set_layout(Args& args, std::vector<int64_t> lengths) {
  CPCallState s;
  for (int64_t l : lengths)
    s.total += l;
  const int64_t n = static_cast<int64_t>(lengths.size());
  args.named[kLayoutArg] = ops::from_vector(lengths, Shape{n}, Device::cpu());
  s.lengths = std::move(lengths);
  return s;
}

CPCallState layout_of(const Args& args) {
  auto it = args.named.find(kLayoutArg);
  TANDEM_CHECK(it != args.named.end() && it->second.defined(),
               "[parallel::ContextParallel] expected the attention pre-hook to have recorded this "
               "call's layout (argument \"{}\"), got none (was the core called directly, or the "
               "pre-hook removed?)",
               kLayoutArg);
  CPCallState s;
  s.lengths = it->second.to_vector<int64_t>();
  for (int64_t l : s.lengths)
    s.total += l;
  return s;
}

std::vector<Tensor*> qkv_slots(Args& args, const ContextParallel& cp) {
  std::vector<Tensor*> slots;
  static const char* names[] = {"q", "k", "v"};
  for (int i = 0; i < 3; ++i) {
    Tensor* t = qkv_slot(args, cp, i);
    TANDEM_CHECK(t != nullptr && t->defined(),
                 "[parallel::ContextParallel] expected {} in the attention arguments (named \"{}\" "
                 "or at position {}), got none",
                 names[i], i < static_cast<int>(cp.qkv_names.size()) ? cp.qkv_names[i] : "",
                 i < static_cast<int>(cp.qkv_positions.size()) ? cp.qkv_positions[i] : -1);
    slots.push_back(t);
  }
  return slots;
}

Tensor replicate_heads(const Tensor& t, int64_t head_dim, int64_t degree) {
  const int64_t h = t.shape()[head_dim];
  if (h % degree == 0) return t;
  TANDEM_CHECK(degree % h == 0,
               "[parallel::ContextParallel] expected the KV heads and the Ulysses degree to divide "
               "one another (KV heads % degree == 0, or degree % KV heads == 0: each KV head is "
               "then replicated degree / KV heads times), got {} KV heads and degree {}",
               h, degree);
  Shape expanded = t.shape();
  expanded.insert(static_cast<int>(head_dim) + 1, degree / h);
  Shape merged = t.shape();
  merged[head_dim] = degree;
  return reshape(expand(unsqueeze(t, head_dim + 1), expanded), merged);
}

std::vector<int64_t> block_sums(const std::vector<int64_t>& lengths, int ds) {
  std::vector<int64_t> out;
  for (size_t i = 0; i < lengths.size(); i += static_cast<size_t>(ds)) {
    int64_t s = 0;
    for (int j = 0; j < ds; ++j)
      s += lengths[i + static_cast<size_t>(j)];
    out.push_back(s);
  }
  return out;
}

std::vector<int64_t> ds_block_lengths(const std::vector<int64_t>& lengths, int rank, int ds) {
  return std::vector<int64_t>(lengths.begin() + (rank / ds) * ds,
                              lengths.begin() + (rank / ds + 1) * ds);
}

int64_t ds_block_start(const std::vector<int64_t>& lengths, int rank, int ds) {
  return std::accumulate(lengths.begin(), lengths.begin() + (rank / ds) * ds, int64_t{0});
}

Tensor restore_sequence_order(const Tensor& gathered, int64_t dim,
                              const std::vector<int64_t>& lengths, int64_t total, int cp) {
  // Rank order holds [c0, c(2cp-1)], [c1, c(2cp-2)], ...: put pieces in place.
  std::vector<Tensor> by_position(static_cast<size_t>(2 * cp));
  int64_t offset = 0;
  for (int r = 0; r < cp; ++r) {
    std::vector<SeqPiece> pieces = sequence_pieces(total, cp, r, true);
    by_position[r] = narrow(gathered, dim, offset, pieces[0].length);
    by_position[2 * cp - 1 - r] =
        narrow(gathered, dim, offset + pieces[0].length, pieces[1].length);
    offset += lengths[r];
  }
  return cat(by_position, dim);
}

}  // namespace cp_detail

}  // namespace tandem
