// The tensor layer's operations (DESIGN §3). Every function checks its inputs
// once, here at the front end (errors read `[tensor::op] expected …, got …`),
// allocates its output on the operands' device and enqueues the kernel on the
// calling thread's current stream (Note [Stream ordering]). Kernels live in
// tensor/cpu/ and tensor/cuda/ and trust their launcher.
//
// These functions are not differentiable; autograd/ wraps them.
#pragma once

#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "tandem/tensor/random.h"
#include "tandem/tensor/tensor.h"
#include "tandem/tensor/unary_ops.h"

namespace tandem {

// Result and option types live in namespace tandem (not ops) so that argument-
// dependent lookup never sees both tandem::ops and the autograd overloads.
struct NormResult {
  Tensor out;
  Tensor mean;  // (rows) f32; undefined for rms_norm
  Tensor rstd;  // (rows) f32
};

// Gradients of a normalisation (ops::norm_backward); undefined when not asked for.
struct NormGrads {
  Tensor dx;       // x's shape and dtype
  Tensor dweight;  // (D), weight's dtype
  Tensor dbias;    // (D), x's dtype (layer_norm only)
};

enum class GeluApproximate { None, Tanh };

// How a loss combines its per-row values, as PyTorch's `reduction`.
enum class Reduction { None, Mean, Sum };

// cross_entropy's options, with PyTorch's names and defaults (class weights
// and probability targets are not supported).
struct CrossEntropyOptions {
  int64_t ignore_index = -100;
  Reduction reduction = Reduction::Mean;
  double label_smoothing = 0.0;  // in [0, 1]
};

// Note [Packed sequences]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// Several documents laid end to end along one sequence, each attending only
// to itself (PyTorch's document masking, FlashAttention's varlen API). The
// boundaries are data: `cumulative` holds them in global positions, as
// FlashAttention's cu_seqlens, {0, l0, l0 + l1, ..., total}, one list shared
// by every batch row or one list per row; documents may be empty. A query at
// global position p in document d (cumulative[d] <= p < cumulative[d + 1])
// sees the keys of d, and with `causal` only those at positions <= p. The
// front end turns them into one key window per query row, [begin, end) in
// the local keys (offsets applied), which is all the kernels read; so every
// caller that attends to a piece of the sequence at known offsets (context
// parallelism's shards, ring blocks, load-balanced chunks) gets the masking of
// the whole sequence by passing the same bounds.
struct DocumentBounds {
  std::vector<std::vector<int64_t>> cumulative;

