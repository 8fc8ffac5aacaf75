#include "tandem/autograd/nn/attention.h"

#include <algorithm>
#include <tuple>

#include "tandem/autograd/ops.h"
#include "tandem/runtime/error.h"

namespace tandem::nn {
namespace {

// args.named[name] when present, else args.positional[index].
Tensor qkv_argument(Args& args, const char* name, size_t index) {
  if (Tensor* t = args.find(name)) {
    TANDEM_CHECK(t->defined(), "[nn::CoreAttention] expected a defined tensor for named '{}'",
                 name);
    return *t;
  }
  Tensor* t = args.at(index);
  TANDEM_CHECK(t != nullptr && t->defined(),
               "[nn::CoreAttention] expected '{}' as named argument or positional {}, got {} "
               "positional and no '{}'",
               name, index, args.positional.size(), name);
  return *t;
}

int64_t offset_argument(const Tensor& t, const char* name) {
  TANDEM_CHECK(t.numel() == 1 && !is_floating(t.dtype()) && t.dtype() != DType::Bool,
               "[nn::CoreAttention] expected '{}' as a one-element integer tensor, got {} {}", name,
               dtype_name(t.dtype()), t.shape());
  return static_cast<int64_t>(t.item_double());
}

// The key of DocumentScope's per-call data.
const char kDocumentsKey = 0;

}  // namespace

DocumentScope::DocumentScope(std::shared_ptr<const DocumentBounds> documents)
    : scope_(&kDocumentsKey, std::move(documents)) {}

std::shared_ptr<const DocumentBounds> scoped_documents() {
  return std::static_pointer_cast<const DocumentBounds>(find_call_data(&kDocumentsKey));
}

CoreAttention::CoreAttention(const AttentionOptions& options, QKVLayout layout)
    : Module("CoreAttention"), options_(options), layout_(layout) {}

std::vector<Tensor> CoreAttention::forward(Args& args) {
  const Tensor q = qkv_argument(args, "q", 0);
  const Tensor k = qkv_argument(args, "k", 1);
  const Tensor v = qkv_argument(args, "v", 2);
  const bool bnsd = layout_ == QKVLayout::BNSD;
  TANDEM_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
               "[nn::CoreAttention] expected {} q, k and v, got q={}, k={}, v={}",
               bnsd ? "(B, H, S, D)" : "(B, S, H, D)", q.shape(), k.shape(), v.shape());
  AttentionOptions options = options_;
  if (Tensor* t = args.find("q_offset")) options.q_offset = offset_argument(*t, "q_offset");
  if (Tensor* t = args.find("k_offset")) options.k_offset = offset_argument(*t, "k_offset");
  if (!options.documents) options.documents = scoped_documents();
  if (kernel_) return {kernel_(q, k, v, options, args)};
  if (bnsd) return {contiguous(scaled_dot_product_attention(q, k, v, options).out)};
  // BSHD → BHSD views; the kernel front end makes them contiguous.
  AttentionResult r = scaled_dot_product_attention(transpose(q, 1, 2), transpose(k, 1, 2),
                                                   transpose(v, 1, 2), options);
  return {contiguous(transpose(r.out, 1, 2))};
}

