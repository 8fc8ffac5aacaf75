#include "tandem/parallel/fsdp.h"

#include <algorithm>
#include <optional>
#include <set>
#include <utility>

#include "tandem/autograd/checkpoint.h"
#include "tandem/autograd/grad_ready.h"
#include "tandem/autograd/node.h"
#include "tandem/parallel/param_placement.h"
#include "tandem/parallel/placement.h"
#include "tandem/runtime/error.h"
#include "tandem/tensor/ops.h"
#include "tandem/tensor/storage.h"

namespace tandem {

// One group of Note [FSDP]. Every field is guarded by the owner's mutex.
struct FullyShardedDataParallel::Group {
  enum class State { Sharded, Gathered, Released };
  struct Param {
    std::string name;   // dotted, from the root
    Module* owner;      // kept alive by the root
    std::string local;  // the owner's own name for it
    Shape shape;        // whole
    int64_t rows = 0, chunk = 0, row_numel = 0, local_rows = 0;
    int64_t offset = 0;  // in a rank's packed block, in elements
    Tensor shard;        // the leaf the optimizer holds
    Tensor full;         // this step's gathered leaf; undefined when none
    int ready_hook = -1;
    bool ready = false;
  };
  std::string name;
  std::shared_ptr<Module> module;
  std::vector<Param> params;
  int64_t packed = 0;  // elements per rank
  DType dtype = DType::F32;
  Device device;
  State state = State::Sharded;
  WorkPtr gather;                // in flight
  std::vector<WorkPtr> reduces;  // one per backward since the last finish()
  bool launched = false;         // in the current round (one backward's worth)
  int ready = 0;
  int pre_index = -1, post_index = -1;  // in the recorded forward orders
  bool graph = false;                   // the last forward recorded a graph (grad mode on)
};

namespace {

using Group = FullyShardedDataParallel::Group;

// Copies parameter `p`'s rows of every rank out of a gathered (W * packed)
// buffer into `whole` (its full shape), one copy per rank: no intermediate of
// the whole's size.
void copy_from_ranks(const Group& g, const Group::Param& p, const Tensor& gathered,
                     const Tensor& whole, int64_t world) {
  const Tensor blocks = ops::reshape(gathered, {world, g.packed});
  const Tensor rows = ops::reshape(whole, {p.rows, p.row_numel});
  for (int64_t r = 0; r < world; ++r) {
    const auto [start, length] = chunk_range(p.rows, world, r);
    if (length == 0) continue;
    const Tensor src = ops::narrow(ops::narrow(blocks, 0, r, 1), 1, p.offset, length * p.row_numel);
    ops::copy_(ops::narrow(rows, 0, start, length), ops::reshape(src, {length, p.row_numel}));
  }
}

// The inverse for gradients: rank r's block of `packed` (W, packed) gets
// rows [r * chunk, (r + 1) * chunk) of `whole` (the padding stays zero).
void copy_to_ranks(const Group::Param& p, const Tensor& whole, const Tensor& packed,
                   int64_t world) {
  const Tensor rows = ops::reshape(whole, {p.rows, p.row_numel});
  for (int64_t r = 0; r < world; ++r) {
    const auto [start, length] = chunk_range(p.rows, world, r);
    if (length == 0) continue;
    const Tensor dst = ops::narrow(ops::narrow(packed, 0, r, 1), 1, p.offset, length * p.row_numel);
    ops::copy_(dst, ops::reshape(ops::narrow(rows, 0, start, length), {1, length * p.row_numel}));
  }
}

// The leaf `owner` holds as its own parameter `local`.
Tensor own_parameter(Module& owner, const std::string& local) {
  for (auto& [n, t] : owner.named_parameters()) {
    if (n == local) return t;
  }
  TANDEM_FAIL("[parallel::FSDP] internal: {} lost its parameter '{}'", owner.type_name(), local);
}

}  // namespace

FullyShardedDataParallel::FullyShardedDataParallel(
    std::shared_ptr<Module> root, const std::vector<std::shared_ptr<Module>>& blocks,
    const DeviceMesh& mesh, FSDPOptions options)
    : root_(std::move(root)), options_(std::move(options)) {
  TANDEM_CHECK(root_ != nullptr, "[parallel::FSDP] expected a root module, got null");
  TANDEM_CHECK(options_.op == RedOp::Sum || options_.op == RedOp::Avg,
               "[parallel::FSDP] expected RedOp Sum or Avg, got {}", red_op_name(options_.op));
  const std::vector<std::string> dims = mesh.dim_names();
  if (options_.shard_dim.empty()) {
    TANDEM_CHECK(mesh.ndim() == 1 || mesh.ndim() == 2,
                 "[parallel::FSDP] expected a 1-D mesh (shard) or a 2-D one (replicate, shard) "
                 "when no dims are named, got {}",
                 mesh.str());
    options_.shard_dim = dims.back();
    if (mesh.ndim() == 2 && options_.replicate_dim.empty()) options_.replicate_dim = dims[0];
  }
  mesh.dim_index(options_.shard_dim);  // names the known dims when it is not one
  TANDEM_CHECK(options_.replicate_dim != options_.shard_dim,
               "[parallel::FSDP] expected different shard and replicate dims, got \"{}\" twice",
               options_.shard_dim);
  shard_mesh_ = mesh.slice(options_.shard_dim);
  shard_group_ = shard_mesh_.get_group();
  if (!options_.replicate_dim.empty() && mesh.size(options_.replicate_dim) > 1)
    replicate_group_ = mesh.get_group(options_.replicate_dim);

  std::vector<std::pair<std::string, std::shared_ptr<Module>>> all = root_->named_modules();
  std::vector<Module*> block_ptrs;
  std::vector<std::string> block_names;
  for (const std::shared_ptr<Module>& b : blocks) {
    auto it = std::find_if(all.begin(), all.end(), [&](const auto& e) { return e.second == b; });
    TANDEM_CHECK(b != nullptr && it != all.end() && b != root_,
                 "[parallel::FSDP] expected every block to be a module inside the root, got {}",
                 b == nullptr ? "null"
                 : b == root_ ? "the root itself"
                              : b->type_name());
    TANDEM_CHECK(std::find(block_ptrs.begin(), block_ptrs.end(), b.get()) == block_ptrs.end(),
                 "[parallel::FSDP] expected each block once, got '{}' twice", it->first);
    block_ptrs.push_back(b.get());
    block_names.push_back(it->first);
  }
  for (size_t i = 0; i < blocks.size(); ++i)
    build_group(block_names[i], blocks[i], block_ptrs);
  build_group("", root_, block_ptrs);

  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    Group& g = *groups_[gi];
    handles_.push_back(g.module->register_forward_pre_hook(
        [this, gi](Module&, const Args&) -> std::optional<Args> {
          before_forward(*groups_[gi]);
          return std::nullopt;
        }));
    handles_.push_back(g.module->register_forward_hook(
        [this, gi](Module&, const Args&,
                   const std::vector<Tensor>&) -> std::optional<std::vector<Tensor>> {
          after_forward(*groups_[gi]);
          return std::nullopt;
        }));
    handles_.push_back(g.module->register_full_backward_pre_hook(
        [this, gi](Module&, const std::vector<Tensor>&) -> std::optional<std::vector<Tensor>> {
          before_backward(*groups_[gi]);
          return std::nullopt;
        }));
  }
}

