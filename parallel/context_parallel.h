// Context parallelism on the core-attention module (DESIGN §7): the sequence
// of Q/K/V is sharded across the ranks of a CP mesh and the attention is
// computed as if on the whole sequence.
//
//   cp = mesh size, ds = ulysses_degree, co = cp / ds
//   Ulysses   (ds == cp)      all-to-all Q/K/V from sequence- to head-sharded,
//                             attention on whole sequences of cp-th of the
//                             heads, reverse all-to-all of the output.
//   all-gather KV (ds == 1)   Q stays sharded; K and V are all-gathered along
//                             the sequence (their gradients reduce-scattered);
//                             the causal mask uses the global positions of the
//                             local queries.
//   hybrid  (1 < ds < cp)     a (co, ds) mesh of adjacent ranks: Ulysses over
//                             ds, then all-gather of K/V over co.
//   ring    (mode = Ring)     K/V blocks circulate between neighbours by
//                             send/recv while each rank attends to the block
//                             it holds; partial results merge by log-sum-exp;
//                             the next block's transfer overlaps the current
//                             block's compute; dK/dV circulate back in backward.
//
// Load balance (all-gather KV and ring, causal): rank r holds sequence chunks
// r and 2cp-1-r of 2cp, so every rank has the same causal work;
// shard_sequence() lays a batch out that way. Sequence lengths need not
// divide cp: shards follow chunk semantics, transfers are padded inside the
// layer and only real tokens are attended to and returned. A rank may hold
// no tokens at all (a sequence shorter than cp, or than 2cp with load
// balance): its output and gradients are empty, and it still takes part in
// every collective.
//
// Heads with Ulysses (ds > 1): the query heads must be divisible by ds, and
// the KV heads (Hkv) and ds must divide one another: Hkv % ds == 0 (each rank
// gets Hkv / ds KV heads) or ds % Hkv == 0 (each KV head is replicated
// ds / Hkv times before the all-to-all; the copies' gradients sum back).
// Other counts are refused (3 KV heads on ds = 2, 6 on ds = 4). All-gather KV
// and ring (ds == 1) take any grouped-query layout.
//
// Weight gradients: everything outside the core attention (the q/k/v/o
// projections of nn::SelfAttention, norms, MLPs) sees only this rank's
// tokens, so after backward its parameters' gradients are per-rank partial
// sums. Sum them over the CP group before the optimizer step
// (parallel/data_parallel.h; with data parallelism as well, one call does
// both, as tandem-train does):
//
//   reduce_gradients(model->parameters(), mesh, {"dp", "cp"});
//
// Activation gradients (of the layer
// input) are complete on every rank and need nothing.
//
// The hooks work on the local tensors that modules exchange; apply() must be
// called on every rank of the mesh, and every forward is collective over it.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tandem/autograd/nn/attention.h"
#include "tandem/parallel/device_mesh.h"
#include "tandem/parallel/dtensor.h"
#include "tandem/parallel/sequence_layout.h"

namespace tandem {

enum class CPMode { Auto, Ring };

// The groups of one CP layer. The layout of each forward (every rank's
// sequence length) is not kept here: it rides on that call's arguments
// (Note [CP per-call state], cp_internal.h).
struct CPRuntime {
  int cp = 1, ds = 1, co = 1;
  ProcessGroupPtr cp_group, ds_group, co_group;
};

struct ContextParallel {
  // Of the Q/K/V tensors: 1 and 2 (BSHD), or 2 and 1 (BNSD), as the core
  // attention's QKVLayout says (checked at apply).
  int64_t seq_dim = 1;
  int64_t head_dim = 2;
  int64_t ulysses_degree = 1;
  std::vector<int> qkv_positions = {0, 1, 2};            // positional slots of q, k, v
  std::vector<std::string> qkv_names = {"q", "k", "v"};  // named slots (take precedence)
  bool use_local_output = true;  // modules exchange local tensors; DTensors: attend()
  bool load_balance = false;
  CPMode mode = CPMode::Auto;

  // Registers the hooks (and, for ring / load-balanced layouts, the kernel)
  // on `core`. `mesh`: 1-D, or 2-D with dims named "co" and "ds" (hybrid).
  void apply(const std::shared_ptr<nn::CoreAttention>& core, const DeviceMesh& mesh) const;

  // DTensor front end: q/k/v given as DTensors whose placement on `cp_dim` of
  // their mesh is Shard(seq_dim) (other placements are redistributed to it,
  // placements on other mesh dims — e.g. tensor-parallel Shard(head) — are
  // kept). Calls `core` (which apply() prepared with the sub-mesh of that
  // dim) on the local tensors. Returns the local output (wrapped with q's
  // mesh and placements: a DTensor) — use to_local() when use_local_output.
  DTensor attend(const std::shared_ptr<nn::CoreAttention>& core, const DTensor& q, const DTensor& k,
                 const DTensor& v, const std::string& cp_dim) const;