  // Checked: every list starts at 0 and never decreases; 1 list, or 1 per row.
  static std::shared_ptr<const DocumentBounds> make(std::vector<std::vector<int64_t>> cumulative);
  // From each row's document lengths (one list for all rows, or one per row).
  static std::shared_ptr<const DocumentBounds> from_lengths(
      const std::vector<std::vector<int64_t>>& lengths);
  // The list of batch row b.
  const std::vector<int64_t>& row(int64_t b) const {
    return cumulative.size() == 1 ? cumulative[0] : cumulative[static_cast<size_t>(b)];
  }
};

struct AttentionOptions {
  bool causal = false;
  int64_t q_offset = 0;
  int64_t k_offset = 0;
  std::optional<double> scale;  // default 1/sqrt(D)
  // Packed sequences (Note [Packed sequences]); null: one document.
  std::shared_ptr<const DocumentBounds> documents;
};

struct AttentionResult {
  Tensor out;  // (B, Hq, Sq, D)
  Tensor lse;  // (B, Hq, Sq) f32 log-sum-exp of the scaled scores (for ring merges)
};

namespace ops {

using tandem::AttentionOptions;
using tandem::AttentionResult;
using tandem::CrossEntropyOptions;
using tandem::GeluApproximate;
using tandem::NormGrads;
using tandem::NormResult;
using tandem::Reduction;

// ---- factories ----
Tensor zeros(const Shape& shape, DType dtype = DType::F32, Device device = Device::cpu());
Tensor ones(const Shape& shape, DType dtype = DType::F32, Device device = Device::cpu());
Tensor full(const Shape& shape, double value, DType dtype = DType::F32,
            Device device = Device::cpu());
// [start, end) with `step`; dtype i64 unless given.
Tensor arange(double start, double end, double step = 1.0, DType dtype = DType::I64,
              Device device = Device::cpu());
template <class T>
Tensor from_vector(const std::vector<T>& values, const Shape& shape, Device device = Device::cpu());
Tensor scalar_tensor(double value, DType dtype = DType::F32, Device device = Device::cpu());
// Counter-based random numbers (tensor/random.h): identical on CPU and CUDA for
// the same generator state. Each call advances the generator by numel.
Tensor rand(const Shape& shape, Generator& gen, DType dtype = DType::F32,
            Device device = Device::cpu());  // uniform [0, 1)
Tensor randn(const Shape& shape, Generator& gen, DType dtype = DType::F32,
             Device device = Device::cpu());
Tensor normal(const Shape& shape, double mean, double stddev, Generator& gen,
              DType dtype = DType::F32, Device device = Device::cpu());
Tensor uniform(const Shape& shape, double low, double high, Generator& gen,
               DType dtype = DType::F32, Device device = Device::cpu());
Tensor empty_like(const Tensor& t);
Tensor zeros_like(const Tensor& t);
Tensor ones_like(const Tensor& t);
Tensor full_like(const Tensor& t, double value);

// ---- views: share storage, no copy ----
// view() needs compatible strides (error otherwise); reshape() copies when needed.
// One extent may be -1.
Tensor view(const Tensor& t, const Shape& shape);
Tensor reshape(const Tensor& t, const Shape& shape);
Tensor flatten(const Tensor& t, int64_t start_dim = 0, int64_t end_dim = -1);
Tensor permute(const Tensor& t, const Dims& dims);
Tensor transpose(const Tensor& t, int64_t dim0, int64_t dim1);
Tensor narrow(const Tensor& t, int64_t dim, int64_t start, int64_t length);
// Python-style slice [start, end) with step > 0; negative and out-of-range
// bounds clamp as in Python.
Tensor slice(const Tensor& t, int64_t dim, int64_t start, int64_t end, int64_t step = 1);
Tensor select(const Tensor& t, int64_t dim, int64_t index);
Tensor expand(const Tensor& t, const Shape& shape);  // -1 keeps an extent
Tensor squeeze(const Tensor& t);                     // all size-1 dims
Tensor squeeze(const Tensor& t, int64_t dim);
Tensor unsqueeze(const Tensor& t, int64_t dim);
// split into pieces of `split_size` (last may be smaller) / of the given sizes.
std::vector<Tensor> split(const Tensor& t, int64_t split_size, int64_t dim = 0);
std::vector<Tensor> split_sizes(const Tensor& t, const std::vector<int64_t>& sizes,
                                int64_t dim = 0);
// `chunks` pieces of ceil(n/chunks) (fewer when n is small), like torch.chunk.
std::vector<Tensor> chunk(const Tensor& t, int64_t chunks, int64_t dim = 0);

// ---- copies ----
Tensor contiguous(const Tensor& t);  // returns t itself when already contiguous
Tensor clone(const Tensor& t);
Tensor to(const Tensor& t, Device device);  // synchronises across devices
Tensor to(const Tensor& t, DType dtype);
// dst[...] = src (broadcast to dst's shape, cast to dst's dtype). dst may be a view.
void copy_(const Tensor& dst, const Tensor& src);
void fill_(const Tensor& dst, double value);
Tensor cat(const std::vector<Tensor>& tensors, int64_t dim = 0);
Tensor stack(const std::vector<Tensor>& tensors, int64_t dim = 0);

// ---- elementwise (broadcasting; result dtype by promotion) ----
Tensor add(const Tensor& a, const Tensor& b);
Tensor sub(const Tensor& a, const Tensor& b);
Tensor mul(const Tensor& a, const Tensor& b);
Tensor div(const Tensor& a, const Tensor& b);
Tensor pow(const Tensor& a, const Tensor& b);
Tensor maximum(const Tensor& a, const Tensor& b);
Tensor minimum(const Tensor& a, const Tensor& b);
Tensor add(const Tensor& a, double s);
Tensor sub(const Tensor& a, double s);
Tensor rsub(const Tensor& a, double s);  // s - a
Tensor mul(const Tensor& a, double s);
Tensor div(const Tensor& a, double s);
Tensor rdiv(const Tensor& a, double s);  // s / a
Tensor pow(const Tensor& a, double exponent);
// neg, exp, log, sqrt, rsqrt, abs, tanh, sigmoid, relu, silu, erf: the
// unary ops of tensor/unary_ops.h (Note [Adding a unary op]).
#define TANDEM_UNARY_DECLARE(E, name, linear) Tensor name(const Tensor& a);
TANDEM_UNARY_OPS(TANDEM_UNARY_DECLARE)
#undef TANDEM_UNARY_DECLARE
// GELU: Tanh is 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) (GPT-2,
// llm.c), None the exact 0.5 x (1 + erf(x / sqrt(2))), as PyTorch's
// `approximate` argument. The default differs from PyTorch's on purpose:
// tandem's gelu has always been the tanh form and models trained with it keep
// their numbers; pass GeluApproximate::None for torch.nn.GELU().
Tensor gelu(const Tensor& a, GeluApproximate approximate = GeluApproximate::Tanh);
// Dropout (training form): element i of x is zeroed where
// philox_uniform(offset, seed, i) < p (tensor/random.h) and the others are
// scaled by 1 / (1 - p), so the expectation is x. p == 0 returns x itself,
// p == 1 zeros. The mask depends only on (seed, offset + i): the same on CPU
// and CUDA, at any thread count, and in a recomputed forward given the same
// counters, which is how autograd's dropout both recomputes (Note [Random
// draws under checkpoint]) and backpropagates (the same call on the gradient).
Tensor dropout(const Tensor& x, double p, uint64_t seed, uint64_t offset);
// The same with counters reserved from gen (numel of them, whatever p).
Tensor dropout(const Tensor& x, double p, Generator& gen);
// silu(a) * b in one pass (the SwiGLU gate); a and b of one shape and dtype.
Tensor swiglu(const Tensor& a, const Tensor& b);
// The gradients (da, db) of swiglu(a, b) for the output gradient g.
std::pair<Tensor, Tensor> swiglu_backward(const Tensor& a, const Tensor& b, const Tensor& g);
// The rotary embedding of x, (B, S, H, D) with seq_dim 1 or (B, H, S, D)
// with seq_dim 2, by the (S, D) cos and sin tables of its positions, in one
// pass (Note [Fused rotary embedding] in tensor/cpu/elementwise.cpp); inverse
// turns back (the gradient). nn::apply_rotary is the differentiable front.
Tensor rotary(const Tensor& x, const Tensor& cos, const Tensor& sin, int64_t seq_dim = 1,
              bool inverse = false);
// Comparisons return bool tensors.
Tensor eq(const Tensor& a, const Tensor& b);
Tensor ne(const Tensor& a, const Tensor& b);
Tensor lt(const Tensor& a, const Tensor& b);
Tensor le(const Tensor& a, const Tensor& b);
Tensor gt(const Tensor& a, const Tensor& b);
Tensor ge(const Tensor& a, const Tensor& b);
Tensor eq(const Tensor& a, double s);
Tensor ne(const Tensor& a, double s);
Tensor lt(const Tensor& a, double s);
Tensor le(const Tensor& a, double s);
Tensor gt(const Tensor& a, double s);
Tensor ge(const Tensor& a, double s);
// cond ? a : b, broadcasting all three; cond is bool.
Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b);
Tensor where(const Tensor& cond, const Tensor& a, double b);

Tensor operator+(const Tensor& a, const Tensor& b);
Tensor operator-(const Tensor& a, const Tensor& b);
Tensor operator*(const Tensor& a, const Tensor& b);
Tensor operator/(const Tensor& a, const Tensor& b);
Tensor operator+(const Tensor& a, double s);
Tensor operator-(const Tensor& a, double s);
Tensor operator*(const Tensor& a, double s);
Tensor operator/(const Tensor& a, double s);
Tensor operator-(const Tensor& a);

// ---- reductions over dims (empty dims = all) ----
// Floating sums (sum, mean, cumsum, the softmax denominators) add in one
// fixed blocked, pairwise order (Note [Cascade summation] in
// tensor/cpu/cascade.h): the rounding error grows like log n, not n, and the
// bits are the same at any number of CPU kernel threads.
Tensor sum(const Tensor& t, const Dims& dims = {}, bool keepdim = false);
Tensor mean(const Tensor& t, const Dims& dims = {}, bool keepdim = false);
Tensor amax(const Tensor& t, const Dims& dims = {}, bool keepdim = false);
Tensor amin(const Tensor& t, const Dims& dims = {}, bool keepdim = false);
// max over one dim: values and i64 indices (first occurrence).
std::pair<Tensor, Tensor> max(const Tensor& t, int64_t dim, bool keepdim = false);
Tensor argmax(const Tensor& t, int64_t dim, bool keepdim = false);
Tensor argmin(const Tensor& t, int64_t dim, bool keepdim = false);
Tensor cumsum(const Tensor& t, int64_t dim);
// A line whose elements are all -inf gives zeros, where PyTorch gives NaN:
// on purpose, like attention rows that see no key (a fully masked row).
Tensor softmax(const Tensor& t, int64_t dim = -1);
Tensor log_softmax(const Tensor& t, int64_t dim = -1);

// ---- linear algebra ----
// (…, M, K) x (…, K, N) with broadcast batch dims; 1-D operands as in numpy.
// f32, f64, bf16, f16 (16-bit inputs accumulate in f32).
Tensor matmul(const Tensor& a, const Tensor& b);

// ---- normalisation (over the last dim) ----
// weight/bias: (D) or undefined.
NormResult layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps = 1e-5);
NormResult rms_norm(const Tensor& x, const Tensor& weight, double eps = 1e-6);
// Gradients of layer_norm (mean defined) or rms_norm (mean undefined) from the
// output gradient dy and the statistics the forward returned, in one kernel.
// dweight (when weight is defined and want_dweight) and dbias (when want_dbias;
// layer_norm only) are sums over the rows.
NormGrads norm_backward(const Tensor& dy, const Tensor& x, const Tensor& weight, const Tensor& mean,
                        const Tensor& rstd, bool want_dweight, bool want_dbias);

