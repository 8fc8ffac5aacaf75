#include "tandem/parallel/ddp.h"

#include <algorithm>

#include "tandem/autograd/grad_ready.h"
#include "tandem/autograd/node.h"
#include "tandem/parallel/data_parallel.h"
#include "tandem/runtime/error.h"
#include "tandem/tensor/ops.h"

namespace tandem {

DistributedDataParallel::DistributedDataParallel(
    const std::vector<std::pair<std::string, Tensor>>& params, const DeviceMesh& mesh,
    std::vector<std::string> data_dims, DDPOptions options)
    : params_(params), options_(options) {
  TANDEM_CHECK(options.op == RedOp::Sum || options.op == RedOp::Avg,
               "[parallel::DDP] expected RedOp Sum or Avg, got {}", red_op_name(options.op));
  TANDEM_CHECK(options.bucket_bytes > 0, "[parallel::DDP] expected bucket_bytes > 0, got {}",
               options.bucket_bytes);
  for (const std::string& d : data_dims)
    mesh.dim_index(d);  // names the known dims when `d` is not one
  // Note [DDP buckets]: by replication dims, then by size in backward order.
  std::vector<std::vector<std::string>> dim_sets;
  std::vector<std::vector<size_t>> groups;
  for (size_t i = params_.size(); i-- > 0;) {
    const Tensor& p = params_[i].second;
    TANDEM_CHECK(p.defined() && requires_grad(p),
                 "[parallel::DDP] expected parameters that require grad, got '{}' without",
                 params_[i].first);
    std::vector<std::string> dims = replicated_dims(p, data_dims);
    auto it = std::find(dim_sets.begin(), dim_sets.end(), dims);
    if (it == dim_sets.end()) {
      dim_sets.push_back(std::move(dims));
      groups.emplace_back();
      it = std::prev(dim_sets.end());
    }
    groups[static_cast<size_t>(it - dim_sets.begin())].push_back(i);
  }
  bucket_of_.resize(params_.size());
  for (size_t g = 0; g < groups.size(); ++g) {
    ProcessGroupPtr group =
        ranks_over(mesh, dim_sets[g]) > 1 ? mesh.group_over(dim_sets[g]) : nullptr;
    int64_t bytes = 0;
    bool open = false;  // a bucket of this group takes more members
    for (size_t i : groups[g]) {
      const Tensor& p = params_[i].second;
      const int64_t size = p.numel() * static_cast<int64_t>(dtype_size(p.dtype()));
      if (!open || (bytes > 0 && bytes + size > options.bucket_bytes)) {
        buckets_.push_back(Bucket{});
        buckets_.back().dims = dim_sets[g];
        buckets_.back().group = group;
        bytes = 0;
        open = true;
      }
      buckets_.back().members.push_back(i);
      bucket_of_[i] = buckets_.size() - 1;
      bytes += size;
    }
  }
  // Launch order across groups: by each bucket's first member in backward
  // order, so that a group's buckets interleave with the others' as the
  // gradients arrive.
  std::vector<size_t> order(buckets_.size());
  for (size_t b = 0; b < order.size(); ++b)
    order[b] = b;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return buckets_[a].members.front() > buckets_[b].members.front();
  });
  std::vector<Bucket> sorted;
  for (size_t b : order)
    sorted.push_back(std::move(buckets_[b]));
  buckets_ = std::move(sorted);
  for (size_t b = 0; b < buckets_.size(); ++b) {
    for (size_t i : buckets_[b].members)
      bucket_of_[i] = b;
  }
  got_.assign(params_.size(), false);
  for (size_t i = 0; i < params_.size(); ++i)
    hooks_.push_back(
        register_grad_ready_hook(params_[i].second, [this, i](const Tensor&) { on_ready(i); }));
}

DistributedDataParallel::~DistributedDataParallel() {
  for (int h : hooks_)
    remove_grad_ready_hook(h);
}

void DistributedDataParallel::set_sync(bool sync) {
  std::lock_guard<std::mutex> lock(mu_);
  sync_ = sync;
}

int DistributedDataParallel::launched() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(next_launch_);
}

void DistributedDataParallel::on_ready(size_t i) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!sync_) return;
  Bucket& b = buckets_[bucket_of_[i]];
  TANDEM_CHECK(!b.launched,
               "[parallel::DDP] the gradient of '{}' arrived after its bucket was reduced: a "
               "parameter used in two backwards of one sync step (call set_sync(false) for all "
               "but the last, and finish() before the next sync backward)",
               params_[i].first);
  if (got_[i]) return;  // more of it before its bucket launched: read at launch
  got_[i] = true;
  ++b.ready;
  launch_ready_buckets();
}

void DistributedDataParallel::launch_ready_buckets() {
  while (next_launch_ < buckets_.size() &&
         buckets_[next_launch_].ready == static_cast<int>(buckets_[next_launch_].members.size()))
    launch(buckets_[next_launch_++]);
}

void DistributedDataParallel::launch(Bucket& b) {
  NoGradGuard no_grad;
  b.launched = true;
  if (!b.group) return;  // nothing to reduce over: finish() fills missing gradients
  std::vector<Tensor> flat;
  for (size_t i : b.members) {
    const Tensor& p = params_[i].second;
    Tensor g = grad(p);
    Tensor piece = ops::reshape(g.defined() ? g : ops::zeros_like(p), Shape{-1});
    if (options_.reduce_dtype) piece = ops::to(piece, *options_.reduce_dtype);
    flat.push_back(piece);
  }
  b.work = b.group->all_reduce(ops::cat(flat, 0), {options_.op, "ddp bucket"});
  b.work->progress_in_background();
}

void DistributedDataParallel::finish() {
  std::lock_guard<std::mutex> lock(mu_);
  NoGradGuard no_grad;
  while (next_launch_ < buckets_.size())
    launch(buckets_[next_launch_++]);
  for (Bucket& b : buckets_) {
    if (b.work) {
      b.work->wait();
      const Tensor reduced = b.work->result();
      int64_t offset = 0;
      for (size_t i : b.members) {
        const Tensor& p = params_[i].second;
        const int64_t n = p.numel();
        Tensor g = ops::reshape(ops::narrow(reduced, 0, offset, n), p.shape());
        set_grad(p, ops::contiguous(g.dtype() == p.dtype() ? g : ops::to(g, p.dtype())));
        offset += n;
      }
    } else {
      for (size_t i : b.members) {
        const Tensor& p = params_[i].second;
        if (!grad(p).defined()) set_grad(p, ops::zeros_like(p));
      }
    }
    b.work.reset();
    b.ready = 0;
    b.launched = false;
  }
  got_.assign(params_.size(), false);
  next_launch_ = 0;
}

}  // namespace tandem
