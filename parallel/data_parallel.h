// Data parallelism's step-end work, read from the parameters' placements
// (Note [Parameter placements]) rather than from their names or shapes:
// gradient reduction over the data dims of a mesh, the global gradient norm
// and clipping, and the reduction of host-side metrics.
//
//   DeviceMesh mesh(world, {dp, ep, cp, tp}, {"dp", "ep", "cp", "tp"});
//   … styles split the model's parameters, the schedule runs backward …
//   reduce_gradients(params, mesh, {"dp", "ep", "cp"});   // dense: over all three,
//                                                         // experts: over dp and cp
//   const double norm = clip_grad_norm(params, mesh, 1.0);
//   optimizer.step();
//
// Gradients are summed, not averaged (the caller scales its loss, as
// tandem-train does: Note [Training layout] in tools/train/trainer.h); pass
// RedOp::Avg for the mean over the replicas instead.
#pragma once

#include <string>
#include <vector>

#include "tandem/comm/types.h"
#include "tandem/parallel/device_mesh.h"
#include "tandem/tensor/tensor.h"

namespace tandem {

// The dims of `dims` that `param` is replicated over (not split over by its
// placement: Note [Parameter placements]), and the number of ranks they span.
std::vector<std::string> replicated_dims(const Tensor& param, const std::vector<std::string>& dims);
int64_t ranks_over(const DeviceMesh& mesh, const std::vector<std::string>& dims);

// Reduces the gradient of every parameter of `params` over the dims of
// `data_dims` (of `mesh`) that the parameter is replicated over, one flat
// bucket (one all_reduce) per distinct set of dims, in the order the sets
// first appear in `params`. A parameter without a gradient counts as zeros
// and gets a zero gradient, so every rank launches the same collectives
// (an expert that received no token) and every optimizer state advances.
// Collective over `mesh`: every rank passes its parameters in the same
// structure (the same placements in the same order). op: Sum or Avg.
void reduce_gradients(const std::vector<Tensor>& params, const DeviceMesh& mesh,
                      const std::vector<std::string>& data_dims, RedOp op = RedOp::Sum);

// The L2 norm of the whole model's gradient: every element of every global
// parameter counted once, whichever ranks hold copies of it (each rank adds
// its squared norms divided by the number of ranks of `mesh` holding the same
// values, and one all_reduce over `mesh` sums them). Gradients must already
// be equal across the dims a parameter is replicated over (after
// reduce_gradients). When max_norm > 0 and the norm exceeds it, every
// gradient is scaled by max_norm / (norm + 1e-6), as
// torch.nn.utils.clip_grad_norm_ does. Returns the norm before clipping.
// Collective over `mesh`; one host read.
double clip_grad_norm(const std::vector<Tensor>& params, const DeviceMesh& mesh, double max_norm);

// The element-wise sum over the ranks of `dims` of `mesh` of host values
// (losses, counts): one all_reduce in f64. Collective over those dims.
std::vector<double> sum_over(const DeviceMesh& mesh, const std::vector<std::string>& dims,
                             const std::vector<double>& values);

}  // namespace tandem