// ---- indexing ----
Tensor embedding(const Tensor& weight, const Tensor& indices);           // (V, D)[idx] -> (*idx, D)
Tensor index_select(const Tensor& t, int64_t dim, const Tensor& index);  // index: 1-D i64/i32
// out[i][j][k] = t[i][index[i][j][k]][k] for dim = 1 (index same rank as t).
Tensor gather(const Tensor& t, int64_t dim, const Tensor& index);
// Returns a copy of `t` with src added at the index positions along dim.
Tensor scatter_add(const Tensor& t, int64_t dim, const Tensor& index, const Tensor& src);
// Largest (or smallest) k along dim, sorted; values and i64 indices.
std::pair<Tensor, Tensor> topk(const Tensor& t, int64_t k, int64_t dim = -1, bool largest = true);
Tensor argsort(const Tensor& t, int64_t dim = -1, bool descending = false);  // stable
Tensor one_hot(const Tensor& indices, int64_t num_classes);                  // i64 output

// ---- losses and attention ----
// logits (N, C), targets (N) integer. With logp = log_softmax(logits, 1) and
// e = label_smoothing, row i's loss is
//   (1 - e) * -logp[i, t_i] + e * mean_c(-logp[i, c]),
// and 0 where t_i == ignore_index. Reduction::Mean divides the sum by the
// number of targets != ignore_index, Sum returns the sum, None the (N) row
// losses. These are PyTorch's semantics, with one difference on purpose: a
// mean over a batch whose targets are all ignored is 0, not PyTorch's NaN (a
// context-parallel shard or a padded micro-batch may score no token at all,
// and a NaN there would poison the whole step's gradients). The loss is f32
// (f64 for f64 logits) whatever the logits' dtype.
Tensor cross_entropy(const Tensor& logits, const Tensor& targets, int64_t ignore_index = -100);
Tensor cross_entropy(const Tensor& logits, const Tensor& targets,
                     const CrossEntropyOptions& options);

