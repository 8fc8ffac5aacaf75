// Activation checkpointing (recompute): checkpoint(fn, inputs) runs `fn`
// without recording; in backward it re-runs `fn` with recording on detached
// copies of the inputs and backpropagates through the re-run, so the
// activations inside `fn` are held only during that backward. Parameters used
// inside `fn` receive their gradients from the re-run.
//
// While the re-run executes, is_recomputing() is true on that thread: hooks
// that must not act twice (the dual-pipe rendezvous) read it.
#pragma once

#include <functional>
#include <vector>

#include "tensor/tensor.h"

namespace tandem {

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
