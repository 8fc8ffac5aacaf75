#include "parallel/context_parallel.h"

#include <algorithm>
#include <limits>
#include <map>
#include <mutex>
#include <thread>

#include "autograd/function.h"
#include "autograd/ops.h"
#include "parallel/dtensor.h"
#include "parallel/functional.h"
#include "runtime/error.h"

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
  std::vector<int64_t> lengths = gather_lengths(local, group, d);
  Tensor gathered = all_gather_dim(local, group, d, lengths);
  if (!load_balance) return gathered;
  int64_t total = 0;
  for (int64_t l : lengths)
    total += l;
  // Rank order holds [c0, c(2cp-1)], [c1, c(2cp-2)], ...: put pieces in place.
  std::vector<Tensor> by_position(static_cast<size_t>(2 * cp));
  int64_t offset = 0;
  for (int r = 0; r < cp; ++r) {
    std::vector<SeqPiece> pieces = sequence_pieces(total, cp, r, true);
    by_position[r] = narrow(gathered, d, offset, pieces[0].length);
    by_position[2 * cp - 1 - r] = narrow(gathered, d, offset + pieces[0].length, pieces[1].length);
    offset += lengths[r];
  }
  return cat(by_position, d);
}

int64_t causal_attention_pairs(int64_t seq_len, int cp, int rank, bool load_balance) {
  int64_t pairs = 0;
  for (const SeqPiece& p : sequence_pieces(seq_len, cp, rank, load_balance)) {
    for (int64_t i = p.start; i < p.start + p.length; ++i)
      pairs += i + 1;
  }
  return pairs;
}

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

Tensor bhsd(const Tensor& t) {
  return ops::contiguous(ops::transpose(t, 1, 2));
}

// Merges (out2, lse2) into (out1, lse1): the log-sum-exp rule, -inf safe.
void merge(Tensor& out, Tensor& lse, const Tensor& out2, const Tensor& lse2) {
  Tensor m = ops::maximum(lse, lse2);
  Tensor finite = ops::lt(ops::abs(m), kInf);
  Tensor m0 = ops::where(finite, m, 0.0);
  Tensor w1 = ops::exp(ops::sub(lse, m0)), w2 = ops::exp(ops::sub(lse2, m0));
  Tensor total = ops::add(w1, w2);
  Tensor new_lse = ops::where(finite, ops::add(m0, ops::log(total)), -kInf);
  Tensor denom = ops::where(finite, total, 1.0);
  Tensor a = ops::unsqueeze(ops::div(w1, denom), -1), b = ops::unsqueeze(ops::div(w2, denom), -1);
  out = ops::add(ops::mul(out, a), ops::mul(out2, b));
  lse = new_lse;
}

// Ring attention as one Function over the local q, k, v (BSHD).
struct RingAttention final : Function {
  ProcessGroupPtr group;
  AttentionOptions options;
  int64_t seq_len = 0;  // global
  bool load_balance = false;
  std::vector<int64_t> lengths;                            // every rank's local length
  Tensor saved_q, saved_k, saved_v, saved_out, saved_lse;  // BHSD

  const char* name() const override { return "RingAttentionBackward"; }