  // apply() without the collectives of the pre-hook (AsyncContextParallel
  // launches them from the projections instead) and, with output_in_kernel,
  // without Ulysses' output all-to-all after the kernel (AsyncContextParallel's
  // kernel sends the output in head chunks); returns the shared runtime.
  std::shared_ptr<CPRuntime> install(const std::shared_ptr<nn::CoreAttention>& core,
                                     const DeviceMesh& mesh, bool collectives_in_pre_hook,
                                     bool output_in_kernel = false) const;
};

// The async variant (DESIGN §7): the q/k/v projections' forward hooks launch
// the all-to-all (Ulysses) or the K/V all-gather as soon as each projection
// has produced its output, and the attention pre-hook waits for them. In
// backward, the reverse collective of each gradient is launched as soon as the
// gradient exists — all three before any is waited on — and waited just
// before the projection's GEMM (each collective is an Exchange of
// parallel/collectives.h). Communication thus overlaps the projection GEMMs
// in both directions. Ulysses' and hybrid's output all-to-all leaves in head
// chunks, each as soon as its attention is done (Note [Ulysses output in
// chunks] in cp_async.cpp). Results are identical to ContextParallel's. Supports
// Ulysses (ulysses_degree == cp), all-gather KV (ulysses_degree == 1, with
// or without load balance) and hybrid (q over the ds group, K/V in one
// all-to-all over the CP group: Note [Async hybrid in one collective] in
// cp_async.cpp; equal to ContextParallel's up to the order in which the K/V
// gradient's pieces are summed); mode Ring installs ContextParallel's ring,
// whose transfers are in flight behind each block's compute in both
// directions already. The projections output (B, S, heads * head_size),
// and q/k/v reach the attention as views of those outputs (reshaped, nothing
// computed in between, or what `prepare` computes in the projection hook).
// Where they do not — a null or fused (one module for two of q/k/v)
// projection, something else computed between projection and attention —
// those collectives run synchronously, as ContextParallel's, and a
// debug-level line says which and why (Note [Async CP fallback]).
struct AsyncContextParallel {
  ContextParallel config;
  int64_t head_size = 0;
  // Optional: what the layer computes on projection `slot`'s output (0, 1,
  // 2: q, k, v) before the attention, applied by the projection's hook before
  // its collective starts; the output's shape stays (Note [Rotary before the
  // exchange] in cp_async.cpp). The layer must then skip it for the slots
  // apply() returns.
  std::function<Tensor(int slot, const Tensor& y)> prepare = nullptr;
  // Returns the slots whose projections it hooked: {0, 1, 2} (Ulysses,
  // hybrid), {1, 2} (all-gather KV), none when it installed ContextParallel's
  // layer instead (ring, or the fallback at apply).
  std::vector<int> apply(const std::shared_ptr<nn::CoreAttention>& core,
                         const std::shared_ptr<Module>& q_proj,
                         const std::shared_ptr<Module>& k_proj,
                         const std::shared_ptr<Module>& v_proj, const DeviceMesh& mesh) const;
};

// Context parallelism on a whole attention layer: AsyncContextParallel from
// its q/k/v projections when `async`, else `config` on its core. A layer
// with QK-norm or a rotary embedding has them applied by the projections'
// hooks where those start collectives (Note [Rotary before the exchange]).
void apply_context_parallel(nn::SelfAttention& attn, const ContextParallel& config,
                            const DeviceMesh& mesh, bool async);

// Global positions of the sequence pieces a rank holds, in local order: one
// chunk of cp (chunk semantics, as DTensor), or (load balance) chunks r and
// 2cp-1-r of 2cp, balanced so that lengths differ by at most one.
struct SeqPiece {
  int64_t start = 0;
  int64_t length = 0;
};
std::vector<SeqPiece> sequence_pieces(int64_t seq_len, int cp, int rank, bool load_balance);

// The global positions of the tokens `rank` holds, in its local order: what a
// rotary layer needs under CP (nn::PositionScope, autograd/nn/rope.h).
std::vector<int64_t> sequence_positions(int64_t seq_len, int cp, int rank, bool load_balance);

// Every rank's length under shard_sequence() of `seq_len` tokens over cp
// ranks: the layout a caller declares with SequenceLayoutScope on the CP mesh
// (Note [Sequence layout as data]), so that each CP forward reads it instead
// of gathering every rank's length.
SequenceLayout shard_sequence_layout(int64_t seq_len, int cp, bool load_balance);

// This rank's part of a whole sequence (dim `seq_dim`), and the whole
// sequence back from every rank's part (collective over `group`; the lengths
// come from the declared layout where there is one).
Tensor shard_sequence(const Tensor& full, int64_t seq_dim, int cp, int rank, bool load_balance);
Tensor unshard_sequence(const Tensor& local, int64_t seq_dim, const ProcessGroupPtr& group,
                        bool load_balance);

// Number of (query, key) pairs a rank attends to under a causal mask.
int64_t causal_attention_pairs(int64_t seq_len, int cp, int rank, bool load_balance);

}  // namespace tandem
