// Rotary position embedding (RoPE), as the Llama family uses it, for tokens
// at any global positions:
//
//   nn::RotaryOptions rope{.head_dim = 64, .theta = 500000.0, .llama3 = nn::Llama3Scaling{}};
//   auto [cos, sin] = nn::rope_tables(rope, positions);  // this rank's tokens
//   q = nn::apply_rotary(q, cos, sin);                  // (B, S, H, D)
//
// Note [Rotary positions]
// ~~~~~~~~~~~~~~~~~~~~~~~
// A rotary embedding turns the pair (x[i], x[i + D/2]) of each head by the
// angle position * inv_freq[i]: the "rotate half" pairing of the Hugging
// Face Llama code, which its checkpoints' q/k weights are laid out for (the
// original paper pairs neighbours, x[2i] and x[2i+1]). The angle depends on
// the token's *global* position, so a rank holding a shard of the sequence
// (context parallelism, with or without the head-tail load balance, or a
// packed document that starts mid-sequence) passes the positions of the
// tokens it holds, in local order: the tables are data, not a function of
// the local index. parallel/context_parallel.h's sequence_positions() gives
// them for every CP layout; the rotation needs no communication. A
// PositionScope keeps the tables its forwards computed, so the L layers of a
// model compute them once per step, not L times.
//
// Tables are computed in f64 and rounded once to the dtype asked for, so
// they do not lose precision at large positions (the reference computes
// position * inv_freq in f32; both agree to rounding at the positions
// checkpoints are compared at).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "tandem/autograd/call_data.h"
#include "tandem/tensor/tensor.h"

namespace tandem::nn {

// Llama 3's frequency scaling ("rope_type": "llama3" in a config.json's
// rope_scaling): wavelengths above original_max_position_embeddings /
// low_freq_factor are stretched by `factor`, those below
// original_max_position_embeddings / high_freq_factor kept, and those
// between interpolated smoothly.
struct Llama3Scaling {
  double factor = 8.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
};

struct RotaryOptions {
  int64_t head_dim = 0;  // even
  double theta = 10000.0;
  std::optional<Llama3Scaling> llama3 = std::nullopt;
};

// The head_dim / 2 inverse frequencies theta^(-2i / head_dim), scaled when
// llama3 is set. Checks the options.
std::vector<double> rope_inv_freq(const RotaryOptions& options);

// cos and sin of position * inv_freq for each position: two (positions,
// head_dim) tables whose halves repeat (the rotate-half pairing).
std::pair<Tensor, Tensor> rope_tables(const RotaryOptions& options,
                                      const std::vector<int64_t>& positions,
                                      DType dtype = DType::F32, Device device = Device::cpu());

// x * cos + rotate_half(x) * sin with rotate_half(x) = cat(-x2, x1) over the
// last dim (x1, x2 its halves). x is (B, S, H, D) with seq_dim 1 or (B, H, S,
// D) with seq_dim 2; cos and sin are (S, D) tables of rope_tables().
// Differentiable in x (the tables are constants).
Tensor apply_rotary(const Tensor& x, const Tensor& cos, const Tensor& sin, int64_t seq_dim = 1);

// The positions start, start + 1, ..., start + length - 1.
std::vector<int64_t> position_range(int64_t start, int64_t length);

// The global positions of the tokens that the forwards run on this thread
// hold, in local order, while it lives (a rank's shard of the sequence: Note
// [Rotary positions]); checkpoint re-runs see them too (Note [Per-call
// data]). Without one, a sequence of S tokens sits at positions 0 .. S-1.
class PositionScope {
 public:
  explicit PositionScope(std::vector<int64_t> positions);
  struct Data;

 private:
  CallDataScope scope_;
};

// The positions a PositionScope declares on this thread; null when none.
std::shared_ptr<const std::vector<int64_t>> scoped_positions();

// rope_tables() for a local sequence of `length` tokens at local_positions():
// computed once per PositionScope for each options, dtype and device, and
// every call without a scope. `who` names the caller in the error.
std::pair<Tensor, Tensor> rotary_tables(const RotaryOptions& options, int64_t length, DType dtype,
                                        Device device, const char* who);

// The positions of a local sequence of `length` tokens: the scope's, checked
// to hold `length` of them, or 0 .. length-1. `who` names the caller in the
// error.
std::vector<int64_t> local_positions(int64_t length, const char* who);

}  // namespace tandem::nn
