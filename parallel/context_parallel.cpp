// ContextParallel (DESIGN §7): the hooks and kernel that Ulysses, all-gather
// KV and their hybrid install on a core-attention module, the per-forward
// layout they share (Note [CP per-call state]), and the DTensor front end,
// attend(). The
// layout helpers live in cp_layout.cpp, ring attention in cp_ring.cpp and
// the async variant in cp_async.cpp.
#include "tandem/parallel/context_parallel.h"

#include <algorithm>

#include "tandem/autograd/function.h"
#include "tandem/autograd/ops.h"
#include "tandem/parallel/collectives.h"
#include "tandem/parallel/cp_internal.h"
#include "tandem/parallel/dtensor.h"
#include "tandem/runtime/error.h"

namespace tandem {

namespace {

using cp_detail::CPCallState;
using cp_detail::ds_block_lengths;
using cp_detail::layout_of;
using cp_detail::qkv_slots;
using cp_detail::set_layout;

// Refuses what no layout supports, before any group is made.
void check_options(const ContextParallel& config, const std::shared_ptr<nn::CoreAttention>& core,
                   const DeviceMesh& mesh) {
  TANDEM_CHECK(core != nullptr, "[parallel::ContextParallel] expected a core-attention module");
  TANDEM_CHECK(
      mesh.ndim() == 1 || mesh.ndim() == 2,
      "[parallel::ContextParallel] expected a 1-D or 2-D (co, ds) mesh, got a {}-D mesh {}",
      mesh.ndim(), mesh.str());
  const bool bshd = config.seq_dim == 1 && config.head_dim == 2;
  const bool bnsd = config.seq_dim == 2 && config.head_dim == 1;
  TANDEM_CHECK(bshd || bnsd,
               "[parallel::ContextParallel] expected BSHD (seq_dim 1, head_dim 2) or BNSD "
               "(seq_dim 2, head_dim 1), got seq_dim {} and head_dim {}",
               config.seq_dim, config.head_dim);
  TANDEM_CHECK(bnsd == (core->layout() == nn::QKVLayout::BNSD),
               "[parallel::ContextParallel] expected seq_dim {} and head_dim {} to match the core "
               "attention's layout {}, got seq_dim {} and head_dim {}",
               bnsd ? 1 : 2, bnsd ? 2 : 1, bnsd ? "BSHD" : "BNSD", config.seq_dim, config.head_dim);
  TANDEM_CHECK(config.use_local_output,
               "[parallel::ContextParallel] expected use_local_output (modules exchange local "
               "tensors; for DTensor inputs and outputs call attend()), got false");
  const int cp = static_cast<int>(mesh.size());
  const int ds = static_cast<int>(config.ulysses_degree);
  TANDEM_CHECK(ds >= 1 && cp % ds == 0,
               "[parallel::ContextParallel] expected the Ulysses degree to divide cp={}, got {}",
               cp, ds);
  const bool ring = config.mode == CPMode::Ring;
  TANDEM_CHECK(!(ring && ds > 1),
               "[parallel::ContextParallel] expected ulysses_degree 1 with ring, got {}", ds);
  TANDEM_CHECK(!(config.load_balance && ds > 1),
               "[parallel::ContextParallel] expected load balance only with all-gather KV or "
               "ring (ulysses_degree 1), got ulysses_degree {}",
               ds);
}

// The cp, ds and co groups: from a 2-D (co, ds) mesh, or carved out of a
// 1-D one (hybrid: a (co, ds) mesh of adjacent ranks).
std::shared_ptr<CPRuntime> make_runtime(const std::shared_ptr<nn::CoreAttention>& core,
                                        const DeviceMesh& mesh, int ds) {
  const int cp = static_cast<int>(mesh.size());
  const int co = cp / ds;
  ProcessGroupPtr cp_group, ds_group, co_group;
  if (mesh.ndim() == 2) {
    std::vector<std::string> names = mesh.dim_names();
    TANDEM_CHECK(names[0] == "co" && names[1] == "ds",
                 "[parallel::ContextParallel] expected a 2-D mesh with dims named (co, ds), got "
                 "({}, {})",
                 names[0], names[1]);
    TANDEM_CHECK(
        mesh.size(1) == ds,
        "[parallel::ContextParallel] expected the ds dim to equal ulysses_degree {}, got {}", ds,
        mesh.size(1));
    cp_group =
        mesh.flatten("cp_" + std::to_string(reinterpret_cast<uintptr_t>(core.get()))).get_group();
    ds_group = mesh.get_group("ds");
    co_group = mesh.get_group("co");
  } else {
    cp_group = mesh.get_group();
    if (ds > 1 && ds < cp) {
      DeviceMesh hybrid(cp_group, {co, ds}, {"co", "ds"}, {}, mesh.device());
      ds_group = hybrid.get_group("ds");
      co_group = hybrid.get_group("co");
    } else {
      ds_group = ds == cp ? cp_group : nullptr;
      co_group = ds == 1 ? cp_group : nullptr;
    }
  }
  auto rt = std::make_shared<CPRuntime>();
  rt->cp = cp;
  rt->ds = ds;
  rt->co = co;
  rt->cp_group = cp_group;
  rt->ds_group = ds_group;
  rt->co_group = co_group;
  return rt;
}

// The pre-hook: records this forward's layout, then moves Q/K/V to where the
// kernel reads them.
void register_layout_pre_hook(const std::shared_ptr<nn::CoreAttention>& core,
                              const ContextParallel& config, const std::shared_ptr<CPRuntime>& rt) {
  const bool ring = config.mode == CPMode::Ring;
  core->register_forward_pre_hook([=](Module&, const Args& in) -> std::optional<Args> {
    Args args = in;
    std::vector<Tensor*> qkv = qkv_slots(args, config);
    Tensor &q = *qkv[0], &k = *qkv[1], &v = *qkv[2];
    CPCallState s = set_layout(
        args, sequence_lengths(q, config.seq_dim, rt->cp_group, "a context-parallel layer"));
    if (rt->ds > 1) {
      const int64_t sd = config.seq_dim, hd = config.head_dim;
      q = cp_detail::scatter_heads(q, false, s, *rt, sd, hd);
      k = cp_detail::scatter_heads(k, true, s, *rt, sd, hd);
      v = cp_detail::scatter_heads(v, true, s, *rt, sd, hd);
    }
    if (rt->co > 1 && !ring) {
      k = cp_detail::gather_sequence(k, s, *rt, config);
      v = cp_detail::gather_sequence(v, s, *rt, config);
    }
    return args;
  });
}

// Local query pieces with global positions; keys are the whole sequence
// (all-gather) or the ds block's (Ulysses: whole too).
std::vector<SeqPiece> local_query_pieces(const CPCallState& s, const CPRuntime& rt, int cp_rank,
                                         bool load_balance, int64_t q_len) {
  std::vector<SeqPiece> pieces;
  if (rt.ds > 1) {
    pieces.push_back({cp_detail::ds_block_start(s.lengths, cp_rank, rt.ds), q_len});
  } else if (load_balance) {
    pieces = sequence_pieces(s.total, rt.cp, cp_rank, true);
  } else {
    int64_t start = 0;
    for (int r = 0; r < cp_rank; ++r)
      start += s.lengths[r];
    pieces.push_back({start, q_len});
  }
  return pieces;
}

// The kernel: positions of the local queries against the keys held. Packed
// sequences need nothing more: `options` carries the document bounds in
// global positions (Note [Packed sequences] in tensor/ops.h), and each call
// below (and each ring step) passes them with its own offsets.
void set_attention_kernel(const std::shared_ptr<nn::CoreAttention>& core,
                          const ContextParallel& config, const std::shared_ptr<CPRuntime>& rt) {
  const bool ring = config.mode == CPMode::Ring;
  const int64_t sd = config.seq_dim;
  const bool bnsd = sd == 2;
  const int cp_rank = rt->cp_group->rank();
  core->set_kernel([=](const Tensor& q, const Tensor& k, const Tensor& v,
                       const AttentionOptions& options, const Args& args) -> Tensor {
    CPCallState s = layout_of(args);
    if (ring && rt->cp > 1) {
      return cp_detail::ring_attention(q, k, v, rt->cp_group, options, s.total, config.load_balance,
                                       s.lengths, bnsd);
    }
    // The kernels read (B, H, S, D): BSHD tensors as transposed views.
    auto heads_first = [bnsd](const Tensor& t) { return bnsd ? t : transpose(t, 1, 2); };
    std::vector<SeqPiece> pieces =
        local_query_pieces(s, *rt, cp_rank, config.load_balance, q.shape()[sd]);
    std::vector<Tensor> outs;
    int64_t local = 0;
    for (const SeqPiece& p : pieces) {
      AttentionOptions o = options;
      o.q_offset = rt->co > 1 || rt->ds > 1 ? p.start : options.q_offset;
      o.k_offset = 0;
      Tensor qp = narrow(q, sd, local, p.length);
      local += p.length;
      AttentionResult r =
          scaled_dot_product_attention(heads_first(qp), heads_first(k), heads_first(v), o);
      outs.push_back(heads_first(r.out));
    }
    return contiguous(outs.size() == 1 ? outs[0] : cat(outs, sd));
  });
}

// Ulysses: the output back from head- to sequence-sharded.
void register_output_hook(const std::shared_ptr<nn::CoreAttention>& core,
                          const ContextParallel& config, const std::shared_ptr<CPRuntime>& rt) {
  const int64_t sd = config.seq_dim, hd = config.head_dim;
  const int cp_rank = rt->cp_group->rank();
  core->register_forward_hook(
      [=](Module&, const Args& args,
          const std::vector<Tensor>& outs) -> std::optional<std::vector<Tensor>> {
        CPCallState s = layout_of(args);
        std::vector<int64_t> ds_lengths = ds_block_lengths(s.lengths, cp_rank, rt->ds);
        std::vector<Tensor> o = outs;
        o[0] = all_to_all_dims(o[0], rt->ds_group, sd, hd, ds_lengths, {});
        return o;
      });
}

}  // namespace

namespace cp_detail {

Tensor scatter_heads(const Tensor& t, bool kv, const CPCallState& s, const CPRuntime& rt,
                     int64_t sd, int64_t hd) {
  const int ds = rt.ds;
  if (!kv) {
    TANDEM_CHECK(t.shape()[hd] % ds == 0,
                 "[parallel::ContextParallel] expected query heads divisible by the Ulysses "
                 "degree, got {} heads and degree {}",
                 t.shape()[hd], ds);
  }
  std::vector<int64_t> ds_lengths = ds_block_lengths(s.lengths, rt.cp_group->rank(), ds);
  return all_to_all_dims(kv ? replicate_heads(t, hd, ds) : t, rt.ds_group, hd, sd, {}, ds_lengths);
}

Tensor gather_sequence(const Tensor& t, const CPCallState& s, const CPRuntime& rt,
                       const ContextParallel& config) {
  const int64_t sd = config.seq_dim;
  Tensor gathered = all_gather_dim(t, rt.co_group, sd, block_sums(s.lengths, rt.ds));
  // Gathered in rank order; the kernel reads global order.
  return config.load_balance ? restore_sequence_order(gathered, sd, s.lengths, s.total, rt.cp)
                             : gathered;
}

}  // namespace cp_detail

void ContextParallel::apply(const std::shared_ptr<nn::CoreAttention>& core,
                            const DeviceMesh& mesh) const {
  install(core, mesh, true);
}

std::shared_ptr<CPRuntime> ContextParallel::install(const std::shared_ptr<nn::CoreAttention>& core,
                                                    const DeviceMesh& mesh,
                                                    bool collectives_in_pre_hook,
                                                    bool output_in_kernel) const {
  check_options(*this, core, mesh);
  std::shared_ptr<CPRuntime> rt = make_runtime(core, mesh, static_cast<int>(ulysses_degree));
  if (collectives_in_pre_hook) register_layout_pre_hook(core, *this, rt);
  set_attention_kernel(core, *this, rt);
  if (rt->ds > 1 && !output_in_kernel) register_output_hook(core, *this, rt);
  return rt;
}

DTensor ContextParallel::attend(const std::shared_ptr<nn::CoreAttention>& core, const DTensor& q,
                                const DTensor& k, const DTensor& v,
                                const std::string& cp_dim) const {
  TANDEM_CHECK(q.defined() && k.defined() && v.defined(),
               "[parallel::ContextParallel::attend] expected defined q, k and v DTensors");
  const int m = q.mesh().dim_index(cp_dim);
  auto sharded = [&](const DTensor& t, const char* name) {
    TANDEM_CHECK(t.mesh() == q.mesh(),
                 "[parallel::ContextParallel::attend] expected {} on q's mesh {}, got {}", name,
                 q.mesh().str(), t.mesh().str());
    if (t.placements()[m].is_shard(seq_dim)) return t;
    Placements p = t.placements();
    p[m] = Shard(seq_dim);
    return t.redistribute(p);
  };
  DTensor qs = sharded(q, "q"), ks = sharded(k, "k"), vs = sharded(v, "v");
  Tensor out = core->call(Args{qs.to_local(), ks.to_local(), vs.to_local()})[0];
  // The output has q's layout: sequence sharded on cp_dim, heads as q's.
  return DTensor::make(out, qs.mesh(), qs.placements(), qs.shape());
}

}  // namespace tandem
