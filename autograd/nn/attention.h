// Attention layers. CoreAttention is the softmax(QK^T)V step alone, as its
// own module, because context parallelism (DESIGN §7) hooks exactly this step:
// its pre-hook redistributes Q/K/V (all-to-all over heads, all-gather of K/V
// along the sequence) and its forward hook redistributes the output.
// SelfAttention wraps it with separate q/k/v/o projection modules, which the
// async variant of context parallelism hooks to overlap its collectives with
// the projection GEMMs.
//
// Layout: modules exchange (B, S, H, D) tensors (BSHD); the attention kernel
// wants (B, H, S, D), so CoreAttention transposes in and out.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>

#include "tandem/autograd/call_data.h"
#include "tandem/autograd/module.h"
#include "tandem/autograd/nn/linear.h"
#include "tandem/autograd/nn/norm.h"
#include "tandem/autograd/nn/rope.h"
#include "tandem/tensor/ops.h"

namespace tandem::nn {

// The order of the dims of q, k, v and the output of a CoreAttention:
// (batch, sequence, heads, head dim), or (batch, heads, sequence, head dim)
// as PyTorch's scaled_dot_product_attention takes them.
enum class QKVLayout { BSHD, BNSD };

// Arguments: q (B, Sq, Hq, D), k and v (B, Sk, Hkv, D) with Hq % Hkv == 0
// (grouped-query heads), each taken from args.named ("q", "k", "v") when
// present, else from args.positional[0], [1], [2]. So a hook may pass them
// either way. Output: {(B, Sq, Hq, D)}, contiguous. With QKVLayout::BNSD the
// heads come before the sequence in all four: q (B, Hq, Sq, D), and so on.
//
// Causal masking uses global positions: query i sits at q_offset + i and key j
// at k_offset + j (AttentionOptions). The offsets come from options() (fixed
// per module, e.g. a rank's static shard) and may be overridden per call by
// named arguments "q_offset" / "k_offset": one-element integer tensors, read
// on the host (keep them on the CPU to avoid a device synchronisation).
//
// Packed sequences (Note [Packed sequences] in tensor/ops.h): the document
// bounds come from options().documents, else from the DocumentScope in scope
// on the calling thread, so that a step declares them once for every
// attention of the model (and context parallelism hands them to each of its
// kernels with that rank's positions).
class CoreAttention final : public Module {
 public:
  // Replaces the attention computation itself (the module's layout in and
  // out); context
  // parallelism installs ring and load-balanced kernels this way. `args` are
  // this call's arguments as the pre-hooks left them: per-call data a hook
  // passes to its kernel rides there (Note [CP per-call state]).
  using Kernel = std::function<Tensor(const Tensor& q, const Tensor& k, const Tensor& v,
                                      const AttentionOptions& options, const Args& args)>;

  using Options = AttentionOptions;
  explicit CoreAttention(const AttentionOptions& options = {}, QKVLayout layout = QKVLayout::BSHD);
  QKVLayout layout() const { return layout_; }
  void set_kernel(Kernel kernel) { kernel_ = std::move(kernel); }
  bool has_kernel() const { return kernel_ != nullptr; }

  const AttentionOptions& options() const { return options_; }
  // Not synchronised with a concurrent forward: configure before running.
  void set_options(const AttentionOptions& options) { options_ = options; }

 protected:
  std::vector<Tensor> forward(Args& args) override;

 private:
  AttentionOptions options_;
  QKVLayout layout_;
  Kernel kernel_;
};

// The document bounds of the packed sequences that the forwards run on this
// thread attend to while it lives, in global positions of the whole
// (unsharded) sequence; checkpoint re-runs see them too (Note [Per-call
// data]). Null bounds: one document.
class DocumentScope {
 public:
  explicit DocumentScope(std::shared_ptr<const DocumentBounds> documents);

