// DTensor: a local tensor plus the mesh, the placements and the global shape
// that say what it is part of (DESIGN §6).
//
// Note [Redistribute gradients]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// redistribute() is differentiable. tandem's autograd runs on local tensors,
// so a gradient carries no placement of its own; the convention is that the
// gradient of a DTensor has the DTensor's placements, except that the
// gradient of a Partial tensor is Replicate (every addend's gradient is the
// full gradient). The backward of redistribute(src -> dst) therefore
// redistributes the gradient from grad(dst) to grad(src): all_gather's
// backward is a local chunk, reduce_scatter's is an all_gather, all_reduce's
// is the identity, all_to_all's is the reverse all_to_all. Sharded ops that
// consume a Replicate input produce a *partial* local gradient for it; the
// DTensor ops and parallel styles of this folder all-reduce it in backward
// (Megatron's "f" operator) so that the convention holds everywhere.
#pragma once

#include <optional>
#include <vector>

#include "tandem/comm/work.h"
#include "tandem/parallel/collectives.h"
#include "tandem/parallel/device_mesh.h"
#include "tandem/parallel/placement.h"
#include "tandem/tensor/tensor.h"

namespace tandem {

class DTensor {
 public:
  DTensor() = default;

  // Wraps this rank's local tensor. Without `global_shape`, shards are
  // assumed to follow chunk semantics and the global extent of each sharded
  // dim is found by summing the local extents over the mesh dim (collective).
  static DTensor from_local(const Tensor& local, const DeviceMesh& mesh, Placements placements,
                            std::optional<Shape> global_shape = std::nullopt);
  // Slices a tensor that every rank holds in full (Replicate/Partial keep or
  // split the values as documented in redistribute). No communication. As
  // PyTorch's distribute_tensor, the local tensor is a new leaf that requires
  // grad when `full` does (`full` must then be a leaf itself); its gradient
  // does not flow back into `full`.
  static DTensor distribute(const Tensor& full, const DeviceMesh& mesh, Placements placements);

  const Tensor& to_local() const { return local_; }
  // Every rank gets the whole tensor (differentiable).
  Tensor full_tensor() const;
  // Differentiable; Note [Redistribute gradients].
  DTensor redistribute(const Placements& placements) const;

  const Shape& shape() const { return global_shape_; }
  Shape local_shape() const { return local_.shape(); }
  const Placements& placements() const { return placements_; }
  const DeviceMesh& mesh() const { return mesh_; }
  bool defined() const { return local_.defined(); }
  std::string str() const;

  // The local shape, and the offset of the local block in the global tensor,
  // of the rank at `coordinate` (this rank's when empty).
  static Shape local_shape_for(const Shape& global, const Placements& placements,
                               const DeviceMesh& mesh, std::vector<int64_t> coordinate = {});
  static std::vector<int64_t> local_offset_for(const Shape& global, const Placements& placements,
                                               const DeviceMesh& mesh,
                                               std::vector<int64_t> coordinate = {});

  // For ops: a DTensor from a local result whose placements and global shape
  // the caller derived (no checks, no communication).
  static DTensor make(Tensor local, DeviceMesh mesh, Placements placements, Shape global_shape);

 private:
  Tensor local_;
  DeviceMesh mesh_;
  Placements placements_;
  Shape global_shape_;
};

// An in-flight redistribution (single-collective plans only): wait() returns
// the result once the collective has completed.
class PendingDTensor {
 public:
  PendingDTensor(DTensor source, Placements target);
  DTensor wait();
  bool ready() const;

 private:
  friend PendingDTensor redistribute_async(const DTensor& x, const Placements& placements);
  DTensor source_;
  Placements target_;
  PendingTensor pending_;
};

// Redistributes `x` asynchronously when its plan is one collective (else the
// redistribution runs synchronously and the result is ready at once).
// Not differentiable (used under no_grad, or wrapped by the caller).
PendingDTensor redistribute_async(const DTensor& x, const Placements& placements);

// The steps redistribute() takes, as text (tests, debug logs).
std::vector<std::string> redistribute_plan(const Shape& global, const Placements& from,
                                           const Placements& to, const DeviceMesh& mesh);

}  // namespace tandem