FullyShardedDataParallel::~FullyShardedDataParallel() {
  for (HookHandle& h : handles_)
    h.remove();
  for (auto& g : groups_) {
    for (Group::Param& p : g->params) {
      if (p.ready_hook >= 0) remove_grad_ready_hook(p.ready_hook);
    }
  }
}

void FullyShardedDataParallel::build_group(const std::string& name,
                                           const std::shared_ptr<Module>& module,
                                           const std::vector<Module*>& blocks) {
  auto g = std::make_unique<Group>();
  g->name = name.empty() ? "root" : name;
  g->module = module;
  const int64_t world = shard_group_->size(), rank = shard_group_->rank();
  std::vector<std::string> skipped;  // paths of blocks below this group's module
  for (auto& [path, m] : module->named_modules()) {
    if (m != module && std::find(blocks.begin(), blocks.end(), m.get()) != blocks.end()) {
      skipped.push_back(path + ".");
      continue;
    }
    const std::string& where = path;  // a structured binding: clang 14 cannot capture it
    if (std::any_of(skipped.begin(), skipped.end(),
                    [&](const std::string& s) { return where.rfind(s, 0) == 0; }))
      continue;
    for (auto& [local, t] : m->named_parameters()) {
      if (local.find('.') != std::string::npos) continue;  // a child's
      Group::Param p;
      const std::string prefix = name.empty() ? "" : name + ".";
      p.name = prefix + (path.empty() ? "" : path + ".") + local;
      p.owner = m.get();
      p.local = local;
      p.shape = t.shape();
      TANDEM_CHECK(t.dim() > 0,
                   "[parallel::FSDP] expected parameters of at least one dim to shard along dim "
                   "0, got '{}' of shape {}",
                   p.name, t.shape());
      std::shared_ptr<const ParamPlacement> placed = param_placement(t);
      // Tensor parallelism's colwise style split dim 0 already: the rows
      // are a nested split of that shard (Note [FSDP]).
      const bool dim0_split =
          placed != nullptr && std::any_of(placed->splits.begin(), placed->splits.end(),
                                           [](const MeshSplit& s) { return s.tensor_dim == 0; });
      if (g->params.empty()) {
        g->dtype = t.dtype();
        g->device = t.device();
      }
      TANDEM_CHECK(t.dtype() == g->dtype && t.device() == g->device,
                   "[parallel::FSDP] expected one dtype and device per group, got '{}' as {} on "
                   "{} in group '{}' of {} on {}",
                   p.name, dtype_name(t.dtype()), t.device(), g->name, dtype_name(g->dtype),
                   g->device);
      p.rows = t.shape()[0];
      p.row_numel = 1;
      for (int d = 1; d < t.dim(); ++d)
        p.row_numel *= t.shape()[d];
      const auto [start, length] = chunk_range(p.rows, world, rank);
      p.chunk = (p.rows + world - 1) / world;
      p.local_rows = length;
      p.offset = g->packed;
      g->packed += p.chunk * p.row_numel;
      // The shard: its rows of the whole, as a new leaf with the whole's
      // placement record and the split along dim 0 over the shard dim.
      m->set_parameter(local, ops::clone(ops::narrow(t, 0, start, length)));
      p.shard = own_parameter(*m, local);
      if (dim0_split) {
        record_nested_shard(p.shard, t, shard_mesh_, 0);
      } else {
        if (placed != nullptr) set_leaf_annotation(p.shard, placed);
        record_shard(p.shard, shard_mesh_, 0, placed != nullptr ? placed->global_shape : t.shape());
      }
      g->params.push_back(std::move(p));
    }
  }
  if (!g->params.empty()) groups_.push_back(std::move(g));
}

