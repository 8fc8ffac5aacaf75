// AsyncContextParallel (DESIGN §7): Ulysses, all-gather KV and hybrid with
// the collectives moved out of the attention pre-hook (ring attention is
// asynchronous by construction: its layer is ContextParallel's). Each q/k/v projection's
// forward hook starts its collective as an Exchange (Note [Exchange windows])
// as soon as the projection has produced its output; the attention pre-hook
// records the exchange's Launch and Wait and puts what arrived in place of
// q/k/v. In backward every reverse collective is issued as soon as its
// gradient exists (all three before any is waited on) and waited by the
// exchange's Open, just before the projection's GEMM. The kernel and the
// layout are ContextParallel's (context_parallel.cpp, installed without its
// pre-hook collectives). Per-call state: Note [CP per-call state].
#include <algorithm>
#include <atomic>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

#include "tandem/autograd/function.h"
#include "tandem/autograd/ops.h"
#include "tandem/parallel/collectives.h"
#include "tandem/parallel/context_parallel.h"
#include "tandem/parallel/cp_internal.h"
#include "tandem/parallel/dtensor.h"
#include "tandem/runtime/error.h"
#include "tandem/runtime/logging.h"

namespace tandem {

namespace {

using cp_detail::qkv_slots;
using cp_detail::replicate_heads;
using cp_detail::restore_sequence_order;

// A tensor view's identity: its storage and where it starts.
using ViewKey = std::pair<const void*, int64_t>;
ViewKey key_of(const Tensor& t) {
  return {t.storage().get(), t.storage_offset()};
}

// Between a projection's forward hook and the attention pre-hook of the same
// forward (Note [CP per-call state]).
struct Handoff {
  struct Started {
    Tensor output;  // the projection output the exchange was started on
    std::shared_ptr<Exchange> exchange;
    std::vector<int64_t> lengths;  // every rank's local sequence length
    int slot = 0;                  // 0, 1, 2: q, k, v
    std::thread::id thread;        // the forward's thread
  };
  struct Lengths {
    Tensor input;  // keeps the key's storage alive while the entry exists
    std::vector<int64_t> lengths;
    int uses_left = 0;
    std::thread::id thread;  // the forward's thread
  };
  std::mutex mu;
  std::map<const void*, Started> started;  // by the output's storage
  std::map<ViewKey, Lengths> lengths;      // by the projections' common input
  std::atomic<bool> said_fallback{false};  // the fallback's debug line, once per layer
};

// What the hooks of one async layer share; each hook keeps a copy.
struct AsyncLayer {
  std::shared_ptr<Handoff> handoff;
  std::shared_ptr<CPRuntime> rt;  // the groups, for the synchronous fallback
  ProcessGroupPtr group;          // the CP group
  int cp = 1;
  int ds = 1;      // the Ulysses degree: cp (Ulysses), 1 (all-gather KV) or between (hybrid)
  int64_t hs = 0;  // head size
  bool load_balance = false;
  // AsyncContextParallel::prepare (Note [Rotary before the exchange]).
  std::function<Tensor(int, const Tensor&)> prepare;
  // The first hooked slot (0, 1, 2: q, k, v): all-gather KV leaves q alone.
  int first_slot() const { return ds > 1 ? 0 : 1; }
  int projections() const { return 3 - first_slot(); }
};

// The layout checks are ContextParallel's (install and apply).
void check_options(const AsyncContextParallel& async) {
  TANDEM_CHECK(async.head_size > 0,
               "[parallel::AsyncContextParallel] expected head_size > 0 (the projections output "
               "heads * head_size features), got {}",
               async.head_size);
}

// Every rank's local sequence length in this forward: gathered by the first
// hooked projection that sees input `x`, kept for the others.
std::vector<int64_t> forward_lengths(const AsyncLayer& layer, const Tensor& x, const Tensor& y) {
  Handoff& h = *layer.handoff;
  const ViewKey key = key_of(x);
  {
    std::lock_guard<std::mutex> lock(h.mu);
    auto it = h.lengths.find(key);
    if (it != h.lengths.end()) {
      std::vector<int64_t> lengths = it->second.lengths;
      if (--it->second.uses_left == 0) h.lengths.erase(it);
      return lengths;
    }
  }
  std::vector<int64_t> lengths =
      sequence_lengths(y, 1, layer.group, "an async context-parallel layer");
  if (layer.projections() > 1) {
    std::lock_guard<std::mutex> lock(h.mu);
    h.lengths[key] = {x, lengths, layer.projections() - 1, std::this_thread::get_id()};
  }
  return lengths;
}

// The heads a KV projection output sends under a Ulysses degree `ds`: its
// own, or ds copies where ds does not divide them (each head repeated
// ds / heads times, in place; replicate_heads checks the counts).
int64_t sent_kv_heads(int64_t heads, int ds) {
  if (heads % ds == 0) return heads;
  NoGradGuard no_grad;
  replicate_heads(ops::zeros(Shape{1, 1, heads, 1}), 2, ds);
  return ds;
}

// Ulysses over `group` (the CP group, or hybrid's ds group for q):
// projection `i`'s output (B, S, heads * hs) from sequence- to head-sharded;
// `lengths`: the tokens of every rank of `group`. KV heads are replicated
// inside the launcher where the degree does not divide them, and their
// gradients summed back in the reverse one's finish.
Exchange ulysses_exchange(const Shape& y, int i, const AsyncLayer& layer,
                          const ProcessGroupPtr& group, const std::vector<int64_t>& lengths) {
  const int degree = group->size();
  const int64_t B = y[0], S = y[1], hs = layer.hs, heads = y[2] / hs;
  const int64_t sent_heads = i > 0 ? sent_kv_heads(heads, degree) : heads;
  const bool replicate = sent_heads != heads;
  TANDEM_CHECK(sent_heads % degree == 0,
               "[parallel::AsyncContextParallel] expected heads divisible by the Ulysses degree "
               "{}, got {}",
               degree, sent_heads);
  const Shape split{B, S, heads, hs};
  Exchange ex;
  ex.what = "the async Ulysses all-to-all";
  ex.forward = [=](const Tensor& t) {
    Tensor x = t;
    if (replicate) {
      NoGradGuard no_grad;
      x = ops::reshape(replicate_heads(ops::reshape(t, split), 2, degree),
                       Shape{B, S, sent_heads * hs});
    }
    return launch_all_to_all(x, group, 2, 1, {}, lengths, "async cp");
  };
  ex.backward = [=](const Tensor& g) {
    PendingTensor p = launch_all_to_all(g, group, 1, 2, lengths, {}, "async cp grad");
    if (replicate) {
      p.finish = [=, finish = p.finish](const Tensor& raw) {
        NoGradGuard no_grad;
        Tensor d = ops::reshape(finish(raw), Shape{B, S, heads, degree / heads, hs});
        return ops::reshape(sum_to(d, Shape{B, S, heads, 1, hs}), Shape{B, S, heads * hs});
      };
    }
    return p;
  };
  return ex;
}

// Note [Async hybrid in one collective]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Hybrid K/V is two collectives in ContextParallel: an all-to-all over the ds
// group (sequence- to head-sharded within a block of ds adjacent ranks), then
// an all-gather over the co group (the other blocks' tokens). The second can
// only start once the first has arrived, so as a pair they could not both be
// started in the projection's hook. Their result is one all-to-all over the
// whole CP group instead: rank j = c * ds + d needs head shard d of every
// rank's tokens, so each rank sends head shard (j mod ds) of its tokens to
// rank j — its heads tiled co times, cut into cp pieces. Every rank receives
// as many bytes as the pair delivers, in one collective that starts as soon
// as the projection has run. Its gradient is the reverse all-to-all, then the
// sum of the co tiles (and of replicated KV heads). The tokens arrive in rank
// order, which is sequence order (hybrid has no load balance).
Exchange hybrid_kv_exchange(const Shape& y, const AsyncLayer& layer,
                            const std::vector<int64_t>& lengths) {
  const int ds = layer.ds, co = layer.cp / layer.ds;
  const int64_t B = y[0], S = y[1], hs = layer.hs, heads = y[2] / hs;
  const int64_t sent = sent_kv_heads(heads, ds);  // heads after replication
  const bool replicate = sent != heads;
  TANDEM_CHECK(sent % ds == 0,
               "[parallel::AsyncContextParallel] expected KV heads divisible by the Ulysses "
               "degree {}, got {}",
               ds, sent);
  ProcessGroupPtr group = layer.group;
  Exchange ex;
  ex.what = "the async hybrid K/V all-to-all";
  ex.forward = [=](const Tensor& t) {
    NoGradGuard no_grad;
    Tensor x = ops::reshape(t, Shape{B, S, heads, hs});
    if (replicate) x = replicate_heads(x, 2, ds);
    x = ops::expand(ops::unsqueeze(x, 2), Shape{B, S, co, sent, hs});  // tiled co times
    return launch_all_to_all(ops::reshape(x, Shape{B, S, co * sent * hs}), group, 2, 1, {}, lengths,
                             "async cp");
  };
  ex.backward = [=](const Tensor& g) {
    PendingTensor p = launch_all_to_all(g, group, 1, 2, lengths, {}, "async cp grad");
    p.finish = [=, finish = p.finish](const Tensor& raw) {
      NoGradGuard no_grad;
      Tensor d = ops::reshape(finish(raw), Shape{B, S, co, sent, hs});
      d = sum_to(d, Shape{B, S, 1, sent, hs});  // the tiles
      if (replicate) {
        d = sum_to(ops::reshape(d, Shape{B, S, heads, ds / heads, hs}), Shape{B, S, heads, 1, hs});
      }
      return ops::reshape(d, Shape{B, S, heads * hs});
    };
    return p;
  };
  return ex;
}

// All-gather KV: every rank's tokens along the sequence; the gradient
// reduce-scattered back.
Exchange gather_exchange(const AsyncLayer& layer, const std::vector<int64_t>& lengths) {
  ProcessGroupPtr group = layer.group;
  Exchange ex;
  ex.what = "the async K/V all-gather";
  ex.forward = [=](const Tensor& t) { return launch_all_gather(t, group, 1, lengths, "async cp"); };
  ex.backward = [=](const Tensor& g) {
    return launch_reduce_scatter(g, group, 1, lengths, RedOp::Sum, "async cp grad");
  };
  return ex;
}

// The exchange of projection `i` (0, 1, 2: q, k, v); `lengths`: the tokens of
// every CP rank.
Exchange make_exchange(const Shape& y, int i, const AsyncLayer& layer,
                       const std::vector<int64_t>& lengths) {
  if (layer.ds == 1) return gather_exchange(layer, lengths);
  if (layer.ds == layer.cp) return ulysses_exchange(y, i, layer, layer.group, lengths);
  if (i > 0) return hybrid_kv_exchange(y, layer, lengths);
  return ulysses_exchange(y, i, layer, layer.rt->ds_group,
                          cp_detail::ds_block_lengths(lengths, layer.group->rank(), layer.ds));
}

// Projection `i`'s forward hook: opens and starts its exchange, and leaves it
// for the attention pre-hook under the storage of the output it returns.
void register_launch_hook(const std::shared_ptr<Module>& proj, int i, const AsyncLayer& layer) {
  // The hook is owned by `proj`: capturing `proj` would be a cycle that leaks
  // the module (LeakSanitizer).
  proj->register_forward_hook(
      [=](Module&, const Args& in,
          const std::vector<Tensor>& outs) -> std::optional<std::vector<Tensor>> {
        std::vector<Tensor> out = outs;
        // (B, S, heads * hs), already past the backward pre-hook; prepared
        // for the attention where the layer moved that here (Note [Rotary
        // before the exchange]).
        if (layer.prepare) out[0] = layer.prepare(i, outs.at(0));
        const Tensor y = out[0];
        // Anything else is left alone; the attention pre-hook then finds no
        // exchange for it and falls back (Note [Async CP fallback]).
        if (y.dim() != 3 || y.shape()[2] % layer.hs != 0) {
          if (layer.prepare) return out;
          return std::nullopt;
        }
        const Tensor& x = in.positional.empty() ? outs.at(0) : in.positional[0];
        std::vector<int64_t> lengths = forward_lengths(layer, x, y);
        auto ex = std::make_shared<Exchange>(make_exchange(y.shape(), i, layer, lengths));
        out[0] = exchange_open(ex, y);
        exchange_start(ex, out[0]);
        std::lock_guard<std::mutex> lock(layer.handoff->mu);
        layer.handoff->started[out[0].storage().get()] = {out[0], ex, lengths, i,
                                                          std::this_thread::get_id()};
        return out;
      });
}

// Note [Async CP fallback]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// The async path needs each of q/k/v to reach the attention as a view of the
// output its projection's hook started a collective on. Where that does not
// hold, the layer falls back to the synchronous collectives of ContextParallel
// (the reference design does the same), with one debug line per layer:
//   - at apply(): a projection is missing, or one module stands for two of
//     q/k/v (a fused QKV projection) — the whole layer is ContextParallel's;
//   - per forward and tensor: something is computed between the projection
//     and the attention (a rotary embedding, a norm: nn::SelfAttention
//     moves its own into the hook, Note [Rotary before the exchange]), or
//     the projection's output is not (B, S, heads * head_size). That tensor's collective runs
//     in the attention pre-hook as in ContextParallel; the others stay async.
//     A collective the projection hook started on an output that never
//     reached the attention is waited and dropped there (every rank started
//     it, so every rank must finish it); no Launch was recorded for it, so its
//     Open passes the gradient through in backward.
// The orphans are found by thread: between a projection's hook and the
// attention pre-hook of one forward, no other forward of this layer runs on
// the same thread.

// The attention pre-hook: finds the exchanges the projections started,
// records their Launch and Wait (after every projection, so that backward
// issues all reverse collectives before the first Open waits), records the
// layout for the kernel and puts what arrived in place of q/k/v; a tensor
// without an exchange gets the synchronous collective (Note [Async CP
// fallback]).
void register_join_pre_hook(const std::shared_ptr<nn::CoreAttention>& core,
                            const ContextParallel& cfg, const AsyncLayer& layer) {
  core->register_forward_pre_hook([=](Module&, const Args& in) -> std::optional<Args> {
    Args args = in;
    std::vector<Tensor*> qkv = qkv_slots(args, cfg);
    static const char* names[] = {"q", "k", "v"};
    const int first = layer.first_slot();
    std::vector<std::optional<Handoff::Started>> started(3);
    std::vector<Handoff::Started> orphans;
    {
      std::lock_guard<std::mutex> lock(layer.handoff->mu);
      auto& open = layer.handoff->started;
      for (int i = first; i < 3; ++i) {
        auto it = open.find(qkv[i]->storage().get());
        if (it == open.end()) continue;
        started[i] = std::move(it->second);
        open.erase(it);
      }
      for (auto it = open.begin(); it != open.end();) {
        if (it->second.thread != std::this_thread::get_id()) {
          ++it;
          continue;
        }
        orphans.push_back(std::move(it->second));
        it = open.erase(it);
      }
      // Lengths a projection left for one that was not hooked (or skipped).
      std::erase_if(layer.handoff->lengths,
                    [](const auto& e) { return e.second.thread == std::this_thread::get_id(); });
    }
    // Every rank finishes its orphans in the same (slot) order.
    std::sort(orphans.begin(), orphans.end(),
              [](const Handoff::Started& a, const Handoff::Started& b) { return a.slot < b.slot; });
    for (const Handoff::Started& e : orphans)
      exchange_drop(e.exchange);

    std::vector<int64_t> lengths;
    for (int i = first; i < 3 && lengths.empty(); ++i) {
      if (started[i]) lengths = started[i]->lengths;
    }
    if (lengths.empty() && !orphans.empty()) lengths = orphans.front().lengths;
    if (lengths.empty()) {
      lengths = sequence_lengths(*qkv[first], cfg.seq_dim, layer.group,
                                 "an async context-parallel layer");
    }
    cp_detail::CPCallState s = cp_detail::set_layout(args, lengths);

    std::string fallback;
    for (int i = first; i < 3; ++i) {
      if (!started[i]) {
        fallback += fallback.empty() ? names[i] : fmt::format(", {}", names[i]);
        Tensor& t = *qkv[i];
        if (layer.ds > 1) {
          t = cp_detail::scatter_heads(t, i > 0, s, *layer.rt, cfg.seq_dim, cfg.head_dim);
        }
        if (layer.ds < layer.cp && i > 0) t = cp_detail::gather_sequence(t, s, *layer.rt, cfg);
        continue;
      }
      const Handoff::Started& e = *started[i];
      Tensor joined = exchange_wait(e.exchange, exchange_launch(e.exchange, e.output));
      if (layer.ds == 1 && layer.load_balance)
        joined = restore_sequence_order(joined, 1, s.lengths, s.total, layer.cp);
      const int64_t B = e.output.shape()[0];  // hybrid's q: the tokens of its ds block
      *qkv[i] =
          reshape(joined, Shape{B, joined.shape()[1], joined.shape()[2] / layer.hs, layer.hs});
      if (cfg.seq_dim == 2) *qkv[i] = transpose(*qkv[i], 1, 2);  // BNSD
    }
    if (!fallback.empty() && !layer.handoff->said_fallback.exchange(true)) {
      log_debug(
          "[parallel] an async context-parallel layer runs the collectives of {} synchronously: "
          "not a view of the output its projection's hook started a collective on (something "
          "is computed in between, or the projection's output is not (B, S, heads * {}))"
          "{}",
          fallback, layer.hs,
          orphans.empty() ? ""
                          : "; the collectives started on those projection outputs are waited "
                            "and dropped");
    }
    return args;
  });
}

// Note [Ulysses output in chunks]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// After the attention, Ulysses (and hybrid, over its ds group) sends the
// output back from head- to sequence-sharded, and the o projection needs all
// of it: issued after the kernel, that all-to-all is exposed in full, in
// forward and (its reverse, on the output's gradient) in backward. The async layer's kernel
// therefore attends in kOutputChunks chunks of this rank's heads (q heads and their KV heads; one
// chunk when either count does not divide) and starts each chunk's all-to-all as an Exchange as
// soon as the chunk's output exists, so it travels while the next chunk computes. The Launches and
// Waits are recorded after every chunk's Open: in backward all the reverse all-to-alls start before
// the first Open waits, and the first chunk's gradient travels while the last chunk's attention
// backward runs. Each chunk arrives with every rank's heads of that chunk, rank-major; one copy
// interleaves them into the heads' order. Attention is per head and the rest moves data, so the
// bits are the synchronous layer's.
constexpr int64_t kOutputChunks = 2;

// The kernel of Ulysses and hybrid (ds > 1).
Tensor chunked_ulysses_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                 const AttentionOptions& options, const Args& args,
                                 const ContextParallel& cfg, const CPRuntime& rt) {
  const int64_t sd = cfg.seq_dim, hd = cfg.head_dim;
  const bool bnsd = sd == 2;
  const ProcessGroupPtr group = rt.ds_group;
  const std::vector<int64_t> all = cp_detail::layout_of(args).lengths;
  const int cp_rank = rt.cp_group->rank();
  const std::vector<int64_t> lengths = cp_detail::ds_block_lengths(all, cp_rank, rt.ds);

  auto heads_first = [bnsd](const Tensor& t) { return bnsd ? t : transpose(t, 1, 2); };
  const int64_t hq = q.shape()[hd], hkv = k.shape()[hd];
  const int64_t chunks = hq % kOutputChunks == 0 && hkv % kOutputChunks == 0 ? kOutputChunks : 1;
  AttentionOptions o = options;
  // The queries are the whole sequence of this rank's ds block (hybrid: one
  // block of several; Ulysses: the only one), the keys the whole sequence.
  o.q_offset = cp_detail::ds_block_start(all, cp_rank, rt.ds);
  o.k_offset = 0;
  std::vector<std::shared_ptr<Exchange>> exchanges;
  std::vector<Tensor> pieces;
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t hc = hq / chunks, kc = hkv / chunks;
    AttentionResult r = scaled_dot_product_attention(heads_first(narrow(q, hd, c * hc, hc)),
                                                     heads_first(narrow(k, hd, c * kc, kc)),
                                                     heads_first(narrow(v, hd, c * kc, kc)), o);
    auto ex = std::make_shared<Exchange>();
    ex->what = "the async Ulysses output all-to-all";
    ex->forward = [=](const Tensor& t) {
      return launch_all_to_all(t, group, sd, hd, lengths, {}, "async cp out");
    };
    ex->backward = [=](const Tensor& g) {
      return launch_all_to_all(g, group, hd, sd, {}, lengths, "async cp out grad");
    };
    Tensor opened = exchange_open(ex, heads_first(r.out));
    exchange_start(ex, opened);
    exchanges.push_back(ex);
    pieces.push_back(opened);
  }
  for (int64_t c = 0; c < chunks; ++c)
    pieces[c] = exchange_launch(exchanges[c], pieces[c]);
  for (int64_t c = 0; c < chunks; ++c)
    pieces[c] = exchange_wait(exchanges[c], pieces[c]);
  if (chunks == 1) return pieces[0];
  // pieces[c]: heads [rank 0's chunk c, rank 1's chunk c, ...] along hd.
  const int64_t ranks = group->size();
  std::vector<int64_t> merged = pieces[0].shape().vec(), split = merged;
  merged[hd] *= chunks;
  split[hd] /= ranks;
  split.insert(split.begin() + hd, {ranks, 1});
  for (Tensor& p : pieces)
    p = reshape(p, Shape(split));
  // (.., ranks, chunks, heads of a chunk, ..): each rank's heads in order.
  return reshape(cat(pieces, hd + 1), Shape(merged));
}

}  // namespace