// Scaled dot-product attention on (B, H, S, D) layouts (BHSD).
// q: (B, Hq, Sq, D); k, v: (B, Hkv, Sk, D) with Hq % Hkv == 0 (grouped-query
// heads: query head h uses kv head h / (Hq / Hkv)). With `causal`, query at
// global position q_offset + i attends to keys at global positions
// k_offset + j <= q_offset + i (positions matter when the sequence is sharded).
// Rows that see no key at all (Sq > 0 with Sk == 0, or a causal row whose
// keys all lie after it) give a zero output row and lse = -inf, where PyTorch
// gives NaN; on purpose, since a sequence shard may legitimately hold no
// visible key for some query rows (context parallelism) and their gradients
// must stay finite. With `documents`, a query also sees only the keys of its
// own document (Note [Packed sequences]); the bounds must cover every query
// and key position.
// One fused kernel per device (Note [Fused CPU attention] in
// tensor/cpu/attention.cpp); `out` is a (B, Hq, Sq, D) view of a (B, Sq, Hq, D)
// contiguous buffer, so that merging the heads back is free.
AttentionResult scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                             const AttentionOptions& options = {});
// The gradients {dq, dk, dv} of attention from its inputs, output, f32
// log-sum-exp and output gradient. `lse` may come from a larger computation
// (ring attention passes the final one for each block): P = exp(S - lse) is
// recomputed from it; rows with lse = -inf get P = 0.
std::vector<Tensor> scaled_dot_product_attention_backward(const Tensor& q, const Tensor& k,
                                                          const Tensor& v, const Tensor& out,
                                                          const Tensor& lse, const Tensor& dout,
                                                          const AttentionOptions& options = {});

// ---- utilities ----
bool allclose(const Tensor& a, const Tensor& b, double rtol = 1e-5, double atol = 1e-8);
bool equal(const Tensor& a, const Tensor& b);  // same shape and identical values
// Threads used by the CPU kernels (matrix products, attention, normalisation,
// large elementwise ops: Note [CPU kernel threads]); default 1.
void set_num_threads(int n);
int num_threads();
// The vector instructions the CPU kernels were built for (-Dcpu_arch; Note
// [SIMD width] in tensor/cpu/simd.h): "avx512", "avx2", "avx" or "sse2".
const char* cpu_vector_isa();

}  // namespace ops
}  // namespace tandem
