#include "tandem/parallel/device_mesh.h"

#include <fmt/ranges.h>

#include <algorithm>
#include <mutex>
#include <numeric>
#include <set>

#include "tandem/runtime/error.h"

namespace tandem {

struct MeshState {
  ProcessGroupPtr world;
  std::vector<int64_t> shape;       // root shape
  std::vector<std::string> names;   // root dim names
  std::vector<int> ranks;           // root position (row-major) -> world group rank
  std::vector<int64_t> coordinate;  // this rank's root coordinate
  Device device;
  std::mutex mu;
  std::map<std::vector<int>, ProcessGroupPtr> groups;  // by ordered root dims
  std::vector<ProcessGroupPtr> created;                // the same, in creation order
  std::map<std::string, std::vector<int>> flattened;   // name -> root dims

  int64_t position(const std::vector<int64_t>& coord) const {
    int64_t p = 0;
    for (size_t d = 0; d < shape.size(); ++d)
      p = p * shape[d] + coord[d];
    return p;
  }
};

namespace {

int64_t product(const std::vector<int64_t>& v) {
  return std::accumulate(v.begin(), v.end(), int64_t{1}, std::multiplies<>());
}

}  // namespace

DeviceMesh::DeviceMesh(ProcessGroupPtr world, std::vector<int64_t> shape,
                       std::vector<std::string> dim_names, std::vector<int> ranks, Device device) {
  TANDEM_CHECK(world != nullptr, "[parallel::DeviceMesh] expected a world group, got null");
  TANDEM_CHECK(!shape.empty() && shape.size() == dim_names.size(),
               "[parallel::DeviceMesh] expected one name per dim, got shape {} and names [{}]",
               fmt::join(shape, ","), fmt::join(dim_names, ","));
  std::set<std::string> seen;
  for (const std::string& n : dim_names) {
    TANDEM_CHECK(!n.empty() && seen.insert(n).second,
                 "[parallel::DeviceMesh] expected distinct non-empty dim names, got [{}]",
                 fmt::join(dim_names, ","));
  }
  for (int64_t s : shape) {
    TANDEM_CHECK(s >= 1, "[parallel::DeviceMesh] expected positive dim sizes, got [{}]",
                 fmt::join(shape, ","));
  }
  const int64_t n = product(shape);
  TANDEM_CHECK(n == world->size(),
               "[parallel::DeviceMesh] expected a mesh of the world's {} ranks, got shape [{}] "
               "with {} ranks",
               world->size(), fmt::join(shape, ","), n);
  if (ranks.empty()) {
    ranks.resize(static_cast<size_t>(n));
    std::iota(ranks.begin(), ranks.end(), 0);
  }
  std::vector<int> sorted = ranks;
  std::sort(sorted.begin(), sorted.end());
  bool permutation = static_cast<int64_t>(ranks.size()) == n;
  for (size_t i = 0; permutation && i < sorted.size(); ++i)
    permutation = sorted[i] == static_cast<int>(i);
  TANDEM_CHECK(permutation,
               "[parallel::DeviceMesh] expected the ranks to be a permutation of 0..{}, got [{}]",
               n - 1, fmt::join(ranks, ","));
  auto state = std::make_shared<MeshState>();
  state->world = world;
  state->shape = shape;
  state->names = dim_names;
  state->ranks = ranks;
  state->device = device;
  int64_t my_position = std::find(ranks.begin(), ranks.end(), world->rank()) - ranks.begin();
  state->coordinate.resize(shape.size());
  for (int d = static_cast<int>(shape.size()) - 1; d >= 0; --d) {
    state->coordinate[d] = my_position % shape[d];
    my_position /= shape[d];
  }
  state_ = state;
  for (size_t d = 0; d < shape.size(); ++d) {
    dims_.push_back(Dim{dim_names[d], {static_cast<int>(d)}, shape[d]});
  }
  // Note [Mesh groups]: every single-dim group, eagerly and in order.
  for (size_t d = 0; d < shape.size(); ++d)
    group_for({static_cast<int>(d)});
}

DeviceMesh::DeviceMesh(std::shared_ptr<MeshState> state, std::vector<Dim> dims)
    : state_(std::move(state)), dims_(std::move(dims)) {}

int64_t DeviceMesh::size() const {
  int64_t n = 1;
  for (const Dim& d : dims_)
    n *= d.size;
  return n;
}

int64_t DeviceMesh::size(const std::string& dim) const {
  return dims_[dim_index(dim)].size;
}
int64_t DeviceMesh::size(int dim) const {
  TANDEM_CHECK(dim >= 0 && dim < ndim(), "[parallel::DeviceMesh] expected dim in [0, {}), got {}",
               ndim(), dim);
  return dims_[dim].size;
}

std::vector<int64_t> DeviceMesh::shape() const {
  std::vector<int64_t> s;
  for (const Dim& d : dims_)
    s.push_back(d.size);
  return s;
}

std::vector<std::string> DeviceMesh::dim_names() const {
  std::vector<std::string> n;
  for (const Dim& d : dims_)
    n.push_back(d.name);
  return n;
}

Device DeviceMesh::device() const {
  return state_->device;
}

int DeviceMesh::dim_index(const std::string& name) const {
  for (int i = 0; i < ndim(); ++i) {
    if (dims_[i].name == name) return i;
  }
  TANDEM_FAIL("[parallel::DeviceMesh] expected one of the dims [{}], got \"{}\"",
              fmt::join(dim_names(), ","), name);
}

std::vector<int64_t> DeviceMesh::coordinate() const {
  std::vector<int64_t> c;
  for (const Dim& d : dims_) {
    int64_t index = 0;
    for (int r : d.root_dims)
      index = index * state_->shape[r] + state_->coordinate[r];
    c.push_back(index);
  }
  return c;
}

int DeviceMesh::get_local_rank(const std::string& dim) const {
  return get_local_rank(dim_index(dim));
}
int DeviceMesh::get_local_rank(int dim) const {
  TANDEM_CHECK(dim >= 0 && dim < ndim(), "[parallel::DeviceMesh] expected dim in [0, {}), got {}",
               ndim(), dim);
  return static_cast<int>(coordinate()[dim]);
}

ProcessGroupPtr DeviceMesh::get_group(const std::string& dim) const {
  return group_for(resolve({dim})[0].root_dims);
}

ProcessGroupPtr DeviceMesh::get_group(int dim) const {
  TANDEM_CHECK(dim >= 0 && dim < ndim(), "[parallel::DeviceMesh] expected dim in [0, {}), got {}",
               ndim(), dim);
  return group_for(dims_[dim].root_dims);
}

ProcessGroupPtr DeviceMesh::get_group() const {
  TANDEM_CHECK(ndim() == 1,
               "[parallel::DeviceMesh] expected a dim name for the group of a {}-D mesh [{}] "
               "(ambiguous without one)",
               ndim(), fmt::join(dim_names(), ","));
  return group_for(dims_[0].root_dims);
}

ProcessGroupPtr DeviceMesh::group_over(const std::vector<std::string>& dims) const {
  TANDEM_CHECK(!dims.empty(), "[parallel::DeviceMesh] expected at least one dim for a group");
  std::vector<int> root_dims;
  for (const Dim& d : resolve(dims))
    root_dims.insert(root_dims.end(), d.root_dims.begin(), d.root_dims.end());
  return group_for(root_dims);
}

std::vector<ProcessGroupPtr> DeviceMesh::all_groups() const {
  TANDEM_CHECK(state_ != nullptr, "[parallel::DeviceMesh] expected a constructed mesh");
  std::lock_guard<std::mutex> lock(state_->mu);
  std::vector<ProcessGroupPtr> out{state_->world};
  out.insert(out.end(), state_->created.begin(), state_->created.end());
  return out;
}

std::vector<DeviceMesh::Dim> DeviceMesh::resolve(const std::vector<std::string>& names) const {
  std::vector<Dim> out;
  std::set<int> used;
  for (const std::string& name : names) {
    const Dim* found = nullptr;
    for (const Dim& d : dims_) {
      if (d.name == name) found = &d;
    }
    Dim flat;
    if (found == nullptr) {
      std::lock_guard<std::mutex> lock(state_->mu);
      auto it = state_->flattened.find(name);
      if (it != state_->flattened.end()) {
        int64_t size = 1;
        for (int r : it->second)
          size *= state_->shape[r];
        flat = Dim{name, it->second, size};
        found = &flat;
      }
    }
    TANDEM_CHECK(found != nullptr,
                 "[parallel::DeviceMesh] expected one of the dims [{}], got \"{}\"",
                 fmt::join(dim_names(), ","), name);
    for (int r : found->root_dims) {
      TANDEM_CHECK(used.insert(r).second,
                   "[parallel::DeviceMesh] expected each dim once in a slice, got [{}]",
                   fmt::join(names, ","));
    }
    out.push_back(*found);
  }
  return out;
}

DeviceMesh DeviceMesh::slice(const std::string& dim) const {
  return slice(std::vector<std::string>{dim});
}

DeviceMesh DeviceMesh::slice(const std::vector<std::string>& dims) const {
  TANDEM_CHECK(!dims.empty(), "[parallel::DeviceMesh] expected at least one dim to slice");
  return DeviceMesh(state_, resolve(dims));
}

DeviceMesh DeviceMesh::flatten(const std::string& name) const {
  std::vector<int> root_dims;
  for (const Dim& d : dims_)
    root_dims.insert(root_dims.end(), d.root_dims.begin(), d.root_dims.end());
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    for (const std::string& n : state_->names) {
      TANDEM_CHECK(n != name,
                   "[parallel::DeviceMesh::flatten] expected a new name, got \"{}\" "
                   "(a dim of the mesh)",
                   name);
    }
    auto it = state_->flattened.find(name);
    TANDEM_CHECK(it == state_->flattened.end() || it->second == root_dims,
                 "[parallel::DeviceMesh::flatten] expected a new name, got \"{}\" (already "
                 "flattened from other dims)",
                 name);
    state_->flattened[name] = root_dims;
  }
  int64_t size = 1;
  for (int r : root_dims)
    size *= state_->shape[r];
  DeviceMesh flat(state_, {Dim{name, root_dims, size}});
  flat.get_group();  // create its group now, in program order
  return flat;
}