  std::vector<SeqPiece> pieces(int rank) const {
    return sequence_pieces(seq_len, group->size(), rank, load_balance);
  }
  bool visible(const SeqPiece& q, const SeqPiece& k) const {
    return q.length > 0 && k.length > 0 && (!options.causal || k.start <= q.start + q.length - 1);
  }
  AttentionOptions piece_options(const SeqPiece& q, const SeqPiece& k) const {
    AttentionOptions o = options;
    o.q_offset = q.start;
    o.k_offset = k.start;
    return o;
  }
  // Local offsets of a rank's pieces within its block.
  static std::vector<int64_t> local_offsets(const std::vector<SeqPiece>& p) {
    std::vector<int64_t> o;
    int64_t at = 0;
    for (const SeqPiece& x : p) {
      o.push_back(at);
      at += x.length;
    }
    return o;
  }
  Tensor pad(const Tensor& t, int64_t len) const {  // BHSD along S
    if (t.shape()[2] == len) return t;
    Shape s = t.shape();
    s[2] = len - t.shape()[2];
    return ops::cat({t, ops::zeros(s, t.dtype(), t.device())}, 2);
  }
  // Launches the exchange of `tensors` with the ring neighbours.
  WorkPtr exchange(const std::vector<Tensor>& tensors) const {
    const int n = group->size(), me = group->rank();
    std::vector<P2POp> ops_list;
    for (const Tensor& t : tensors)
      ops_list.push_back(P2POp::send(t, (me + 1) % n));
    for (const Tensor& t : tensors)
      ops_list.push_back(P2POp::recv(t, (me + n - 1) % n));
    return group->batch_isend_irecv(ops_list, "ring");
  }

  std::vector<Tensor> forward(FunctionCtx&, const std::vector<Tensor>& in) override {
    const int n = group->size(), me = group->rank();
    Tensor q = bhsd(in[0]), k = bhsd(in[1]), v = bhsd(in[2]);
    const int64_t max_len = *std::max_element(lengths.begin(), lengths.end());
    std::vector<SeqPiece> qp = pieces(me);
    std::vector<int64_t> qo = local_offsets(qp);
    const Shape& qs = q.shape();
    std::vector<Tensor> out(qp.size()), lse(qp.size());
    for (size_t i = 0; i < qp.size(); ++i) {
      out[i] = ops::zeros({qs[0], qs[1], qp[i].length, qs[3]}, DType::F32, q.device());
      lse[i] = ops::full({qs[0], qs[1], qp[i].length}, -kInf, DType::F32, q.device());
    }
    Tensor cur_k = pad(k, max_len), cur_v = pad(v, max_len);
    for (int s = 0; s < n; ++s) {
      const int src = (me - s + n) % n;
      WorkPtr next = s + 1 < n ? exchange({cur_k, cur_v}) : nullptr;  // overlaps the compute
      std::vector<SeqPiece> kp = pieces(src);
      std::vector<int64_t> ko = local_offsets(kp);
      for (size_t i = 0; i < qp.size(); ++i) {
        for (size_t j = 0; j < kp.size(); ++j) {
          if (!visible(qp[i], kp[j])) continue;
          AttentionResult r = ops::scaled_dot_product_attention(
              ops::narrow(q, 2, qo[i], qp[i].length), ops::narrow(cur_k, 2, ko[j], kp[j].length),
              ops::narrow(cur_v, 2, ko[j], kp[j].length), piece_options(qp[i], kp[j]));
          merge(out[i], lse[i], ops::to(r.out, DType::F32), r.lse);
        }
      }
      if (next) {
        next->wait();
        cur_k = next->results()[0];
        cur_v = next->results()[1];
      }
    }
    Tensor o = out.size() == 1 ? out[0] : ops::cat(out, 2);
    Tensor l = lse.size() == 1 ? lse[0] : ops::cat(lse, 2);
    saved_q = q;
    saved_k = k;
    saved_v = v;
    saved_out = ops::to(o, q.dtype());
    saved_lse = l;
    return {ops::contiguous(ops::transpose(saved_out, 1, 2))};
  }