// Note [Rotary before the exchange]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A Llama-family attention layer computes on q and k between the projection
// and the attention: the QK-norm and the rotary embedding. The async path
// starts each collective on the projection's output, and the gradient
// arriving in backward is in flight until the exchange's Open (Note
// [Exchange windows]): only views may sit between Open and the attention.
// So for a SelfAttention the projection hook applies the layer's
// head_preparation() itself, before it opens the exchange, and the layer's
// forward skips it for the slots the hooks prepare (set_prepared_by_hooks).
// The computation is the same, per token and head at the token's global
// position (PositionScope: the hook runs inside the same call), so the
// results equal the synchronous layer's. In backward the Open waits for the
// reverse collective before the rotary's and the norm's backward read the
// gradient; in forward those run before the collective is issued. Under
// all-gather KV q is not exchanged and stays prepared in forward.
void apply_context_parallel(nn::SelfAttention& attn, const ContextParallel& config,
                            const DeviceMesh& mesh, bool async) {
  if (!async) {
    config.apply(attn.core(), mesh);
    return;
  }
  AsyncContextParallel a{.config = config, .head_size = attn.head_dim()};
  std::function<Tensor(const Tensor&)> q = attn.head_preparation(0), k = attn.head_preparation(1);
  if (q || k) {
    a.prepare = [q, k](int slot, const Tensor& y) {
      const auto& f = slot == 0 ? q : slot == 1 ? k : nullptr;
      return f ? f(y) : y;
    };
  }
  for (int slot : a.apply(attn.core(), attn.q_proj(), attn.k_proj(), attn.v_proj(), mesh)) {
    if (a.prepare && slot < 2) attn.set_prepared_by_hooks(slot);
  }
}