SelfAttention::SelfAttention(const SelfAttentionOptions& options, Generator& gen)
    : Module("SelfAttention"),
      d_model_(options.d_model),
      n_heads_(options.n_heads),
      n_kv_heads_(options.n_kv_heads > 0 ? options.n_kv_heads : options.n_heads) {
  const int64_t d_model = d_model_, n_heads = n_heads_, n_kv_heads = n_kv_heads_;
  TANDEM_CHECK(d_model > 0 && n_heads > 0 && (options.head_dim > 0 || d_model % n_heads == 0),
               "[nn::SelfAttention] expected a positive d_model divisible by n_heads (or an "
               "explicit head_dim), got d_model={}, n_heads={}",
               d_model, n_heads);
  TANDEM_CHECK(n_kv_heads > 0 && n_heads % n_kv_heads == 0,
               "[nn::SelfAttention] expected n_heads divisible by n_kv_heads, got n_heads={}, "
               "n_kv_heads={}",
               n_heads, n_kv_heads);
  head_dim_ = options.head_dim > 0 ? options.head_dim : d_model / n_heads;
  TANDEM_CHECK(options.head_dim >= 0,
               "[nn::SelfAttention] expected head_dim >= 0 (0: d_model / n_heads), got {}",
               options.head_dim);
  auto projection = [&](const char* name, int64_t in, int64_t out, bool bias) {
    return register_module(
        name, nn::make<nn::Linear>({.in_features = in, .out_features = out, .bias = bias}, gen));
  };
  q_proj_ = projection("q_proj", d_model, n_heads * head_dim_, options.qkv_bias);
  k_proj_ = projection("k_proj", d_model, n_kv_heads * head_dim_, options.qkv_bias);
  v_proj_ = projection("v_proj", d_model, n_kv_heads * head_dim_, options.qkv_bias);
  o_proj_ = projection("o_proj", n_heads * head_dim_, d_model, options.o_bias);
  if (options.qk_norm) {
    q_norm_ = register_module("q_norm",
                              nn::make<RMSNorm>({.dim = head_dim_, .eps = options.qk_norm_eps}));
    k_norm_ = register_module("k_norm",
                              nn::make<RMSNorm>({.dim = head_dim_, .eps = options.qk_norm_eps}));
  }
  if (options.rope) {
    rope_ = options.rope;
    TANDEM_CHECK(rope_->head_dim == 0 || rope_->head_dim == head_dim_,
                 "[nn::SelfAttention] expected the rotary embedding's head_dim to be 0 or the "
                 "layer's {}, got {}",
                 head_dim_, rope_->head_dim);
    rope_->head_dim = head_dim_;
    rope_inv_freq(*rope_);  // checks the options now rather than in the first forward
  }
  AttentionOptions core_options;
  core_options.causal = options.causal;
  core_ = register_module("core", nn::make<CoreAttention>(core_options));
}

namespace {
const char kCacheKey = 0;  // KVCacheScope's per-call data

std::shared_ptr<KVCache> scoped_cache() {
  // Only KVCacheScope stores under the key, and always a KVCache.
  return std::const_pointer_cast<KVCache>(
      std::static_pointer_cast<const KVCache>(find_call_data(&kCacheKey)));
}
}  // namespace

KVCacheScope::KVCacheScope(std::shared_ptr<KVCache> cache) : scope_(&kCacheKey, std::move(cache)) {}

void KVCache::clear() {
  entries_.clear();
  length_ = 0;
}

std::pair<Tensor, Tensor> KVCache::append(const void* layer, const Tensor& k, const Tensor& v) {
  Entry& e = entries_[layer];
  const int64_t n = k.shape()[1];
  if (e.k.defined()) {
    TANDEM_CHECK(k.shape()[0] == e.k.shape()[0] && k.shape()[2] == e.k.shape()[2] &&
                     k.shape()[3] == e.k.shape()[3] && k.dtype() == e.k.dtype(),
                 "[nn::KVCache] expected keys of shape (B {}, S, {}, {}) {} as cached, got {} {}",
                 e.k.shape()[0], e.k.shape()[2], e.k.shape()[3], dtype_name(e.k.dtype()), k.shape(),
                 dtype_name(k.dtype()));
  }
  const int64_t capacity = e.k.defined() ? e.k.shape()[1] : 0;
  if (e.length + n > capacity) {
    const int64_t grown = std::max<int64_t>({e.length + n, 2 * capacity, 16});
    auto grow = [&](const Tensor& old, const Tensor& like) {
      Shape shape = like.shape();
      shape[1] = grown;
      Tensor t = ops::zeros(shape, like.dtype(), like.device());
      if (e.length > 0)
        ops::copy_(ops::narrow(t, 1, 0, e.length), ops::narrow(old, 1, 0, e.length));
      return t;
    };
    e.k = grow(e.k, k);
    e.v = grow(e.v, v);
  }
  ops::copy_(ops::narrow(e.k, 1, e.length, n), k);
  ops::copy_(ops::narrow(e.v, 1, e.length, n), v);
  e.length += n;
  length_ = std::max(length_, e.length);
  return {ops::narrow(e.k, 1, 0, e.length), ops::narrow(e.v, 1, 0, e.length)};
}

namespace {
// q or k (B, S, heads, head_dim) after the QK-norm and the rotary embedding
// (tables cos/sin; undefined without one).
Tensor prepare_heads(Tensor t, const std::shared_ptr<RMSNorm>& norm, const Tensor& cos,
                     const Tensor& sin) {
  if (norm) t = (*norm)(t);
  if (cos.defined()) t = apply_rotary(t, cos, sin);
  return t;
}
}  // namespace

