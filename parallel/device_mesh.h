// DeviceMesh: an n-dimensional arrangement of the ranks of a world group, with
// named dims and one process group per slice (DESIGN §6).
//
// Note [Mesh groups]
// ~~~~~~~~~~~~~~~~~~
// Groups are created collectively (ProcessGroup::split), so every rank must
// create them in the same order. The constructor creates the group of every
// single dim eagerly, dim by dim and slice by slice in row-major order; groups
// of several dims (slice({"dp","cp"}), flatten) are created when first asked
// for, which every rank must do in the same order — as with
// torch.distributed.device_mesh. All meshes sliced or flattened from one root
// share one cache, so each group is created once and reused.
#pragma once

#include <initializer_list>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tandem/comm/process_group.h"

namespace tandem {

struct MeshState;

class DeviceMesh {
 public:
  DeviceMesh() = default;
  // `ranks`: group ranks of `world` in mesh (row-major) order; empty = 0..n-1.
  // Their count must be the product of `shape` and equal world->size().
  DeviceMesh(ProcessGroupPtr world, std::vector<int64_t> shape, std::vector<std::string> dim_names,
             std::vector<int> ranks = {}, Device device = Device::cpu());

  int ndim() const { return static_cast<int>(dims_.size()); }
  int64_t size() const;  // number of ranks
  int64_t size(const std::string& dim) const;
  int64_t size(int dim) const;
  std::vector<int64_t> shape() const;
  std::vector<std::string> dim_names() const;
  int dim_index(const std::string& name) const;  // error names the known dims
  Device device() const;

  // This rank's coordinate along each dim.
  std::vector<int64_t> coordinate() const;
  int get_local_rank(const std::string& dim) const;
  int get_local_rank(int dim) const;
  // The group of one dim (or of a flattened name); without a name the mesh
  // must be 1-D.
  ProcessGroupPtr get_group(const std::string& dim) const;
  ProcessGroupPtr get_group(int dim) const;
  ProcessGroupPtr get_group() const;
  // The group spanning the named dims together (created on first ask, Note
  // [Mesh groups]); no dims: a group of this rank alone is not a thing, so
  // at least one.
  ProcessGroupPtr group_over(const std::vector<std::string>& dims) const;
  // The root world group and every group created so far from this mesh's
  // root, in creation order: what a failing rank aborts so that its peers
  // stop waiting (DualPipe::abort_on_failure).
  std::vector<ProcessGroupPtr> all_groups() const;

  // The sub-mesh through this rank spanning the named dims, in the order
  // given (non-adjacent dims allowed).
  DeviceMesh slice(const std::string& dim) const;
  DeviceMesh slice(const std::vector<std::string>& dims) const;
  // slice({"a", "c"}): a braced list of names would otherwise also match
  // std::string's iterator-pair constructor.
  DeviceMesh slice(std::initializer_list<std::string> dims) const {
    return slice(std::vector<std::string>(dims));
  }
  // A 1-D mesh over all of this mesh's dims, named `name`; afterwards `name`
  // works in slice()/get_group() of every mesh sharing this root.
  DeviceMesh flatten(const std::string& name) const;

  // Group rank (in the root world group) of the rank at `coordinate`.
  int rank_at(const std::vector<int64_t>& coordinate) const;
  std::string str() const;
  bool operator==(const DeviceMesh& other) const;

 private:
  struct Dim {
    std::string name;
    std::vector<int> root_dims;  // root dims this dim spans (several after flatten)
    int64_t size;
  };
  DeviceMesh(std::shared_ptr<MeshState> state, std::vector<Dim> dims);
  ProcessGroupPtr group_for(const std::vector<int>& root_dims) const;
  std::vector<Dim> resolve(const std::vector<std::string>& names) const;

  std::shared_ptr<MeshState> state_;
  std::vector<Dim> dims_;
};

}  // namespace tandem