ProcessGroupPtr DeviceMesh::group_for(const std::vector<int>& root_dims) const {
  MeshState& s = *state_;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    auto it = s.groups.find(root_dims);
    if (it != s.groups.end()) return it->second;
  }
  // Enumerate every slice spanning root_dims in row-major order of the other
  // dims; each slice lists its members row-major over root_dims (in order).
  const int nd = static_cast<int>(s.shape.size());
  std::vector<int> others;
  for (int d = 0; d < nd; ++d) {
    if (std::find(root_dims.begin(), root_dims.end(), d) == root_dims.end()) others.push_back(d);
  }
  int64_t n_slices = 1, n_members = 1;
  for (int d : others)
    n_slices *= s.shape[d];
  for (int d : root_dims)
    n_members *= s.shape[d];
  std::string label;
  for (int d : root_dims)
    label += (label.empty() ? "" : "+") + s.names[d];
  ProcessGroupPtr mine;
  std::vector<int64_t> coord(static_cast<size_t>(nd));
  for (int64_t sl = 0; sl < n_slices; ++sl) {
    int64_t rem = sl;
    for (int i = static_cast<int>(others.size()) - 1; i >= 0; --i) {
      coord[others[i]] = rem % s.shape[others[i]];
      rem /= s.shape[others[i]];
    }
    std::vector<int> members;
    for (int64_t m = 0; m < n_members; ++m) {
      int64_t r = m;
      for (int i = static_cast<int>(root_dims.size()) - 1; i >= 0; --i) {
        coord[root_dims[i]] = r % s.shape[root_dims[i]];
        r /= s.shape[root_dims[i]];
      }
      members.push_back(s.ranks[s.position(coord)]);
    }
    ProcessGroupPtr g = s.world->split(members, fmt::format("{}[{}]", label, sl));
    if (g) mine = g;
  }
  TANDEM_INTERNAL_ASSERT(mine != nullptr, "this rank is in no slice of its own mesh");
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.groups.emplace(root_dims, mine).second) s.created.push_back(mine);
  return s.groups[root_dims];
}

