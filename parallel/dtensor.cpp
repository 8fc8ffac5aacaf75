#include "tandem/parallel/dtensor.h"

#include <fmt/ranges.h>

#include "tandem/autograd/function.h"
#include "tandem/runtime/error.h"
#include "tandem/tensor/ops.h"

namespace tandem {

std::string Placement::str() const {
  switch (kind) {
    case Kind::Shard:
      return fmt::format("Shard({})", dim);
    case Kind::Replicate:
      return "Replicate()";
    case Kind::Partial:
      return fmt::format("Partial({})", red_op_name(op));
  }
  return "?";
}

std::string placements_str(const Placements& p) {
  std::vector<std::string> parts;
  for (const Placement& x : p)
    parts.push_back(x.str());
  return fmt::format("[{}]", fmt::join(parts, ", "));
}

std::pair<int64_t, int64_t> chunk_range(int64_t n, int64_t parts, int64_t index) {
  const int64_t chunk = (n + parts - 1) / parts;
  const int64_t start = std::min(n, index * chunk);
  return {start, std::clamp<int64_t>(n - start, 0, chunk)};
}

namespace {

// Normalises Shard dims and checks the placements fit the mesh and tensor.
Placements normalise(const Placements& p, const DeviceMesh& mesh, int ndim, const char* op) {
  TANDEM_CHECK(static_cast<int>(p.size()) == mesh.ndim(),
               "[parallel::{}] expected one placement per mesh dim ({}), got {} {}", op,
               mesh.ndim(), p.size(), placements_str(p));
  Placements out = p;
  for (Placement& x : out) {
    if (x.is_shard()) x.dim = wrap_dim(x.dim, ndim, op);
  }
  return out;
}

}  // namespace

Shape DTensor::local_shape_for(const Shape& global, const Placements& placements,
                               const DeviceMesh& mesh, std::vector<int64_t> coordinate) {
  if (coordinate.empty()) coordinate = mesh.coordinate();
  Shape local = global;
  for (int m = 0; m < mesh.ndim(); ++m) {
    if (placements[m].is_shard()) {
      int d = static_cast<int>(placements[m].dim);
      local[d] = chunk_range(local[d], mesh.size(m), coordinate[m]).second;
    }
  }
  return local;
}

std::vector<int64_t> DTensor::local_offset_for(const Shape& global, const Placements& placements,
                                               const DeviceMesh& mesh,
                                               std::vector<int64_t> coordinate) {
  if (coordinate.empty()) coordinate = mesh.coordinate();
  Shape extent = global;
  std::vector<int64_t> offset(static_cast<size_t>(global.size()), 0);
  for (int m = 0; m < mesh.ndim(); ++m) {
    if (placements[m].is_shard()) {
      int d = static_cast<int>(placements[m].dim);
      auto [start, len] = chunk_range(extent[d], mesh.size(m), coordinate[m]);
      offset[d] += start;
      extent[d] = len;
    }
  }
  return offset;
}

DTensor DTensor::make(Tensor local, DeviceMesh mesh, Placements placements, Shape global_shape) {
  DTensor t;
  t.local_ = std::move(local);
  t.mesh_ = std::move(mesh);
  t.placements_ = std::move(placements);
  t.global_shape_ = global_shape;
  return t;
}

DTensor DTensor::from_local(const Tensor& local, const DeviceMesh& mesh, Placements placements,
                            std::optional<Shape> global_shape) {
  TANDEM_CHECK(local.defined(), "[parallel::from_local] expected a defined local tensor");
  Placements p = normalise(placements, mesh, local.dim(), "from_local");
  Shape global;
  if (global_shape) {
    global = *global_shape;
    Shape expect = local_shape_for(global, p, mesh);
    TANDEM_CHECK(expect == local.shape(),
                 "[parallel::from_local] expected a local tensor of shape {} for global shape {} "
                 "and placements {} at coordinate [{}], got {}",
                 expect, global, placements_str(p), fmt::join(mesh.coordinate(), ","),
                 local.shape());
  } else {
    // Sum the local extents over each sharding mesh dim, innermost first.
    global = local.shape();
    for (int m = mesh.ndim() - 1; m >= 0; --m) {
      if (!p[m].is_shard()) continue;
      int d = static_cast<int>(p[m].dim);
      Tensor extent =
          ops::full(Shape{1}, static_cast<double>(global[d]), DType::I64, local.device());
      WorkPtr w = mesh.get_group(m)->all_reduce(extent, {RedOp::Sum, "from_local extent"});
      w->synchronize();
      global[d] = w->result().item<int64_t>();
    }
  }
  return make(local, mesh, p, global);
}

DTensor DTensor::distribute(const Tensor& full, const DeviceMesh& mesh, Placements placements) {
  Placements p = normalise(placements, mesh, full.dim(), "distribute");
  const bool wants_grad = requires_grad(full);
  TANDEM_CHECK(!wants_grad || is_leaf(full),
               "[parallel::distribute] expected a leaf tensor or one that does not require grad "
               "(the result is a new leaf), got a non-leaf {} that requires grad (use "
               "from_local and redistribute to stay on the graph)",
               full.shape());
  Tensor local = full;
  std::vector<int64_t> coord = mesh.coordinate();
  Shape extent = full.shape();
  for (int m = 0; m < mesh.ndim(); ++m) {
    if (p[m].is_shard()) {
      int d = static_cast<int>(p[m].dim);
      auto [start, len] = chunk_range(extent[d], mesh.size(m), coord[m]);
      local = ops::narrow(local, d, start, len);
      extent[d] = len;
    } else if (p[m].is_partial() && p[m].op == RedOp::Sum && coord[m] != 0) {
      local = ops::zeros_like(local);  // the sum over the mesh dim is the value
    }
  }
  // A leaf of its own that requires grad when `full` does, as in PyTorch's
  // distribute_tensor: backward() through the DTensor then reaches it.
  Tensor out = detach(ops::contiguous(local));
  if (wants_grad) set_requires_grad(out, true);
  return make(out, mesh, p, full.shape());
}

std::string DTensor::str() const {
  return fmt::format("DTensor(shape={}, local={}, placements={}, mesh={})", global_shape_,
                     local_.defined() ? local_.shape().str() : "undefined",
                     placements_str(placements_), mesh_.str());
}

}  // namespace tandem
