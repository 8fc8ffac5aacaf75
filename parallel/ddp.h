// Bucketed, overlapped data parallelism (DDP): each parameter's gradient is
// reduced over the data dims of a mesh in buckets, each launched from the
// gradient-ready hook of its last parameter (autograd/grad_ready.h) while the
// backward goes on, and waited at the end of the step:
//
//   DistributedDataParallel ddp(model->named_parameters(), mesh, {"dp", "ep", "cp"});
//   for (int i = 0; i < micro_batches; ++i) {
//     ddp.set_sync(i == micro_batches - 1);   // accumulate, then reduce once
//     backward(loss(i));
//   }
//   ddp.finish();                            // every gradient reduced
//   clip_grad_norm(params, mesh, 1.0);
//   optimizer.step();
//
// The result is reduce_gradients()'s: the same sums of the same values (the
// same elements over the same ranks in the same order), only cut into more
// collectives and launched earlier.
//
// Note [DDP buckets]
// ~~~~~~~~~~~~~~~~~~
// Parameters are grouped by the set of data dims they are replicated over
// (their placements: an expert is not reduced over ep), then, within a
// group, cut into buckets of about bucket_bytes in reverse parameter order —
// the order a backward produces gradients, last layer first, as PyTorch's
// DDP does. Every rank builds the same buckets from the same structure. A
// bucket is ready when each of its parameters has its gradient of the sync
// backward; buckets launch strictly in bucket order (a ready bucket waits for
// every earlier one), so every rank issues the same collectives in the same
// order whatever order its gradients arrive in: the checked ledger sees one
// sequence. A parameter that got no gradient (unused this step, an expert
// without tokens) holds its bucket and every later one until finish(), which
// reduces zeros for it, as reduce_gradients does. A gradient that arrives
// again after its bucket launched (a parameter used in two separate
// backwards of one sync step) is an error naming it, never a silent miss.
// Each launch asks its Work to progress in the background (Note [Progress
// without a waiter]), so on the threads backend the copies run while the
// backward computes.
#pragma once

#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "tandem/comm/types.h"
#include "tandem/comm/work.h"
#include "tandem/parallel/device_mesh.h"
#include "tandem/tensor/tensor.h"

namespace tandem {

struct DDPOptions {
  int64_t bucket_bytes = int64_t{25} << 20;  // PyTorch's default bucket_cap_mb
  RedOp op = RedOp::Sum;                     // Sum or Avg
  // The dtype the buckets are reduced in (mixed precision: f32 sums of bf16
  // gradients, each rounded back once); nullopt: the gradients' own.
  std::optional<DType> reduce_dtype = std::nullopt;
};

class DistributedDataParallel {
 public:
  DistributedDataParallel(const std::vector<std::pair<std::string, Tensor>>& params,
                          const DeviceMesh& mesh, std::vector<std::string> data_dims,
                          DDPOptions options = {});
  ~DistributedDataParallel();
  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;

  // Whether the next backwards reduce (true, the default) or only
  // accumulate (gradient accumulation: false for all but the last
  // micro-batch), as PyTorch's no_sync.
  void set_sync(bool sync);
  // Launches the buckets still held (zeros for parameters without a
  // gradient), waits for every bucket and writes the reduced gradients.
  // Collective; call once per step, after the sync backward.
  void finish();

  int num_buckets() const { return static_cast<int>(buckets_.size()); }
  // Buckets launched since the last finish() (inspection, tests).
  int launched() const;

 private:
  struct Bucket {
    std::vector<size_t> members;  // indices into params_, in backward order
    std::vector<std::string> dims;
    ProcessGroupPtr group;  // null when nothing to reduce over (size 1)
    int ready = 0;          // members with their gradient of this step
    WorkPtr work;
    bool launched = false;
  };
  void on_ready(size_t param);
  void launch_ready_buckets();  // in order, under mu_
  void launch(Bucket& b);

  std::vector<std::pair<std::string, Tensor>> params_;
  std::vector<size_t> bucket_of_;  // per parameter
  std::vector<bool> got_;          // per parameter, this step
  std::vector<Bucket> buckets_;
  std::vector<int> hooks_;
  DDPOptions options_;
  bool sync_ = true;
  size_t next_launch_ = 0;
  mutable std::mutex mu_;
};

}  // namespace tandem