// ---- gathering ----

void FullyShardedDataParallel::launch_gather(Group& g) {
  NoGradGuard no_grad;
  Tensor flat = ops::zeros({g.packed}, g.dtype, g.device);
  for (const Group::Param& p : g.params) {
    if (p.local_rows == 0) continue;
    ops::copy_(ops::narrow(flat, 0, p.offset, p.local_rows * p.row_numel),
               ops::reshape(p.shard, {p.local_rows * p.row_numel}));
  }
  if (g.packed == 0) {  // every parameter empty: nothing to move
    g.gather = std::make_shared<Work>("fsdp all_gather " + g.name);
    g.gather->set_outputs({ops::zeros({0}, g.dtype, g.device)});
    g.gather->finish();
    return;
  }
  g.gather = shard_group_->all_gather(flat, {0, "fsdp all_gather " + g.name});
  g.gather->progress_in_background();
}

// Launches `g`'s all-gather ahead of the hook that will need it, when `g` is
// sharded and has none in flight.
void FullyShardedDataParallel::prefetch(Group* g) {
  if (g == nullptr || g->gather != nullptr || g->state == Group::State::Gathered) return;
  launch_gather(*g);
  ++prefetches_;
}

// Waits for `g`'s all-gather (launching it first when nobody prefetched it)
// and puts the whole parameters in place: fresh leaves installed in the
// modules (`fresh`, the forward), or the released memory of this step's
// leaves restored and filled (the backward).
void FullyShardedDataParallel::wait_gather(Group& g, bool fresh) {
  if (g.gather == nullptr) launch_gather(g);
  WorkPtr work = std::move(g.gather);
  work->wait();
  const Tensor gathered = work->result();
  NoGradGuard no_grad;
  const int64_t world = shard_group_->size();
  for (size_t i = 0; i < g.params.size(); ++i) {
    Group::Param& p = g.params[i];
    if (!fresh) {
      restore_storage(p.full);
      copy_from_ranks(g, p, gathered, p.full, world);
      continue;
    }
    if (p.ready_hook >= 0) remove_grad_ready_hook(p.ready_hook);  // a forward without backward
    Tensor whole = ops::zeros(p.shape, g.dtype, g.device);
    copy_from_ranks(g, p, gathered, whole, world);
    p.owner->set_parameter(p.local, whole);
    p.full = own_parameter(*p.owner, p.local);
    p.ready = false;
    p.ready_hook =
        register_grad_ready_hook(p.full, [this, &g, i](const Tensor&) { on_ready(g, i); });
  }
  g.ready = 0;
  g.state = Group::State::Gathered;
}

