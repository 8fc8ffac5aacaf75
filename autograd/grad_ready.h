// Gradient-ready hooks: a callback on a leaf (a parameter) that backward()
// calls as soon as that leaf's gradient of this backward is complete and
// accumulated into grad(leaf), while the rest of the backward goes on. What
// data parallelism needs to launch a bucket's reduction behind the remaining
// backward compute (parallel/ddp.h), as PyTorch's
// register_post_accumulate_grad_hook.
//
// Note [Gradient-ready hooks]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The engine replays nodes in decreasing sequence number (Note [The tape]), so
// once every node still queued is older than the oldest node that consumed a
// leaf, nothing can add to that leaf's gradient any more. While any
// gradient-ready hook is registered (process-wide), backward() first walks
// the graph from its roots to find, for each hooked leaf it reaches, the
// oldest consuming node; during the replay, each such leaf is finished
// (its register_hook hooks applied, its gradient accumulated into grad())
// as soon as the queue's newest node is older than that, and its ready
// hooks run there, on the thread running the backward. Leaves without ready
// hooks are finished at the end, as before; without any registered hook the
// walk is skipped. gradients() (which leaves grad() alone) never calls them.
// A leaf that gets no gradient in a backward is not called.
#pragma once

#include <functional>

#include "tandem/tensor/tensor.h"

namespace tandem {

// Called with the leaf itself; grad(leaf) holds the accumulated gradient.
using GradReadyHook = std::function<void(const Tensor& leaf)>;

// Registers `hook` on `leaf` (a tensor that requires grad and has no
// grad_fn); returns a handle for remove_grad_ready_hook.
int register_grad_ready_hook(const Tensor& leaf, GradReadyHook hook);
void remove_grad_ready_hook(int handle);

}  // namespace tandem
