// How a parameter is split over a device mesh, recorded on the parameter by
// the parallel style that split it.
//
// Note [Parameter placements]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A style that gives ranks different values of a parameter records it on the
// parameter (a LeafAnnotation, autograd/node.h), per mesh dim:
//   Shard(d)  each rank of the dim holds one chunk (chunk_range) of one whole
//             tensor along tensor dim d: tensor parallelism's colwise
//             (weight and bias: d = 0) and rowwise (weight: d = 1) styles;
//   owned     the whole tensor lives on one rank of the dim and no other:
//             the experts kept by expert parallelism.
// Every mesh dim not listed holds identical copies (Replicate), and so does
// every dim of a parameter with no record. Mesh dims are named as in the mesh
// the style was given; its slices keep the root mesh's names, so a record
// made on the "tp" slice is read against the whole ("dp", "ep", "cp", "tp")
// mesh. What reads the records, and never a parameter's name or shape:
//   reduce_gradients   sums a gradient over the data dims it is replicated over
//                      (parallel/data_parallel.h);
//   clip_grad_norm     counts each element of the global parameter once;
//   placed_piece       a checkpoint piece's global shape and offsets, and
//                      which copy writes it.
// Module::to keeps the record; Module::set_parameter installs a new leaf
// without one, so a style records after installing.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tandem/autograd/node.h"
#include "tandem/parallel/checkpoint.h"
#include "tandem/parallel/device_mesh.h"

namespace tandem {

struct MeshSplit {
  std::string mesh_dim;
  int64_t tensor_dim = -1;  // >= 0: Shard(tensor_dim); -1: owned whole by one rank
};

struct ParamPlacement final : LeafAnnotation {
  std::vector<MeshSplit> splits;  // the dims with different values per rank
  Shape global_shape;             // of the whole parameter
  std::vector<int64_t> offsets;   // of this rank's block in it, per tensor dim

  bool split_over(const std::string& mesh_dim) const;
  std::string str() const;
};

// Records that `param` (the local shard a style just installed) is chunk
// `mesh`'s local rank of a tensor of `global_shape` split along `tensor_dim`
// over the 1-D `mesh`. Adds to an earlier record of another mesh dim (a
// second split along the same tensor dim throws).
void record_shard(const Tensor& param, const DeviceMesh& mesh, int64_t tensor_dim,
                  const Shape& global_shape);
// Records that `param` is chunk `mesh`'s local rank, along `tensor_dim`, of
// the block `whole` that this rank held before (with whole's record, if
// any): a split nested inside an earlier one, as FSDP's rows of a
// tensor-parallel shard. The rank's block of the global tensor stays
// contiguous, at whole's offset plus the chunk's start; the record lists
// both mesh dims along that tensor dim.
void record_nested_shard(const Tensor& param, const Tensor& whole, const DeviceMesh& mesh,
                         int64_t tensor_dim);
// Records that `param` exists whole on this rank only, among the ranks of
// mesh dim `mesh_dim`.
void record_owned(const Tensor& param, const std::string& mesh_dim);
// The record of `param`; null when it has none (replicated over every dim).
std::shared_ptr<const ParamPlacement> param_placement(const Tensor& param);

// A checkpoint piece (parallel/checkpoint.h) named `name` for `local`: the
// parameter `param` itself or a tensor of its optimizer state. A tensor of
// the parameter's shape takes the parameter's global shape and offsets; any
// other (a step count) is whole. Written by the copy at coordinate 0 of
// every dim of `mesh` the parameter is replicated over.
TensorPiece placed_piece(const std::string& name, const Tensor& local, const Tensor& param,
                         const DeviceMesh& mesh);
// The same for rows [start, start + rows.shape()[0]) of the parameter's
// local tensor (dim 0; a 0-d parameter is one row), a block that each rank
// of `split_dim` holds its own of (ZeRO-1's optimizer state, Note [ZeRO-1]):
// written by every rank of that dim.
TensorPiece placed_rows_piece(const std::string& name, const Tensor& rows, int64_t start,
                              const Tensor& param, const DeviceMesh& mesh,
                              const std::string& split_dim);

}  // namespace tandem