// ---- the hooks ----

void FullyShardedDataParallel::before_forward(Group& g) {
  std::lock_guard<std::mutex> lock(mu_);
  if (is_recomputing()) return;
  // A new forward after a backward (gradient accumulation: micro-batch i + 1
  // after micro-batch i's backward): that backward's round ends here, on
  // every rank at the same point, before its whole leaves are replaced (a
  // group it holds may still be gathered for its backward).
  if (g.pre_index == 0) flush_round();
  if (g.state == Group::State::Gathered) return;
  TANDEM_CHECK(g.state != Group::State::Released || !g.graph,
               "[parallel::FSDP] expected the backward of group '{}''s last forward (and "
               "finish()) before its next forward, got a second forward: its first graph "
               "would find the gathered parameters gone (evaluate under NoGradGuard)",
               g.name);
  g.graph = grad_mode_enabled();
  if (g.pre_index < 0) {
    g.pre_index = static_cast<int>(pre_order_.size());
    pre_order_.push_back(&g);
  }
  wait_gather(g, /*fresh=*/true);
  // Prefetch the next group of the first forward's order.
  if (pre_order_.size() == groups_.size() && g.pre_index + 1 < static_cast<int>(groups_.size()))
    prefetch(pre_order_[static_cast<size_t>(g.pre_index + 1)]);
}

void FullyShardedDataParallel::after_forward(Group& g) {
  std::lock_guard<std::mutex> lock(mu_);
  if (is_recomputing()) return;
  if (g.post_index < 0) {
    g.post_index = static_cast<int>(post_order_.size());
    post_order_.push_back(&g);
  }
  if (!options_.reshard_after_forward || g.state != Group::State::Gathered) return;
  // The last group to finish its forward is the first the backward needs:
  // releasing it would only gather it again at once.
  if (post_order_.size() == groups_.size() && g.post_index == static_cast<int>(groups_.size()) - 1)
    return;
  for (Group::Param& p : g.params) {
    p.owner->assign_parameter(p.local, p.shard);
    release_storage(p.full);
  }
  g.state = Group::State::Released;
}

void FullyShardedDataParallel::before_backward(Group& g) {
  std::lock_guard<std::mutex> lock(mu_);
  if (g.state == Group::State::Released) wait_gather(g, /*fresh=*/false);
  // The backward meets the groups in reverse forward-hook order: prefetch
  // the one before this group in it.
  if (post_order_.size() == groups_.size() && g.post_index > 0)
    prefetch(post_order_[static_cast<size_t>(g.post_index - 1)]);
}

void FullyShardedDataParallel::on_ready(Group& g, size_t param) {
  std::lock_guard<std::mutex> lock(mu_);
  Group::Param& p = g.params[param];
  if (p.ready) return;
  p.ready = true;
  ++g.ready;
  round_active_ = true;
  launch_ready_reduces();
}

// ---- reducing ----

// Strictly in reverse pre-hook order (Note [FSDP]), once that order is known.
void FullyShardedDataParallel::launch_ready_reduces() {
  if (pre_order_.size() != groups_.size()) return;
  while (next_reduce_ < pre_order_.size()) {
    Group& g = *pre_order_[pre_order_.size() - 1 - next_reduce_];
    if (g.ready < static_cast<int>(g.params.size())) return;
    launch_reduce(g);
    ++next_reduce_;
  }
}

