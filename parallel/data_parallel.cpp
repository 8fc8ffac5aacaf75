#include "tandem/parallel/data_parallel.h"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <memory>

#include "tandem/autograd/node.h"
#include "tandem/comm/work.h"
#include "tandem/parallel/param_placement.h"
#include "tandem/runtime/error.h"
#include "tandem/tensor/ops.h"

namespace tandem {

std::vector<std::string> replicated_dims(const Tensor& param,
                                         const std::vector<std::string>& dims) {
  const std::shared_ptr<const ParamPlacement> placement = param_placement(param);
  std::vector<std::string> out;
  for (const std::string& d : dims) {
    if (placement == nullptr || !placement->split_over(d)) out.push_back(d);
  }
  return out;
}

int64_t ranks_over(const DeviceMesh& mesh, const std::vector<std::string>& dims) {
  int64_t n = 1;
  for (const std::string& d : dims)
    n *= mesh.size(d);
  return n;
}

namespace {

Tensor all_reduced(const Tensor& t, const ProcessGroupPtr& group, RedOp op, const char* what) {
  WorkPtr w = group->all_reduce(t, {op, what});
  w->wait();
  return w->result();
}

}  // namespace

void reduce_gradients(const std::vector<Tensor>& params, const DeviceMesh& mesh,
                      const std::vector<std::string>& data_dims, RedOp op) {
  TANDEM_CHECK(op == RedOp::Sum || op == RedOp::Avg,
               "[parallel::reduce_gradients] expected RedOp Sum or Avg, got {}", red_op_name(op));
  for (const std::string& d : data_dims)
    mesh.dim_index(d);  // names the known dims when `d` is not one
  NoGradGuard no_grad;
  // Buckets by the set of dims reduced over, in order of first appearance.
  std::vector<std::pair<std::vector<std::string>, std::vector<const Tensor*>>> buckets;
  for (const Tensor& p : params) {
    TANDEM_CHECK(p.defined(), "[parallel::reduce_gradients] expected defined parameters");
    std::vector<std::string> dims = replicated_dims(p, data_dims);
    auto it = std::find_if(buckets.begin(), buckets.end(),
                           [&](const auto& b) { return b.first == dims; });
    if (it == buckets.end()) {
      buckets.emplace_back(std::move(dims), std::vector<const Tensor*>{});
      it = std::prev(buckets.end());
    }
    it->second.push_back(&p);
  }
  for (auto& [dims, members] : buckets) {
    const bool reduce = ranks_over(mesh, dims) > 1;
    std::vector<Tensor> flat;
    for (const Tensor* p : members) {
      Tensor g = grad(*p);
      if (!g.defined()) g = ops::zeros_like(*p);
      if (!reduce) {
        set_grad(*p, g);
        continue;
      }
      flat.push_back(ops::reshape(g, Shape{-1}));
    }
    if (!reduce) continue;
    const Tensor bucket = all_reduced(ops::cat(flat, 0), mesh.group_over(dims), op, "gradients");
    int64_t offset = 0;
    for (const Tensor* p : members) {
      const int64_t n = p->numel();
      set_grad(*p, ops::contiguous(ops::reshape(ops::narrow(bucket, 0, offset, n), p->shape())));
      offset += n;
    }
  }
}

double clip_grad_norm(const std::vector<Tensor>& params, const DeviceMesh& mesh, double max_norm) {
  TANDEM_CHECK(std::isfinite(max_norm),
               "[parallel::clip_grad_norm] expected a finite max_norm, got {}", max_norm);
  NoGradGuard no_grad;
  const std::vector<std::string> all = mesh.dim_names();
  // Accumulated on the device: one host read for all parameters.
  Tensor sum_sq = ops::zeros({}, DType::F64, mesh.device());
  for (const Tensor& p : params) {
    const Tensor g = grad(p);
    if (!g.defined()) continue;
    const Tensor g64 = ops::to(g, DType::F64);
    const auto copies = static_cast<double>(ranks_over(mesh, replicated_dims(p, all)));
    sum_sq = ops::add(sum_sq, ops::div(ops::sum(ops::mul(g64, g64)), copies));
  }
  if (mesh.size() > 1) sum_sq = all_reduced(sum_sq, mesh.group_over(all), RedOp::Sum, "grad norm");
  const double norm = std::sqrt(sum_sq.item_double());
  if (max_norm > 0 && norm > max_norm) {
    const double scale = max_norm / (norm + 1e-6);
    for (const Tensor& p : params) {
      const Tensor g = grad(p);
      if (g.defined()) set_grad(p, ops::mul(g, scale));
    }
  }
  return norm;
}

std::vector<double> sum_over(const DeviceMesh& mesh, const std::vector<std::string>& dims,
                             const std::vector<double>& values) {
  Tensor t = ops::from_vector(values, Shape{static_cast<int64_t>(values.size())}, mesh.device());
  if (ranks_over(mesh, dims) > 1) t = all_reduced(t, mesh.group_over(dims), RedOp::Sum, "values");
  return t.to_vector<double>();
}

}  // namespace tandem