  std::vector<Tensor> backward(FunctionCtx&, const std::vector<Tensor>& g) override {
    const int n = group->size(), me = group->rank();
    Tensor dout = bhsd(g[0]);
    const int64_t max_len = *std::max_element(lengths.begin(), lengths.end());
    std::vector<SeqPiece> qp = pieces(me);
    std::vector<int64_t> qo = local_offsets(qp);
    Tensor dq = ops::zeros(saved_q.shape(), DType::F32, saved_q.device());
    Tensor cur_k = pad(saved_k, max_len), cur_v = pad(saved_v, max_len);
    Tensor dk = ops::zeros(cur_k.shape(), DType::F32, cur_k.device()),
           dv = ops::zeros(cur_v.shape(), DType::F32, cur_v.device());
    for (int s = 0; s < n; ++s) {
      const int src = (me - s + n) % n;
      std::vector<SeqPiece> kp = pieces(src);
      std::vector<int64_t> ko = local_offsets(kp);
      for (size_t i = 0; i < qp.size(); ++i) {
        for (size_t j = 0; j < kp.size(); ++j) {
          if (!visible(qp[i], kp[j])) continue;
          auto q_i = ops::narrow(saved_q, 2, qo[i], qp[i].length);
          auto k_j = ops::narrow(cur_k, 2, ko[j], kp[j].length);
          auto v_j = ops::narrow(cur_v, 2, ko[j], kp[j].length);
          std::vector<Tensor> grads = attention_backward(
              q_i, k_j, v_j, ops::narrow(saved_out, 2, qo[i], qp[i].length),
              ops::narrow(saved_lse, 2, qo[i], qp[i].length),
              ops::narrow(dout, 2, qo[i], qp[i].length), piece_options(qp[i], kp[j]));
          ops::copy_(ops::narrow(dq, 2, qo[i], qp[i].length),
                     ops::add(ops::narrow(dq, 2, qo[i], qp[i].length), grads[0]));
          Tensor dk_j = ops::narrow(dk, 2, ko[j], kp[j].length);
          Tensor dv_j = ops::narrow(dv, 2, ko[j], kp[j].length);
          ops::copy_(dk_j, ops::add(dk_j, grads[1]));
          ops::copy_(dv_j, ops::add(dv_j, grads[2]));
        }
      }
      // The block and its gradient accumulators move on together; after the
      // last step the accumulators go home (to the next rank, their owner).
      WorkPtr w = s + 1 < n ? exchange({cur_k, cur_v, dk, dv}) : exchange({dk, dv});
      w->wait();
      if (s + 1 < n) {
        cur_k = w->results()[0];
        cur_v = w->results()[1];
        dk = w->results()[2];
        dv = w->results()[3];
      } else {
        dk = w->results()[0];
        dv = w->results()[1];
      }
    }
    const int64_t mine = lengths[me];
    auto back = [&](const Tensor& t, const Tensor& like) {
      return ops::contiguous(
          ops::transpose(ops::to(ops::narrow(t, 2, 0, mine), like.dtype()), 1, 2));
    };
    saved_q = saved_k = saved_v = saved_out = saved_lse = Tensor();
    return {ops::contiguous(ops::transpose(ops::to(dq, g[0].dtype()), 1, 2)), back(dk, g[0]),
            back(dv, g[0])};
  }
};

Tensor* qkv_slot(Args& args, const ContextParallel& cp, int i) {
  if (i < static_cast<int>(cp.qkv_names.size())) {
    if (Tensor* t = args.find(cp.qkv_names[i])) return t;
  }
  if (i < static_cast<int>(cp.qkv_positions.size())) {
    if (Tensor* t = args.at(static_cast<size_t>(cp.qkv_positions[i]))) return t;
  }
  return nullptr;
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

// Replicates KV heads so that `degree` divides them (GQA with fewer KV heads
// than the Ulysses degree); the expand's backward sums the copies.
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

// Per-rank sums of `lengths` over groups of `ds` adjacent ranks.
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

}  // namespace

void ContextParallel::apply(const std::shared_ptr<nn::CoreAttention>& core,
                            const DeviceMesh& mesh) const {
  install(core, mesh, true);
}