 private:
  CallDataScope scope_;
};

// The bounds a DocumentScope declares on this thread; null when none.
std::shared_ptr<const DocumentBounds> scoped_documents();

struct SelfAttentionOptions {
  int64_t d_model = 0;
  int64_t n_heads = 0;
  int64_t n_kv_heads = 0;  // 0: n_heads (no grouping)
  bool causal = true;
  int64_t head_dim = 0;   // 0: d_model / n_heads
  bool qkv_bias = false;  // biases on q_proj, k_proj, v_proj (Qwen2; Llama's attention_bias)
  bool o_bias = false;    // a bias on o_proj (Llama's attention_bias)
  bool qk_norm = false;   // RMSNorm over each head of q and k (children q_norm, k_norm)
  double qk_norm_eps = 1e-6;
  // A rotary embedding of q and k (after the norms) at the positions of
  // local_positions(): Note [Rotary positions]. Its head_dim is this
  // layer's.
  std::optional<RotaryOptions> rope = std::nullopt;
};

// Note [KV cache]
// ~~~~~~~~~~~~~~~
// Incremental decoding: while a KVCacheScope is in scope on the calling
// thread, every SelfAttention appends the keys and values of the tokens it is
// called on (after QK-norm and the rotary embedding) to its own entry of the
// cache, and attends its queries to every cached key, the queries sitting
// after the tokens cached before them (CoreAttention's q_offset). A model is
// then called once on the prompt and after that on one new token at a time,
// each call attending over the whole prefix without recomputing it. The new
// tokens' rotary positions come from the PositionScope as always: the caller
// declares them (position_range(cache.length(), n)). Inference only: a
// forward in grad mode under a scope is refused, as is a core with a kernel
// or hooks of context parallelism (its layout is not a cached prefix).
// Entries grow by doubling, so appending is amortised O(new tokens).
class KVCache {
 public:
  // Tokens cached so far (every layer of one model holds the same number).
  int64_t length() const { return length_; }
  void clear();

 private:
  friend class SelfAttention;
  struct Entry {
    Tensor k, v;  // (B, capacity, Hkv, D)
    int64_t length = 0;
  };
  // Appends k and v (B, S, Hkv, D) to the entry of `layer`; returns the
  // cached keys and values, (B, length, Hkv, D).
  std::pair<Tensor, Tensor> append(const void* layer, const Tensor& k, const Tensor& v);
  std::map<const void*, Entry> entries_;
  int64_t length_ = 0;
};

// The cache the SelfAttention forwards on this thread use while it lives.
class KVCacheScope {
 public:
  explicit KVCacheScope(std::shared_ptr<KVCache> cache);

 private:
  CallDataScope scope_;
};

// Multi-head self-attention with grouped-query heads, as the Llama family
// has it: x (B, S, d_model) → q_proj/k_proj/v_proj (Linears) reshaped to
// (B, S, H, Dh) → [q_norm/k_norm] → [rotary embedding of q and k] → core →
// (B, S, n_heads * Dh) → o_proj → (B, S, d_model). Dh = head_dim, by default
// d_model / n_heads.
class SelfAttention final : public Module {
 public:
  using Options = SelfAttentionOptions;
  SelfAttention(const SelfAttentionOptions& options, Generator& gen);

  int64_t n_heads() const { return n_heads_; }
  int64_t n_kv_heads() const { return n_kv_heads_; }
  int64_t head_dim() const { return head_dim_; }
  const std::shared_ptr<Linear>& q_proj() const { return q_proj_; }
  const std::shared_ptr<Linear>& k_proj() const { return k_proj_; }
  const std::shared_ptr<Linear>& v_proj() const { return v_proj_; }
  const std::shared_ptr<Linear>& o_proj() const { return o_proj_; }
  const std::shared_ptr<CoreAttention>& core() const { return core_; }
  // Null unless options.qk_norm.
  const std::shared_ptr<RMSNorm>& q_norm() const { return q_norm_; }
  const std::shared_ptr<RMSNorm>& k_norm() const { return k_norm_; }
  const std::optional<RotaryOptions>& rope() const { return rope_; }

  // What forward computes on the output y (B, S, heads * head_dim) of the q
  // (slot 0) or k (slot 1) projection before the core attends to it: the
  // QK-norm and the rotary embedding, at the positions of this call
  // (PositionScope), returned in y's shape. Null for v (slot 2) and when the
  // layer has neither. Holds no reference to the layer.
  std::function<Tensor(const Tensor&)> head_preparation(int slot) const;
  // From now on the q (0) or k (1) projection's output arrives prepared:
  // something that hooks the projection applies head_preparation(slot) to
  // it, and forward no longer does (Note [Rotary before the exchange] in
  // parallel/cp_async.cpp).
  void set_prepared_by_hooks(int slot);

 protected:
  std::vector<Tensor> forward(Args& args) override;

 private:
  bool prepared_by_hooks_[2] = {false, false};
  int64_t d_model_;
  int64_t n_heads_;
  int64_t n_kv_heads_;
  int64_t head_dim_;
  std::shared_ptr<Linear> q_proj_;
  std::shared_ptr<Linear> k_proj_;
  std::shared_ptr<Linear> v_proj_;
  std::shared_ptr<Linear> o_proj_;
  std::shared_ptr<CoreAttention> core_;
  std::shared_ptr<RMSNorm> q_norm_;
  std::shared_ptr<RMSNorm> k_norm_;
  std::optional<RotaryOptions> rope_;
};

}  // namespace tandem::nn
