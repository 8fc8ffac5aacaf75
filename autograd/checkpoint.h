// Activation checkpointing (recompute): checkpoint(fn, inputs) runs `fn`
// without recording; in backward it re-runs `fn` with recording on detached
// copies of the inputs and backpropagates through the re-run, so the
// activations inside `fn` are held only during that backward. Parameters used
// inside `fn` receive their gradients from the re-run.
//
// While the re-run executes, is_recomputing() is true on that thread: hooks
// that must not act twice (the dual-pipe rendezvous) read it.
//
// Note [Random draws under checkpoint]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A random op inside `fn` (dropout) must draw the same numbers in the re-run
// as in the forward, or the gradients belong to another mask. Random ops in
// autograd/ take their counters through draw_random(gen, n) instead of
// gen.advance(n): while a checkpoint's forward runs, each draw (seed and first
// counter) is logged in that checkpoint; while it re-runs, the logged draws
// are handed out again in order and no generator advances. A checkpoint
// re-run inside another's re-run replays from the outer log and logs for the
// inner one, so nesting works too. The log lives in the checkpoint's backward
// node (Note [MoE per-call state] in spirit): two micro-batches in flight on
// two threads never share one.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "tandem/tensor/random.h"
#include "tandem/tensor/tensor.h"

namespace tandem {

// One reservation of counters: elements use philox counters offset + i.
struct RandomDraw {
  uint64_t seed = 0;
  uint64_t offset = 0;
  uint64_t count = 0;  // counters reserved
};

// Reserves n counters of gen (Note [Random draws under checkpoint]).
RandomDraw draw_random(Generator& gen, uint64_t n);

bool is_recomputing();

class RecomputeGuard {
 public:
  RecomputeGuard();
  ~RecomputeGuard();
  RecomputeGuard(const RecomputeGuard&) = delete;
  RecomputeGuard& operator=(const RecomputeGuard&) = delete;

 private:
  bool previous_;
};

using CheckpointFn = std::function<std::vector<Tensor>(const std::vector<Tensor>&)>;
std::vector<Tensor> checkpoint(CheckpointFn fn, const std::vector<Tensor>& inputs);

}  // namespace tandem
