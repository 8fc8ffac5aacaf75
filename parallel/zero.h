// ZeRO-1 for plain data parallelism: the optimizer state is sharded over
// the data ranks, each rank updates its rows of every parameter and the
// updated rows are all-gathered, as PyTorch's ZeroRedundancyOptimizer and
// DeepSpeed's stage 1 do.
//
//   DistributedDataParallel ddp(model->named_parameters(), mesh, {"dp"});
//   ZeroRedundancyOptimizer opt(model->named_parameters(), mesh, "dp", {.lr = 3e-4});
//   backward(loss);
//   ddp.finish();          // every rank holds the reduced gradients
//   opt.step();            // its rows updated, then everybody's gathered
//
// Note [ZeRO-1]
// ~~~~~~~~~~~~~
// Each parameter (the local tensor a rank holds: tensor-parallel shards
// stay what they are) is cut along dim 0 by chunk semantics over the dim's
// ranks (chunk_range(): ceil(n / W) rows from r * ceil(n / W), possibly none);
// 0-d parameters count as one row. A rank keeps an AdamW over its rows only,
// so the exp_avg and exp_avg_sq of a parameter live once over the group. A
// step hands each row block its rows of the reduced gradient, runs the
// inner AdamW (elementwise, so every element is updated with exactly the
// arithmetic of an unsharded AdamW: bit-identical parameters), and gathers
// every parameter's updated rows in one all-gather (each rank's rows padded
// to ceil(n / W)) straight into the parameters, in place. A parameter
// without a gradient is skipped on every rank alike, as AdamW skips it. The
// rows are copied out of the parameter at every step, so whatever wrote the
// parameter in between (a checkpoint loaded into it, master weights rounded
// back) is what the step updates. In a checkpoint (tandem-train --zero1),
// each dp rank writes its rows of the moments (placed_rows_piece): the
// pieces of one tensor are the tensor, so a ZeRO-1 checkpoint resumes with
// or without ZeRO-1 and a plain one with it.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tandem/autograd/optim.h"
#include "tandem/parallel/device_mesh.h"

namespace tandem {

class ZeroRedundancyOptimizer {
 public:
  ZeroRedundancyOptimizer(optim::NamedParams params, const DeviceMesh& mesh, const std::string& dim,
                          const optim::AdamWOptions& options);

  // Collective over `dim`: call on every rank after the gradients are
  // reduced.
  void step();
  void zero_grad();
  double lr() const { return inner_->lr(); }
  void set_lr(double lr) { inner_->set_lr(lr); }

  // This rank's rows' state (the inner AdamW's keys, "<param>.exp_avg", …),
  // and the rows of each parameter it holds: [start, start + length).
  std::map<std::string, Tensor> state_dict() const { return inner_->state_dict(); }
  void load_state_dict(const std::map<std::string, Tensor>& state) {
    inner_->load_state_dict(state);
  }
  std::pair<int64_t, int64_t> rows_of(const std::string& param) const;
  // Bytes of optimizer state this rank holds.
  int64_t state_bytes() const;

 private:
  struct Slot {
    std::string name;
    Tensor param;  // the whole local parameter
    Tensor rows;   // this rank's rows, a leaf of the inner AdamW
    int64_t n = 0, chunk = 0, row_numel = 0, start = 0, length = 0, offset = 0;
  };
  std::vector<Slot> slots_;
  int64_t packed_ = 0;  // elements of a rank's padded block
  ProcessGroupPtr group_;
  std::unique_ptr<optim::AdamW> inner_;
};

}  // namespace tandem