void FullyShardedDataParallel::launch_reduce(Group& g) {
  NoGradGuard no_grad;
  const int64_t world = shard_group_->size();
  // By destination rank: rank r's block holds rows [r * chunk, (r + 1) *
  // chunk) of every parameter's gradient, zero-padded, in group order.
  const DType reduce_dtype = options_.reduce_dtype.value_or(g.dtype);
  Tensor packed = ops::zeros({world, g.packed}, reduce_dtype, g.device);
  for (Group::Param& p : g.params) {
    const Tensor gfull = p.full.defined() ? grad(p.full) : Tensor();
    if (gfull.defined()) copy_to_ranks(p, gfull, packed, world);
  }
  if (g.packed == 0) {
    g.reduces.push_back(std::make_shared<Work>("fsdp reduce_scatter " + g.name));
    g.reduces.back()->set_outputs({ops::zeros({0}, reduce_dtype, g.device)});
    g.reduces.back()->finish();
  } else {
    g.reduces.push_back(
        shard_group_->reduce_scatter(ops::reshape(packed, {world * g.packed}),
                                     {options_.op, 0, "fsdp reduce_scatter " + g.name}));
    g.reduces.back()->progress_in_background();
  }
  g.launched = true;
  g.ready = 0;
  for (Group::Param& p : g.params)
    p.ready = false;
  // The whole parameters and their gradients are done with.
  for (Group::Param& p : g.params) {
    if (p.ready_hook >= 0) remove_grad_ready_hook(p.ready_hook);
    p.ready_hook = -1;
    if (!p.full.defined()) continue;
    zero_grad(p.full);
    p.owner->assign_parameter(p.local, p.shard);
    if (g.state == Group::State::Gathered) release_storage(p.full);
    p.full = Tensor();
  }
  g.state = Group::State::Sharded;
}

// Ends a round: launches what it still holds, in reverse pre-hook order,
// then any group the forward never reached, in construction order.
void FullyShardedDataParallel::flush_round() {
  if (!round_active_) return;
  for (size_t k = next_reduce_; k < pre_order_.size(); ++k) {
    Group& g = *pre_order_[pre_order_.size() - 1 - k];
    if (!g.launched) launch_reduce(g);
  }
  for (auto& g : groups_) {
    if (!g->launched) launch_reduce(*g);
    g->launched = false;
  }
  next_reduce_ = 0;
  round_active_ = false;
}

void FullyShardedDataParallel::finish() {
  std::lock_guard<std::mutex> lock(mu_);
  NoGradGuard no_grad;
  flush_round();
  for (auto& g : groups_) {
    // The rounds' reduced shards, summed here: one all-reduce over the
    // replicate dim for all of them.
    Tensor reduced;
    for (WorkPtr& work : g->reduces) {
      work->wait();
      reduced = reduced.defined() ? ops::add(reduced, work->result()) : work->result();
    }
    g->reduces.clear();
    if (!reduced.defined()) continue;
    if (replicate_group_ != nullptr && g->packed > 0) {
      WorkPtr all =
          replicate_group_->all_reduce(reduced, {options_.op, "fsdp all_reduce " + g->name});
      all->wait();
      reduced = all->result();
    }
    for (Group::Param& p : g->params) {
      Tensor piece =
          ops::to(ops::reshape(ops::narrow(reduced, 0, p.offset, p.local_rows * p.row_numel),
                               p.shard.shape()),
                  p.shard.dtype());
      const Tensor existing = grad(p.shard);
      set_grad(p.shard, existing.defined() ? ops::add(existing, piece) : ops::clone(piece));
    }
  }
}

int FullyShardedDataParallel::num_groups() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(groups_.size());
}

std::vector<std::string> FullyShardedDataParallel::forward_order() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> names;
  for (const Group* g : pre_order_)
    names.push_back(g->name);
  return names;
}

int FullyShardedDataParallel::launched() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(next_reduce_);
}

int FullyShardedDataParallel::prefetches() const {
  std::lock_guard<std::mutex> lock(mu_);
  return prefetches_;
}

}  // namespace tandem
