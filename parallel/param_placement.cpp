#include "tandem/parallel/param_placement.h"

#include <fmt/format.h>

#include <algorithm>
#include <memory>

#include "tandem/parallel/placement.h"
#include "tandem/runtime/error.h"
#include "tandem/tensor/ops.h"

namespace tandem {

bool ParamPlacement::split_over(const std::string& mesh_dim) const {
  return std::any_of(splits.begin(), splits.end(),
                     [&](const MeshSplit& s) { return s.mesh_dim == mesh_dim; });
}

std::string ParamPlacement::str() const {
  std::string out;
  for (const MeshSplit& s : splits) {
    out += fmt::format("{}{}: {}", out.empty() ? "" : ", ", s.mesh_dim,
                       s.tensor_dim >= 0 ? fmt::format("Shard({})", s.tensor_dim) : "owned");
  }
  return fmt::format("{{{}}} of {}", out, global_shape.str());
}

namespace {

// The parameter's record, or a fresh one describing it as whole.
ParamPlacement current(const Tensor& param) {
  if (std::shared_ptr<const ParamPlacement> p = param_placement(param)) return *p;
  ParamPlacement fresh;
  fresh.global_shape = param.shape();
  fresh.offsets.assign(static_cast<size_t>(param.dim()), 0);
  return fresh;
}

void add_split(const Tensor& param, ParamPlacement record, MeshSplit split, const char* who) {
  TANDEM_CHECK(!record.split_over(split.mesh_dim),
               "[parallel::{}] expected a parameter not yet split over mesh dim \"{}\", got one "
               "placed as {}",
               who, split.mesh_dim, record.str());
  record.splits.push_back(std::move(split));
  set_leaf_annotation(param, std::make_shared<const ParamPlacement>(std::move(record)));
}

}  // namespace

void record_shard(const Tensor& param, const DeviceMesh& mesh, int64_t tensor_dim,
                  const Shape& global_shape) {
  TANDEM_CHECK(mesh.ndim() == 1, "[parallel::record_shard] expected a 1-D mesh, got {}",
               mesh.str());
  TANDEM_CHECK(tensor_dim >= 0 && tensor_dim < param.dim() && global_shape.size() == param.dim(),
               "[parallel::record_shard] expected a tensor dim in [0, {}) and a global shape of "
               "{} dims, got dim {} and {}",
               param.dim(), param.dim(), tensor_dim, global_shape.str());
  ParamPlacement record = current(param);
  const std::string dim = mesh.dim_names()[0];
  for (const MeshSplit& s : record.splits) {
    TANDEM_CHECK(s.tensor_dim != tensor_dim,
                 "[parallel::record_shard] expected tensor dim {} not yet sharded, got it sharded "
                 "over \"{}\" already (placed as {})",
                 tensor_dim, s.mesh_dim, record.str());
  }
  const auto [start, length] =
      chunk_range(global_shape[tensor_dim], mesh.size(), mesh.get_local_rank(0));
  TANDEM_CHECK(length == param.shape()[tensor_dim],
               "[parallel::record_shard] expected the local shard of {} along dim {} over {} "
               "ranks to have {} elements on rank {}, got {}",
               global_shape.str(), tensor_dim, mesh.size(), length, mesh.get_local_rank(0),
               param.shape()[tensor_dim]);
  record.global_shape[tensor_dim] = global_shape[tensor_dim];
  record.offsets[static_cast<size_t>(tensor_dim)] += start;
  add_split(param, std::move(record), {dim, tensor_dim}, "record_shard");
}

void record_nested_shard(const Tensor& param, const Tensor& whole, const DeviceMesh& mesh,
                         int64_t tensor_dim) {
  TANDEM_CHECK(mesh.ndim() == 1, "[parallel::record_nested_shard] expected a 1-D mesh, got {}",
               mesh.str());
  TANDEM_CHECK(tensor_dim >= 0 && tensor_dim < param.dim() && whole.dim() == param.dim(),
               "[parallel::record_nested_shard] expected a tensor dim in [0, {}) of a block of {} "
               "dims, got dim {} and a block of shape {}",
               param.dim(), param.dim(), tensor_dim, whole.shape().str());
  ParamPlacement record = current(whole);
  const auto [start, length] =
      chunk_range(whole.shape()[tensor_dim], mesh.size(), mesh.get_local_rank(0));
  TANDEM_CHECK(length == param.shape()[tensor_dim],
               "[parallel::record_nested_shard] expected the local chunk of a block of {} along "
               "dim {} over {} ranks to have {} elements on rank {}, got {}",
               whole.shape().str(), tensor_dim, mesh.size(), length, mesh.get_local_rank(0),
               param.shape()[tensor_dim]);
  record.offsets[static_cast<size_t>(tensor_dim)] += start;
  add_split(param, std::move(record), {mesh.dim_names()[0], tensor_dim}, "record_nested_shard");
}

void record_owned(const Tensor& param, const std::string& mesh_dim) {
  add_split(param, current(param), {mesh_dim, -1}, "record_owned");
}

std::shared_ptr<const ParamPlacement> param_placement(const Tensor& param) {
  return std::dynamic_pointer_cast<const ParamPlacement>(leaf_annotation(param));
}

namespace {

// Whether this rank writes a piece of `param`: it is at coordinate 0 of every
// dim of `mesh` the piece is replicated over (all but the parameter's split
// dims and `also_split`).
bool writes_piece(const Tensor& param, const DeviceMesh& mesh, const std::string& also_split) {
  const std::shared_ptr<const ParamPlacement> placement = param_placement(param);
  const std::vector<std::string> names = mesh.dim_names();
  for (size_t d = 0; d < names.size(); ++d) {
    const bool replicated =
        names[d] != also_split && (placement == nullptr || !placement->split_over(names[d]));
    if (replicated && mesh.get_local_rank(static_cast<int>(d)) != 0) return false;
  }
  return true;
}

}  // namespace

TensorPiece placed_piece(const std::string& name, const Tensor& local, const Tensor& param,
                         const DeviceMesh& mesh) {
  TensorPiece piece{name, local, local.shape(),
                    std::vector<int64_t>(static_cast<size_t>(local.dim()), 0)};
  const std::shared_ptr<const ParamPlacement> placement = param_placement(param);
  if (placement && local.shape() == param.shape()) {
    piece.global_shape = placement->global_shape;
    piece.offsets = placement->offsets;
  }
  piece.write = writes_piece(param, mesh, "");
  return piece;
}

TensorPiece placed_rows_piece(const std::string& name, const Tensor& rows, int64_t start,
                              const Tensor& param, const DeviceMesh& mesh,
                              const std::string& split_dim) {
  mesh.dim_index(split_dim);  // names the known dims when it is not one
  const int64_t length = rows.dim() == 0 ? 1 : rows.shape()[0];
  const int64_t n = param.dim() == 0 ? 1 : param.shape()[0];
  TANDEM_CHECK(start >= 0 && start + length <= n,
               "[parallel::placed_rows_piece] expected rows within the {} of '{}', got [{}, {})", n,
               name, start, start + length);
  // The whole local tensor's piece, then its rows' part of it.
  TensorPiece piece = placed_piece(name, param, param, mesh);
  piece.local = param.dim() == 0 ? ops::reshape(rows, {}) : ops::reshape(rows, [&] {
    Shape s = param.shape();
    s[0] = length;
    return s;
  }());
  if (param.dim() > 0) piece.offsets[0] += start;
  piece.write = writes_piece(param, mesh, split_dim);
  return piece;
}

}  // namespace tandem