std::shared_ptr<CPRuntime> ContextParallel::install(const std::shared_ptr<nn::CoreAttention>& core,
                                                    const DeviceMesh& mesh,
                                                    bool collectives_in_pre_hook) const {
  TANDEM_CHECK(core != nullptr, "[parallel::ContextParallel] expected a core-attention module");
  TANDEM_CHECK(
      mesh.ndim() == 1 || mesh.ndim() == 2,
      "[parallel::ContextParallel] expected a 1-D or 2-D (co, ds) mesh, got a {}-D mesh {}",
      mesh.ndim(), mesh.str());
  TANDEM_CHECK(use_local_output,
               "[parallel::ContextParallel] expected use_local_output (modules exchange local "
               "tensors; for DTensor inputs and outputs call attend()), got false");
  const int cp = static_cast<int>(mesh.size());
  const int ds = static_cast<int>(ulysses_degree);
  TANDEM_CHECK(ds >= 1 && cp % ds == 0,
               "[parallel::ContextParallel] expected the Ulysses degree to divide cp={}, got {}",
               cp, ds);
  const bool ring = mode == CPMode::Ring;
  TANDEM_CHECK(!(ring && ds > 1),
               "[parallel::ContextParallel] expected ulysses_degree 1 with ring, got {}", ds);
  TANDEM_CHECK(!(load_balance && ds > 1),
               "[parallel::ContextParallel] expected load balance only with all-gather KV or "
               "ring (ulysses_degree 1), got ulysses_degree {}",
               ds);
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
  const ContextParallel config = *this;
  const int64_t sd = seq_dim, hd = head_dim;

  auto rt = std::make_shared<CPRuntime>();
  rt->cp = cp;
  rt->ds = ds;
  rt->co = co;
  rt->cp_group = cp_group;
  rt->ds_group = ds_group;
  rt->co_group = co_group;
  auto set_state = [rt](CPCallState s) { rt->set(std::move(s)); };
  auto get_state = [rt]() { return rt->get(); };

  if (collectives_in_pre_hook) {
    core->register_forward_pre_hook([=](Module&, const Args& in) -> std::optional<Args> {
      Args args = in;
      std::vector<Tensor*> qkv = qkv_slots(args, config);
      Tensor &q = *qkv[0], &k = *qkv[1], &v = *qkv[2];
      const int64_t hq = q.shape()[hd], hkv = k.shape()[hd];
      CPCallState s;
      s.lengths = gather_lengths(q, cp_group, sd);
      for (int64_t l : s.lengths)
        s.total += l;
      set_state(s);
      if (ds > 1) {
        TANDEM_CHECK(hq % ds == 0,
                     "[parallel::ContextParallel] expected query heads divisible by the Ulysses "
                     "degree, got {} heads and degree {}",
                     hq, ds);
        std::vector<int64_t> ds_lengths(s.lengths.begin() + (cp_group->rank() / ds) * ds,
                                        s.lengths.begin() + (cp_group->rank() / ds + 1) * ds);
        q = all_to_all_dims(q, ds_group, hd, sd, {}, ds_lengths);
        k = all_to_all_dims(replicate_heads(k, hd, ds), ds_group, hd, sd, {}, ds_lengths);
        v = all_to_all_dims(replicate_heads(v, hd, ds), ds_group, hd, sd, {}, ds_lengths);
        (void)hkv;
      }
      if (co > 1) {
        std::vector<int64_t> co_lengths = block_sums(s.lengths, ds);
        if (!ring) {
          k = all_gather_dim(k, co_group, sd, co_lengths);
          v = all_gather_dim(v, co_group, sd, co_lengths);
          if (config.load_balance) {
            // Gathered in rank order; restore global order for the kernel.
            std::vector<Tensor> by_position(static_cast<size_t>(2 * cp));
            for (Tensor* t : {&k, &v}) {
              int64_t offset = 0;
              for (int r = 0; r < cp; ++r) {
                auto p = sequence_pieces(s.total, cp, r, true);
                by_position[r] = narrow(*t, sd, offset, p[0].length);
                by_position[2 * cp - 1 - r] = narrow(*t, sd, offset + p[0].length, p[1].length);
                offset += s.lengths[r];
              }
              *t = cat(by_position, sd);
            }
          }
        }
      }
      return args;
    });
  }

  // The kernel: positions of the local queries against the keys held.
  const int cp_rank = cp_group->rank();
  core->set_kernel([=](const Tensor& q, const Tensor& k, const Tensor& v,
                       const AttentionOptions& options) -> Tensor {
    CPCallState s = get_state();
    if (ring && cp > 1) {
      auto f = std::make_shared<RingAttention>();
      f->group = cp_group;
      f->options = options;
      f->seq_len = s.total;
      f->load_balance = config.load_balance;
      f->lengths = s.lengths;
      return Function::apply(f, {q, k, v})[0];
    }
    // Local query pieces with global positions; keys are the whole sequence
    // (all-gather) or the ds block's (Ulysses: whole too).
    std::vector<SeqPiece> pieces;
    if (ds > 1) {
      int64_t start = 0;
      const int block = cp_rank / ds;
      for (int r = 0; r < block * ds; ++r)
        start += s.lengths[r];
      pieces.push_back({start, q.shape()[sd]});
    } else if (config.load_balance) {
      pieces = sequence_pieces(s.total, cp, cp_rank, true);
    } else {
      int64_t start = 0;
      for (int r = 0; r < cp_rank; ++r)
        start += s.lengths[r];
      pieces.push_back({start, q.shape()[sd]});
    }
    std::vector<Tensor> outs;
    int64_t local = 0;
    for (const SeqPiece& p : pieces) {
      AttentionOptions o = options;
      o.q_offset = co > 1 || ds > 1 ? p.start : options.q_offset;
      o.k_offset = 0;
      Tensor qp = narrow(q, sd, local, p.length);
      local += p.length;
      AttentionResult r = scaled_dot_product_attention(transpose(qp, 1, 2), transpose(k, 1, 2),
                                                       transpose(v, 1, 2), o);
      outs.push_back(transpose(r.out, 1, 2));
    }
    return contiguous(outs.size() == 1 ? outs[0] : cat(outs, sd));
  });

  if (ds > 1) {
    core->register_forward_hook(
        [=](Module&, const Args&,
            const std::vector<Tensor>& outs) -> std::optional<std::vector<Tensor>> {
          CPCallState s = get_state();
          std::vector<int64_t> ds_lengths(s.lengths.begin() + (cp_rank / ds) * ds,
                                          s.lengths.begin() + (cp_rank / ds + 1) * ds);
          std::vector<Tensor> o = outs;
          o[0] = all_to_all_dims(o[0], ds_group, sd, hd, ds_lengths, {});
          return o;
        });
  }
  return rt;
}

}  // namespace tandem

