#include "tandem/parallel/zero.h"

#include <tuple>

#include "tandem/autograd/node.h"
#include "tandem/parallel/placement.h"
#include "tandem/runtime/error.h"
#include "tandem/tensor/ops.h"

namespace tandem {

namespace {

// A parameter as (rows, row elements): 0-d ones are one row of one.
Tensor as_rows(const Tensor& t, int64_t n, int64_t row_numel) {
  return ops::reshape(t, {n, row_numel});
}

}  // namespace

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(optim::NamedParams params, const DeviceMesh& mesh,
                                                 const std::string& dim,
                                                 const optim::AdamWOptions& options) {
  mesh.dim_index(dim);  // names the known dims when `dim` is not one
  group_ = mesh.get_group(dim);
  const int64_t world = group_->size(), rank = group_->rank();
  optim::NamedParams rows;
  for (auto& [name, p] : params) {
    TANDEM_CHECK(p.defined() && requires_grad(p) && p.is_contiguous(),
                 "[parallel::ZeRO] expected contiguous parameters that require grad, got '{}' {}",
                 name, !p.defined() || !requires_grad(p) ? "without" : "not contiguous");
    TANDEM_CHECK(slots_.empty() || (p.dtype() == slots_[0].param.dtype() &&
                                    p.device() == slots_[0].param.device()),
                 "[parallel::ZeRO] expected one dtype and device for every parameter, got '{}' as "
                 "{} on {} after {} on {}",
                 name, dtype_name(p.dtype()), p.device(), dtype_name(slots_[0].param.dtype()),
                 slots_[0].param.device());
    Slot s;
    s.name = name;
    s.param = p;
    s.n = p.dim() == 0 ? 1 : p.shape()[0];
    s.row_numel = s.n == 0 ? 0 : p.numel() / s.n;
    if (p.dim() > 0 && s.n == 0) {
      s.row_numel = 1;
      for (int d = 1; d < p.dim(); ++d)
        s.row_numel *= p.shape()[d];
    }
    s.chunk = (s.n + world - 1) / world;
    std::tie(s.start, s.length) = chunk_range(s.n, world, rank);
    s.offset = packed_;
    packed_ += s.chunk * s.row_numel;
    NoGradGuard no_grad;
    s.rows = ops::clone(ops::narrow(as_rows(p, s.n, s.row_numel), 0, s.start, s.length));
    set_requires_grad(s.rows);
    rows.emplace_back(name, s.rows);
    slots_.push_back(std::move(s));
  }
  inner_ = std::make_unique<optim::AdamW>(std::move(rows), options);
}

void ZeroRedundancyOptimizer::step() {
  NoGradGuard no_grad;
  for (Slot& s : slots_) {
    const Tensor g = grad(s.param);
    if (!g.defined()) continue;
    // The parameter may have changed since the last step (a checkpoint
    // loaded into it, master weights rounded back): the rows start from it.
    ops::copy_(s.rows, ops::narrow(as_rows(s.param, s.n, s.row_numel), 0, s.start, s.length));
    set_grad(s.rows,
             ops::contiguous(ops::narrow(as_rows(g, s.n, s.row_numel), 0, s.start, s.length)));
  }
  inner_->step();
  inner_->zero_grad();
  if (slots_.empty()) return;
  const Tensor& first = slots_[0].param;
  const int64_t world = group_->size();
  Tensor flat = ops::zeros({packed_}, first.dtype(), first.device());
  for (const Slot& s : slots_) {
    if (s.length == 0) continue;
    ops::copy_(ops::narrow(flat, 0, s.offset, s.length * s.row_numel),
               ops::reshape(s.rows, {s.length * s.row_numel}));
  }
  WorkPtr work = group_->all_gather(flat, {0, "zero1 all_gather"});
  work->wait();
  const Tensor blocks = ops::reshape(work->result(), {world, packed_});
  for (const Slot& s : slots_) {
    const Tensor dst = as_rows(s.param, s.n, s.row_numel);
    for (int64_t r = 0; r < world; ++r) {
      const auto [start, length] = chunk_range(s.n, world, r);
      if (length == 0) continue;
      const Tensor src =
          ops::narrow(ops::narrow(blocks, 0, r, 1), 1, s.offset, length * s.row_numel);
      ops::copy_(ops::narrow(dst, 0, start, length), ops::reshape(src, {length, s.row_numel}));
    }
  }
}

void ZeroRedundancyOptimizer::zero_grad() {
  for (Slot& s : slots_)
    tandem::zero_grad(s.param);
  inner_->zero_grad();
}

std::pair<int64_t, int64_t> ZeroRedundancyOptimizer::rows_of(const std::string& param) const {
  for (const Slot& s : slots_) {
    if (s.name == param) return {s.start, s.length};
  }
  TANDEM_FAIL("[parallel::ZeRO] expected one of its parameters, got '{}'", param);
}

int64_t ZeroRedundancyOptimizer::state_bytes() const {
  int64_t bytes = 0;
  for (const auto& [key, t] : inner_->state_dict())
    bytes += static_cast<int64_t>(t.nbytes());
  return bytes;
}

}  // namespace tandem
