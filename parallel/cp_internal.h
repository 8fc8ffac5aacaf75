// What the files of context parallelism share (context_parallel.h has the
// public side): cp_layout.cpp's layout helpers, used by the Ulysses /
// all-gather KV hooks (context_parallel.cpp) and the async hooks
// (cp_async.cpp), and the ring attention of cp_ring.cpp, called by the
// kernel that context_parallel.cpp installs. Private to parallel/; not
// installed.
#pragma once

#include <cstdint>
#include <vector>

#include "tandem/autograd/module.h"
#include "tandem/comm/process_group.h"
#include "tandem/parallel/context_parallel.h"
#include "tandem/parallel/sequence_layout.h"
#include "tandem/tensor/ops.h"
#include "tandem/tensor/tensor.h"

namespace tandem::cp_detail {

// Note [CP per-call state]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// Forwards of different micro-batches run concurrently on the dual-pipe
// workers, through one core-attention module. Whatever one forward's hooks
// and kernel share must therefore belong to that call, never to the module or
// a thread. The layout (every rank's sequence length) is what the caller
// declared for the CP group (Note [Sequence layout as data]), or, without a
// declaration, gathered from the group by the pre-hook. It rides on the
// call's arguments: the pre-hook adds it as the named argument "cp_lengths" (a CPU
// I64 tensor, read on the host without a device synchronisation), and the
// kernel and the forward hook read it from the arguments they are given
// (Module::call hands both the arguments as the pre-hooks left them). The
// async variant's collectives are Exchanges owned by the autograd nodes of
// the forward that launched them (Note [Exchange windows]); between the
// projection hook that starts one and the attention pre-hook that joins it,
// it is found by the storage of the projection output it was started on.
struct CPCallState {
  std::vector<int64_t> lengths;  // every CP rank's local sequence length
  int64_t total = 0;
};
inline constexpr const char* kLayoutArg = "cp_lengths";
// Records `lengths` in `args` and returns the layout.
CPCallState set_layout(Args& args, std::vector<int64_t> lengths);
// The layout the pre-hook recorded in `args`; throws when there is none.
CPCallState layout_of(const Args& args);

// The q, k and v slots of the attention arguments (named slots take
// precedence over positions); throws when one is missing.
std::vector<Tensor*> qkv_slots(Args& args, const ContextParallel& cp);

// Replicates KV heads so that `degree` divides them (GQA with fewer KV heads
// than the Ulysses degree); the expand's backward sums the copies.
Tensor replicate_heads(const Tensor& t, int64_t head_dim, int64_t degree);

// The synchronous collectives of the pre-hook, one tensor at a time (the
// async variant falls back to them: Note [Async CP fallback]). Ulysses: `t`
// (a query, or with `kv` a key or value, whose heads are replicated where ds
// does not divide them) from sequence- to head-sharded over the ds group.
// All-gather KV: `t` gathered along the sequence over the co group, in global
// order.
Tensor scatter_heads(const Tensor& t, bool kv, const CPCallState& s, const CPRuntime& rt,
                     int64_t sd, int64_t hd);
Tensor gather_sequence(const Tensor& t, const CPCallState& s, const CPRuntime& rt,
                       const ContextParallel& config);

// Per-rank sums of `lengths` over groups of `ds` adjacent ranks.
std::vector<int64_t> block_sums(const std::vector<int64_t>& lengths, int ds);

// The lengths of the ds block (of adjacent ranks) that `rank` belongs to.
std::vector<int64_t> ds_block_lengths(const std::vector<int64_t>& lengths, int rank, int ds);
// Where that block's tokens start in the sequence.
int64_t ds_block_start(const std::vector<int64_t>& lengths, int rank, int ds);

// A load-balanced sequence gathered in rank order ([c0, c(2cp-1)], [c1,
// c(2cp-2)], ...) put back in global order along `dim`. `lengths`: every
// rank's local length; `total`: their sum.
Tensor restore_sequence_order(const Tensor& gathered, int64_t dim,
                              const std::vector<int64_t>& lengths, int64_t total, int cp);

// Ring attention over the local q, k, v (BSHD, or BNSD with `bnsd`) of every
// rank of `group` (cp_ring.cpp): `seq_len` is the global length, `lengths`
// every rank's local length.
Tensor ring_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                      const ProcessGroupPtr& group, const AttentionOptions& options,
                      int64_t seq_len, bool load_balance, const std::vector<int64_t>& lengths,
                      bool bnsd);

}  // namespace tandem::cp_detail