std::function<Tensor(const Tensor&)> SelfAttention::head_preparation(int slot) const {
  TANDEM_CHECK(slot >= 0 && slot <= 2,
               "[nn::SelfAttention] expected slot 0, 1 or 2 (q, k, v), got {}", slot);
  const std::shared_ptr<RMSNorm> norm = slot == 0 ? q_norm_ : slot == 1 ? k_norm_ : nullptr;
  if (slot == 2 || (!norm && !rope_)) return nullptr;
  return [norm, rope = rope_, hd = head_dim_](const Tensor& y) {
    TANDEM_CHECK(y.dim() == 3 && y.shape()[2] % hd == 0,
                 "[nn::SelfAttention] expected a projection output (B, S, heads * {}), got {}", hd,
                 y.shape());
    const int64_t B = y.shape()[0], S = y.shape()[1];
    Tensor cos, sin;
    if (rope)
      std::tie(cos, sin) = rotary_tables(*rope, S, y.dtype(), y.device(), "nn::SelfAttention");
    Tensor t = prepare_heads(reshape(y, Shape{B, S, y.shape()[2] / hd, hd}), norm, cos, sin);
    return reshape(t, y.shape());
  };
}

void SelfAttention::set_prepared_by_hooks(int slot) {
  TANDEM_CHECK(slot == 0 || slot == 1, "[nn::SelfAttention] expected slot 0 (q) or 1 (k), got {}",
               slot);
  prepared_by_hooks_[slot] = true;
}

std::vector<Tensor> SelfAttention::forward(Args& args) {
  const Tensor& x = single_input(args, "SelfAttention");
  TANDEM_CHECK(x.dim() == 3 && x.shape()[2] == d_model_,
               "[nn::SelfAttention] expected x of shape (B, S, {}), got {}", d_model_, x.shape());
  const int64_t B = x.shape()[0], S = x.shape()[1];
  // Heads from the projection's features: under tensor parallelism each rank
  // holds a slice of them. Never a -1, which an empty batch or sequence shard
  // (0 elements) could not resolve.
  auto split_heads = [&](const Tensor& y) {
    return reshape(y, Shape{B, S, y.shape()[2] / head_dim_, head_dim_});
  };
  // k and v first: where hooks start collectives on the projections'
  // outputs (asynchronous context parallelism), theirs travel while q's
  // projection computes, forward and (in reverse) backward, and all-gather
  // KV exchanges nothing for q.
  Tensor k = split_heads((*k_proj_)(x));
  Tensor v = split_heads((*v_proj_)(x));
  Tensor q = split_heads((*q_proj_)(x));
  Tensor cos, sin;
  if (rope_ && !(prepared_by_hooks_[0] && prepared_by_hooks_[1]))
    std::tie(cos, sin) = rotary_tables(*rope_, S, x.dtype(), x.device(), "nn::SelfAttention");
  if (!prepared_by_hooks_[0]) q = prepare_heads(q, q_norm_, cos, sin);
  if (!prepared_by_hooks_[1]) k = prepare_heads(k, k_norm_, cos, sin);
  Tensor attn;
  if (std::shared_ptr<KVCache> cache = scoped_cache()) {
    TANDEM_CHECK(!grad_mode_enabled(),
                 "[nn::SelfAttention] a KVCacheScope is for inference: expected NoGradGuard "
                 "around the forward (Note [KV cache])");
    TANDEM_CHECK(!core_->has_kernel(),
                 "[nn::SelfAttention] expected a core without a replaced kernel under a "
                 "KVCacheScope (context parallelism shards what the cache holds whole)");
    const int64_t cached = cache->entries_.count(this) ? cache->entries_.at(this).length : 0;
    auto [all_k, all_v] = cache->append(this, k, v);
    Args call{q, all_k, all_v};
    call.named["q_offset"] = ops::scalar_tensor(static_cast<double>(cached), DType::I64);
    attn = (*core_).call(call)[0];
  } else {
    attn = (*core_).call(Args{q, k, v})[0];  // (B, S, Hq, Dh)
  }
  return {(*o_proj_)(reshape(attn, Shape{B, S, attn.shape()[2] * attn.shape()[3]}))};
}

}  // namespace tandem::nn