std::vector<int> AsyncContextParallel::apply(const std::shared_ptr<nn::CoreAttention>& core,
                                             const std::shared_ptr<Module>& q_proj,
                                             const std::shared_ptr<Module>& k_proj,
                                             const std::shared_ptr<Module>& v_proj,
                                             const DeviceMesh& mesh) const {
  check_options(*this);
  if (config.mode == CPMode::Ring) {
    // Ring attention keeps the next K/V block and the dK/dV accumulators in
    // flight while each block computes, in both directions (Note [Ring
    // backward in flight]): its own layer is the asynchronous one.
    config.apply(core, mesh);
    return {};
  }
  const bool ulysses = config.ulysses_degree > 1;
  std::vector<std::shared_ptr<Module>> projections = {q_proj, k_proj, v_proj};
  // Note [Async CP fallback]: the projections the async path hooks.
  std::string why;
  for (int i = ulysses ? 0 : 1; i < 3 && why.empty(); ++i) {
    static const char* names[] = {"q", "k", "v"};
    if (!projections[i]) why = fmt::format("no {} projection was given", names[i]);
    for (int j = ulysses ? 0 : 1; j < i && why.empty(); ++j) {
      if (projections[i] == projections[j]) {
        why = fmt::format("{} and {} come from one projection (fused QKV)", names[j], names[i]);
      }
    }
  }
  if (!why.empty()) {
    log_debug(
        "[parallel] AsyncContextParallel falls back to ContextParallel's synchronous "
        "collectives: {}",
        why);
    config.apply(core, mesh);
    return {};
  }
  std::shared_ptr<CPRuntime> rt = config.install(core, mesh, false, ulysses);
  if (ulysses) {  // Note [Ulysses output in chunks]
    const ContextParallel cfg = config;
    core->set_kernel([cfg, rt](const Tensor& q, const Tensor& k, const Tensor& v,
                               const AttentionOptions& options, const Args& args) {
      return chunked_ulysses_attention(q, k, v, options, args, cfg, *rt);
    });
  }
  AsyncLayer layer;
  layer.handoff = std::make_shared<Handoff>();
  layer.rt = rt;
  layer.group = rt->cp_group;
  layer.cp = rt->cp;
  layer.ds = rt->ds;
  layer.hs = head_size;
  layer.load_balance = config.load_balance;
  layer.prepare = prepare;
  std::vector<int> hooked;
  for (int i = layer.first_slot(); i < 3; ++i) {
    register_launch_hook(projections[i], i, layer);
    hooked.push_back(i);
  }
  register_join_pre_hook(core, config, layer);
  return hooked;
}

}  // namespace tandem