namespace tandem {

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

void CPRuntime::set(CPCallState s) {
  std::lock_guard<std::mutex> lock(mu_);
  calls_[std::this_thread::get_id()] = std::move(s);
}

CPCallState CPRuntime::get() const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = calls_.find(std::this_thread::get_id());
  TANDEM_CHECK(it != calls_.end(),
               "[parallel::ContextParallel] expected the attention pre-hook to have run on this "
               "thread before the kernel, got no layout (was the core called directly?)");
  return it->second;
}

namespace {

// One collective launched by a projection's forward hook and finished by the
// attention pre-hook. `moved` is the autograd-tracked tensor it was launched
// on; the node that joins it to the received buffer is recorded at finish
// time, after every projection GEMM, so that in backward all reverse
// collectives are launched before the first projection waits for its own.
struct AsyncLaunch {
  Tensor moved;
  WorkPtr work;
  bool all_to_all = true;
  int64_t features = 0;                        // per-rank features after the all-to-all
  std::vector<int64_t> in_splits, out_splits;  // all_to_all_single splits
  std::shared_ptr<Module> projection;
};

struct AsyncSlots {
  std::mutex mu;
  std::map<std::thread::id, std::vector<std::optional<AsyncLaunch>>> forward;  // q, k, v
  std::map<std::thread::id, std::vector<int64_t>> lengths;
  std::map<std::pair<std::thread::id, Module*>, WorkPtr> backward;
};

// The received buffer of an AsyncLaunch, joined to the autograd graph. Its
// backward launches the reverse collective and returns its (pending) output;
// the projection's backward pre-hook waits for it before the GEMM reads it.
struct AsyncCollective final : Function {
  AsyncLaunch launch;
  ProcessGroupPtr group;
  std::shared_ptr<AsyncSlots> slots;
  const char* name() const override { return "AsyncCollectiveBackward"; }
  std::vector<Tensor> forward(FunctionCtx&, const std::vector<Tensor>&) override {
    launch.work->wait();
    return {launch.work->result()};
  }
  std::vector<Tensor> backward(FunctionCtx&, const std::vector<Tensor>& g) override {
    WorkPtr w;
    if (launch.all_to_all) {
      w = group->all_to_all_single(ops::contiguous(g[0]),
                                   {launch.out_splits, launch.in_splits, "async cp grad"});
    } else {
      w = group->reduce_scatter(g[0], {RedOp::Sum, 1, "async cp grad"});
    }
    {
      std::lock_guard<std::mutex> lock(slots->mu);
      slots->backward[{std::this_thread::get_id(), launch.projection.get()}] = w;
    }
    return {w->result()};  // filled asynchronously; waited before the GEMM
  }
};

// Identity whose backward waits for the projection's pending reverse
// collective: placed before ops whose backward would read the pending
// gradient early (the sums of replicated KV heads).
struct WaitPoint final : Function {
  std::shared_ptr<AsyncSlots> slots;
  Module* projection = nullptr;
  const char* name() const override { return "AsyncCollectiveWait"; }
  std::vector<Tensor> forward(FunctionCtx&, const std::vector<Tensor>& in) override {
    return {in[0]};
  }
  std::vector<Tensor> backward(FunctionCtx&, const std::vector<Tensor>& g) override {
    WorkPtr w;
    {
      std::lock_guard<std::mutex> lock(slots->mu);
      auto it = slots->backward.find({std::this_thread::get_id(), projection});
      if (it != slots->backward.end()) {
        w = it->second;
        slots->backward.erase(it);
      }
    }
    if (w) w->wait();
    return {g[0]};
  }
};

}  // namespace

