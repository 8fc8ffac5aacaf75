// Ring attention (DESIGN §7, mode = Ring): K/V blocks circulate between ring
// neighbours by send/recv while each rank attends to the block it holds; the
// partial results merge by log-sum-exp, the next block's transfer overlaps
// the current block's compute, and in backward dK/dV circulate with their
// blocks and go home at the end (Note [Ring backward in flight]). The kernel that ContextParallel
// installs (context_parallel.cpp) calls ring_attention() (cp_internal.h).
#include <algorithm>
#include <limits>

#include "tandem/autograd/function.h"
#include "tandem/autograd/ops.h"
#include "tandem/parallel/collectives.h"
#include "tandem/parallel/context_parallel.h"
#include "tandem/parallel/cp_internal.h"
#include "tandem/runtime/error.h"

namespace tandem::cp_detail {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// Note [Ring layouts]
// ~~~~~~~~~~~~~~~~~~~
// The attention kernels take any strides with a unit last dim, so the ring
// never copies a tensor into another layout: q, k, v, the output, dout and
// the gradients stay in the layer's layout (BSHD or BNSD), contiguous where
// they travel (the K/V blocks, the dK/dV accumulators) and the output as it
// is returned, and the kernels see them through heads_major() views. The
// saved q/k/v are views of the inputs and the saved output one of the output
// the layer returns (which the o projection keeps for its own backward), so
// no activation is held twice.

// A tensor of the layer's layout as (B, H, S, D): a view.
Tensor heads_major(const Tensor& t, bool bnsd) {
  return bnsd ? t : ops::transpose(t, 1, 2);
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
  bool bnsd = false;             // q, k, v and the output are (B, H, S, D), else (B, S, H, D)
  std::vector<int64_t> lengths;  // every rank's local length
  // q, k, v and the output in the layer's layout (Note [Ring layouts]);
  // the log-sum-exp (B, H, S).
  Tensor saved_q, saved_k, saved_v, saved_out, saved_lse;

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
  int64_t seq_dim() const { return bnsd ? 2 : 1; }  // in the layer's layout
  // `t` (the layer's layout) padded with zeros along S to `len`, contiguous
  // (the blocks travel as they are).
  Tensor pad(const Tensor& t, int64_t len) const {
    if (t.shape()[seq_dim()] == len) return ops::contiguous(t);
    Shape s = t.shape();
    s[seq_dim()] = len - t.shape()[seq_dim()];
    return ops::cat({t, ops::zeros(s, t.dtype(), t.device())}, seq_dim());
  }
  // A zero tensor shaped like `t` (the layer's layout), f32.
  static Tensor zeros_f32(const Tensor& t) { return ops::zeros(t.shape(), DType::F32, t.device()); }
  // Launches the exchange of `tensors` with the ring neighbours: sent to the
  // next rank, received from the previous one.
  WorkPtr exchange(const std::vector<Tensor>& tensors, const char* tag) const {
    const int n = group->size(), me = group->rank();
    std::vector<P2POp> ops_list;
    for (const Tensor& t : tensors)
      ops_list.push_back(P2POp::send(t, (me + 1) % n));
    for (const Tensor& t : tensors)
      ops_list.push_back(P2POp::recv(t, (me + n - 1) % n));
    return group->batch_isend_irecv(ops_list, tag);
  }

  std::vector<Tensor> forward(FunctionCtx&, const std::vector<Tensor>& in) override {
    const int n = group->size(), me = group->rank();
    const Tensor q = heads_major(in[0], bnsd);  // Note [Ring layouts]
    const int64_t max_len = *std::max_element(lengths.begin(), lengths.end());
    std::vector<SeqPiece> qp = pieces(me);
    std::vector<int64_t> qo = local_offsets(qp);
    const Shape& qs = q.shape();
    std::vector<Tensor> out(qp.size()), lse(qp.size());
    for (size_t i = 0; i < qp.size(); ++i) {
      out[i] = ops::zeros({qs[0], qs[1], qp[i].length, qs[3]}, DType::F32, q.device());
      lse[i] = ops::full({qs[0], qs[1], qp[i].length}, -kInf, DType::F32, q.device());
    }
    Tensor cur_k = pad(in[1], max_len), cur_v = pad(in[2], max_len);
    for (int s = 0; s < n; ++s) {
      const int src = (me - s + n) % n;
      WorkPtr next =
          s + 1 < n ? exchange({cur_k, cur_v}, "ring kv") : nullptr;  // overlaps the compute
      std::vector<SeqPiece> kp = pieces(src);
      std::vector<int64_t> ko = local_offsets(kp);
      const Tensor k = heads_major(cur_k, bnsd), v = heads_major(cur_v, bnsd);
      for (size_t i = 0; i < qp.size(); ++i) {
        for (size_t j = 0; j < kp.size(); ++j) {
          if (!visible(qp[i], kp[j])) continue;
          AttentionResult r = ops::scaled_dot_product_attention(
              ops::narrow(q, 2, qo[i], qp[i].length), ops::narrow(k, 2, ko[j], kp[j].length),
              ops::narrow(v, 2, ko[j], kp[j].length), piece_options(qp[i], kp[j]));
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
    out.clear();
    // The output in the layer's layout, contiguous; the kernels read it
    // back through a view (Note [Ring layouts]).
    Tensor result = ops::contiguous(heads_major(ops::to(o, q.dtype()), bnsd));
    o = Tensor();
    // Detached: the same storage without the autograd history (a member
    // holding the output itself would tie the node to itself).
    saved_q = detach(in[0]);
    saved_k = detach(in[1]);
    saved_v = detach(in[2]);
    saved_out = detach(result);
    saved_lse = lse.size() == 1 ? lse[0] : ops::cat(lse, 2);
    return {result};
  }

  // Note [Ring backward in flight]
  // ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
  // Each step of the backward holds one K/V block and the dK/dV accumulators
  // of that block, which travel with it. Two transfers are in flight while a
  // step computes its block's gradients: the K/V block of the next step
  // (launched before the compute, as in forward) and the accumulators of the
  // block this step holds, sent by the previous rank at the end of its step.
  // The step waits for the accumulators only once its own gradients exist,
  // then adds them in the order a step with the accumulators at hand would
  // (accumulator + each pair's gradient, pairs in order), so the bits do not
  // depend on when the transfer arrived; the sum then leaves for the next
  // rank and travels during the next step's compute. After the last step the
  // accumulators go home (to the next rank, their owner).
  std::vector<Tensor> backward(FunctionCtx&, const std::vector<Tensor>& g) override {
    const int n = group->size(), me = group->rank();
    // Views in the kernels' (B, H, S, D) order of tensors in the layer's
    // layout (Note [Ring layouts]).
    const Tensor dout = heads_major(g[0], bnsd), q = heads_major(saved_q, bnsd),
                 out = heads_major(saved_out, bnsd);
    const int64_t max_len = *std::max_element(lengths.begin(), lengths.end());
    std::vector<SeqPiece> qp = pieces(me);
    std::vector<int64_t> qo = local_offsets(qp);
    const Tensor dq_buf = zeros_f32(saved_q), dq = heads_major(dq_buf, bnsd);
    Tensor cur_k = pad(saved_k, max_len), cur_v = pad(saved_v, max_len);
    Tensor dk, dv;     // the accumulators of the block this step holds
    WorkPtr arriving;  // they are on their way from the previous rank
    for (int s = 0; s < n; ++s) {
      const int src = (me - s + n) % n;
      WorkPtr next_kv = s + 1 < n ? exchange({cur_k, cur_v}, "ring kv") : nullptr;
      std::vector<SeqPiece> kp = pieces(src);
      std::vector<int64_t> ko = local_offsets(kp);
      struct PairGrads {
        size_t j;
        Tensor dk, dv;
      };
      std::vector<PairGrads> pairs;
      const Tensor k = heads_major(cur_k, bnsd), v = heads_major(cur_v, bnsd);
      for (size_t i = 0; i < qp.size(); ++i) {
        for (size_t j = 0; j < kp.size(); ++j) {
          if (!visible(qp[i], kp[j])) continue;
          auto q_i = ops::narrow(q, 2, qo[i], qp[i].length);
          auto k_j = ops::narrow(k, 2, ko[j], kp[j].length);
          auto v_j = ops::narrow(v, 2, ko[j], kp[j].length);
          std::vector<Tensor> grads = attention_backward(
              q_i, k_j, v_j, ops::narrow(out, 2, qo[i], qp[i].length),
              ops::narrow(saved_lse, 2, qo[i], qp[i].length),
              ops::narrow(dout, 2, qo[i], qp[i].length), piece_options(qp[i], kp[j]));
          ops::copy_(ops::narrow(dq, 2, qo[i], qp[i].length),
                     ops::add(ops::narrow(dq, 2, qo[i], qp[i].length), grads[0]));
          pairs.push_back({j, grads[1], grads[2]});
        }
      }
      if (arriving) {
        arriving->wait();
        dk = arriving->results()[0];
        dv = arriving->results()[1];
      } else {
        dk = zeros_f32(cur_k);
        dv = zeros_f32(cur_v);
      }
      for (const PairGrads& p : pairs) {
        Tensor dk_j = ops::narrow(heads_major(dk, bnsd), 2, ko[p.j], kp[p.j].length);
        Tensor dv_j = ops::narrow(heads_major(dv, bnsd), 2, ko[p.j], kp[p.j].length);
        ops::copy_(dk_j, ops::add(dk_j, p.dk));
        ops::copy_(dv_j, ops::add(dv_j, p.dv));
      }
      arriving = exchange({dk, dv}, "ring grad");
      if (next_kv) {
        next_kv->wait();
        cur_k = next_kv->results()[0];
        cur_v = next_kv->results()[1];
      }
    }
    arriving->wait();
    dk = arriving->results()[0];
    dv = arriving->results()[1];
    const int64_t mine = lengths[me];
    auto back = [&](const Tensor& t) {
      return ops::contiguous(ops::to(ops::narrow(t, seq_dim(), 0, mine), g[0].dtype()));
    };
    saved_q = saved_k = saved_v = saved_out = saved_lse = Tensor();
    return {ops::to(dq_buf, g[0].dtype()), back(dk), back(dv)};
  }
};

}  // namespace

Tensor ring_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                      const ProcessGroupPtr& group, const AttentionOptions& options,
                      int64_t seq_len, bool load_balance, const std::vector<int64_t>& lengths,
                      bool bnsd) {
  auto f = std::make_shared<RingAttention>();
  f->bnsd = bnsd;
  f->group = group;
  f->options = options;
  f->seq_len = seq_len;
  f->load_balance = load_balance;
  f->lengths = lengths;
  return Function::apply(f, {q, k, v})[0];
}

}  // namespace tandem::cp_detail