int DeviceMesh::rank_at(const std::vector<int64_t>& coordinate) const {
  TANDEM_CHECK(static_cast<int>(coordinate.size()) == ndim(),
               "[parallel::DeviceMesh::rank_at] expected {} coordinates, got {}", ndim(),
               coordinate.size());
  std::vector<int64_t> root = state_->coordinate;
  for (int i = 0; i < ndim(); ++i) {
    TANDEM_CHECK(coordinate[i] >= 0 && coordinate[i] < dims_[i].size,
                 "[parallel::DeviceMesh::rank_at] expected coordinate {} in [0, {}), got {}", i,
                 dims_[i].size, coordinate[i]);
    int64_t rem = coordinate[i];
    const auto& rd = dims_[i].root_dims;
    for (int j = static_cast<int>(rd.size()) - 1; j >= 0; --j) {
      root[rd[j]] = rem % state_->shape[rd[j]];
      rem /= state_->shape[rd[j]];
    }
  }
  return state_->ranks[state_->position(root)];
}

std::string DeviceMesh::str() const {
  std::vector<std::string> parts;
  for (const Dim& d : dims_)
    parts.push_back(fmt::format("{}={}", d.name, d.size));
  return fmt::format("DeviceMesh({})", fmt::join(parts, ", "));
}

bool DeviceMesh::operator==(const DeviceMesh& other) const {
  if (state_ != other.state_ || dims_.size() != other.dims_.size()) return false;
  for (size_t i = 0; i < dims_.size(); ++i) {
    if (dims_[i].root_dims != other.dims_[i].root_dims) return false;
  }
  return true;
}

}  // namespace tandem