void AsyncContextParallel::apply(const std::shared_ptr<nn::CoreAttention>& core,
                                 const std::shared_ptr<Module>& q_proj,
                                 const std::shared_ptr<Module>& k_proj,
                                 const std::shared_ptr<Module>& v_proj,
                                 const DeviceMesh& mesh) const {
  TANDEM_CHECK(q_proj && k_proj && v_proj,
               "[parallel::AsyncContextParallel] expected q, k and v projection modules");
  TANDEM_CHECK(head_size > 0,
               "[parallel::AsyncContextParallel] expected head_size > 0 (the projections output "
               "heads * head_size features), got {}",
               head_size);
  TANDEM_CHECK(config.mode == CPMode::Auto,
               "[parallel::AsyncContextParallel] expected mode Auto (Ulysses or all-gather KV), "
               "got mode Ring (ring attention has no async variant: apply ContextParallel with "
               "mode Ring instead)");
  TANDEM_CHECK(
      config.ulysses_degree == 1 || config.ulysses_degree == static_cast<int64_t>(mesh.size()),
      "[parallel::AsyncContextParallel] expected Ulysses (ulysses_degree == cp) or "
      "all-gather KV (ulysses_degree == 1), got ulysses_degree {} on cp={} (hybrid has no async "
      "variant)",
      config.ulysses_degree, mesh.size());
  TANDEM_CHECK(
      config.seq_dim == 1 && config.head_dim == 2,
      "[parallel::AsyncContextParallel] expected BSHD (seq_dim 1, head_dim 2), got {} and {}",
      config.seq_dim, config.head_dim);
  std::shared_ptr<CPRuntime> rt = config.install(core, mesh, false);
  auto slots = std::make_shared<AsyncSlots>();
  const bool ulysses = rt->ds > 1;
  const int64_t hs = head_size;
  const bool lb = config.load_balance;
  const int cp = rt->cp;
  ProcessGroupPtr group = rt->cp_group;

  std::vector<std::shared_ptr<Module>> projections = {q_proj, k_proj, v_proj};
  for (int i = 0; i < 3; ++i) {
    if (!ulysses && i == 0) continue;  // all-gather KV leaves Q where it is
    std::shared_ptr<Module> proj = projections[i];
    // The hook is owned by `proj` and reaches it through its argument: capturing
    // `proj` would be a cycle that leaks the module (LeakSanitizer).
    proj->register_forward_hook([=](Module& self, const Args&, const std::vector<Tensor>& outs)
                                    -> std::optional<std::vector<Tensor>> {
      const Tensor& y = outs.at(0);  // (B, S, heads * hs), already past the backward pre-hook
      TANDEM_CHECK(y.dim() == 3 && y.shape()[2] % hs == 0,
                   "[parallel::AsyncContextParallel] expected a projection output (B, S, heads * "
                   "{}), got {}",
                   hs, y.shape());
      std::vector<int64_t> lengths;
      {
        std::lock_guard<std::mutex> lock(slots->mu);
        auto it = slots->lengths.find(std::this_thread::get_id());
        if (it != slots->lengths.end()) lengths = it->second;
      }
      if (lengths.empty()) {
        lengths = gather_lengths(y, group, 1);
        std::lock_guard<std::mutex> lock(slots->mu);
        slots->lengths[std::this_thread::get_id()] = lengths;
      }
      AsyncLaunch l;
      l.projection = self.shared_from_this();
      const int me = group->rank();
      if (ulysses) {
        Tensor x = y;
        const int64_t heads = y.shape()[2] / hs;
        if (i > 0 && heads % cp != 0) {
          Shape h = {y.shape()[0], y.shape()[1], heads, hs};
          Tensor replicated = replicate_heads(reshape(y, h), 2, cp);
          // Every extent spelled out: this rank's sequence shard may be empty.
          x = reshape(replicated, Shape{y.shape()[0], y.shape()[1], replicated.shape()[2] * hs});
          // The backward of the replication reads the gradient: wait first.
          auto wait = std::make_shared<WaitPoint>();
          wait->slots = slots;
          wait->projection = &self;
          x = Function::apply(wait, {x})[0];
        }
        TANDEM_CHECK(x.shape()[2] / hs % cp == 0,
                     "[parallel::AsyncContextParallel] expected heads divisible by cp={}, got {}",
                     cp, x.shape()[2] / hs);
        // As all_to_all_dims(x, scatter=features, gather=sequence).
        const int64_t F = x.shape()[2], B = x.shape()[0];
        l.moved = reshape(contiguous(transpose(x, 0, 2)), Shape{-1});  // (F, S, B) flat
        const int64_t per_row = x.shape()[1] * B;
        l.features = F / cp;
        for (int r = 0; r < cp; ++r) {
          l.in_splits.push_back(F / cp * per_row);
          l.out_splits.push_back(F / cp * lengths[r] * B);
        }
        (void)me;
        NoGradGuard no_grad;
        l.work = group->all_to_all_single(l.moved, {l.in_splits, l.out_splits, "async cp"});
      } else {
        const int64_t block = *std::max_element(lengths.begin(), lengths.end());
        Tensor x = y;
        if (x.shape()[1] < block) {
          Shape pad = x.shape();
          pad[1] = block - x.shape()[1];
          x = cat({x, zeros(pad, x.dtype(), x.device())}, 1);
        }
        l.moved = x;
        l.all_to_all = false;
        NoGradGuard no_grad;
        l.work = group->all_gather(l.moved, {1, "async cp"});
      }
      std::lock_guard<std::mutex> lock(slots->mu);
      auto& pending = slots->forward[std::this_thread::get_id()];
      pending.resize(3);
      pending[i] = std::move(l);
      return std::nullopt;
    });
    // Wait for this projection's reverse collective right before its GEMM.
    proj->register_full_backward_pre_hook(
        [slots](Module& m, const std::vector<Tensor>&) -> std::optional<std::vector<Tensor>> {
          WorkPtr w;
          {
            std::lock_guard<std::mutex> lock(slots->mu);
            auto it = slots->backward.find({std::this_thread::get_id(), &m});
            if (it == slots->backward.end()) return std::nullopt;
            w = it->second;
            slots->backward.erase(it);
          }
          w->wait();
          return std::nullopt;
        });
  }

  const ContextParallel cfg = config;
  core->register_forward_pre_hook([=](Module&, const Args& in) -> std::optional<Args> {
    Args args = in;
    std::vector<Tensor*> qkv = qkv_slots(args, cfg);
    std::vector<std::optional<AsyncLaunch>> pending;
    std::vector<int64_t> lengths;
    {
      std::lock_guard<std::mutex> lock(slots->mu);
      auto tid = std::this_thread::get_id();
      TANDEM_CHECK(slots->lengths.count(tid) == 1,
                   "[parallel::AsyncContextParallel] expected the q/k/v projections to run before "
                   "the attention on this thread, got no launched collectives");
      pending = std::move(slots->forward[tid]);
      lengths = slots->lengths[tid];
      slots->forward.erase(tid);
      slots->lengths.erase(tid);
    }
    CPCallState s;
    s.lengths = lengths;
    for (int64_t l : lengths)
      s.total += l;
    rt->set(s);
    pending.resize(3);
    for (int i = 0; i < 3; ++i) {
      if (!pending[i]) continue;
      AsyncLaunch& l = *pending[i];
      auto fn = std::make_shared<AsyncCollective>();
      fn->launch = l;
      fn->group = group;
      fn->slots = slots;
      Tensor raw = Function::apply(fn, {l.moved})[0];
      const Tensor& orig = *qkv[i];
      const int64_t B = orig.shape()[0];
      Tensor result;
      if (l.all_to_all) {
        // Pieces (F/cp, len_r, B) from each rank, joined along the sequence.
        const int64_t f = l.features;
        std::vector<Tensor> parts;
        int64_t offset = 0;
        for (int r = 0; r < cp; ++r) {
          parts.push_back(
              reshape(narrow(raw, 0, offset, l.out_splits[r]), Shape{f, lengths[r], B}));
          offset += l.out_splits[r];
        }
        Tensor joined = contiguous(transpose(cat(parts, 1), 0, 2));  // (B, S, F/cp)
        result = reshape(joined, Shape{B, s.total, joined.shape()[2] / hs, hs});
      } else {
        const int64_t block = *std::max_element(lengths.begin(), lengths.end());
        std::vector<Tensor> parts;
        for (int r = 0; r < cp; ++r)
          parts.push_back(narrow(raw, 1, r * block, lengths[r]));
        Tensor joined = cat(parts, 1);
        if (lb) {
          std::vector<Tensor> by_position(static_cast<size_t>(2 * cp));
          int64_t offset = 0;
          for (int r = 0; r < cp; ++r) {
            auto p = sequence_pieces(s.total, cp, r, true);
            by_position[r] = narrow(joined, 1, offset, p[0].length);
            by_position[2 * cp - 1 - r] = narrow(joined, 1, offset + p[0].length, p[1].length);
            offset += lengths[r];
          }
          joined = cat(by_position, 1);
        }
        result = reshape(joined, Shape{B, s.total, joined.shape()[2] / hs, hs});
      }
      *qkv[i] = result;
    }
    return args;
  });
}

}  // namespace tandem
