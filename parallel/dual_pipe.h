// Dual-pipe overlap (DESIGN §8): the forward of one micro-batch and the
// backward of another run in tandem on two worker threads, and a
// HookCoordinator pairs each collective of one side with compute of the other.
//
// Sync hooks. An identity autograd Function fired at four points of each MoE
// layer — [A] dispatch [B] experts [C] combine [D] attention [A next] — which
// at each point calls notify_dispatched(prev) then rendezvous(next) with the
// roles (prev → next):
//
//               A                B                C                D
//   forward     COMPUTE → COMM   COMM → COMPUTE   COMPUTE → COMM   COMM → COMPUTE
//   backward    COMM → COMPUTE   COMPUTE → COMM   COMM → COMPUTE   COMPUTE → COMM
//
// The last MoE layer's D is D_LAST (forward: notify only; backward: skip),
// found from the model, so each side fires 4N − 1 rendezvous for N layers,
// always one COMM with one COMPUTE. The hook node is recorded even while the
// coordinator is disabled (then it does nothing), so a tape recorded outside
// an overlap window can be replayed inside one.
//
// Schedule. For n micro-batches: F1, [B1 ‖ F2], …, [B(n−1) ‖ Fn], Bn, each
// pair under an enabled coordinator on a WorkerPair; gradients accumulate in
// order B1, B2, …, so losses and gradients are bit-identical to the
// sequential schedule (deterministic kernels and reductions).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tandem/autograd/module.h"
#include "tandem/parallel/device_mesh.h"
#include "tandem/runtime/hook_coordinator.h"
#include "tandem/runtime/worker_pair.h"

namespace tandem {

enum class SyncPoint { A, B, C, D };
// The number of sync points, for the tables indexed by them in dual_pipe.cpp:
// the last value + 1, not an enumerator (switches stay exhaustive).
constexpr int kSyncPointCount = static_cast<int>(SyncPoint::D) + 1;

// One sync hook on `x`: identity in value, a node in the graph.
Tensor sync_hook(const Tensor& x, const std::shared_ptr<HookCoordinator>& coordinator,
                 SyncPoint point, int64_t layer, bool last_layer);

// Makes every nn::MoE of `model` expert-parallel over `ep_mesh` with sync
// hooks at A/B/C/D (the last MoE layer in module order gets D_LAST). Returns
// the number of MoE layers.
int install_dual_pipe(const std::shared_ptr<Module>& model, const DeviceMesh& ep_mesh,
                      const std::shared_ptr<HookCoordinator>& coordinator);

// The rendezvous roles one side fires for `moe_layers` layers, in order.
std::vector<HookRole> hook_sequence(int moe_layers, bool backward);
// Checks, before a window opens, that a forward chunk of `forward_layers` MoE
// layers pairs with a backward chunk of `backward_layers`: every rendezvous
// one COMM with one COMPUTE. Unequal counts are allowed (the longer side runs
// solo after the shorter departs); returns a description of the pairing, and
// throws naming the first mismatched round otherwise.
std::string check_pairing(int forward_layers, int backward_layers);

// The micro-batch the calling thread is working on (for hook reports).
int current_micro_batch();

struct DualPipeResult {
  std::vector<double> losses;  // per micro-batch
};

class DualPipeSchedule {
 public:
  DualPipeSchedule(std::shared_ptr<HookCoordinator> coordinator, Device device = Device::cpu());

  // forward(i) builds micro-batch i's loss (on the forward worker); its
  // backward runs on the backward worker in the next pair. With overlap off,
  // the same work runs F1 B1 F2 B2 … on the calling thread (the reference).
  // `forward_layers` / `backward_layers`: MoE layers per side, for the static
  // pairing check (0 skips it).
  DualPipeResult run(int micro_batches, const std::function<Tensor(int)>& forward, bool overlap,
                     int moe_layers = 0);

  // Groups aborted (ProcessGroup::abort) when either side fails, so that the
  // other ranks stop at once with an error naming this rank instead of
  // running on with a schedule that can no longer match theirs.
  void abort_on_failure(std::vector<ProcessGroupPtr> groups);
  // Every group of `mesh`'s root (DeviceMesh::all_groups), read when a side
  // fails, so that groups created after this call are aborted too.
  void abort_on_failure(const DeviceMesh& mesh);

 private:
  std::shared_ptr<HookCoordinator> coordinator_;
  std::function<std::vector<ProcessGroupPtr>()> abort_groups_;
  WorkerPair pair_;
};

// The dual-pipe overlap of one model as one object: it owns the
// HookCoordinator, makes every nn::MoE of the model expert-parallel over
// `ep_mesh` with the sync hooks (install_dual_pipe), and runs the schedule
// with the static pairing check of the model's MoE layer count.
//
//   DualPipe pipe(model, mesh.slice("ep"), device);
//   pipe.abort_on_failure(mesh);
//   DualPipeResult r = pipe.run(micro_batches, forward);
class DualPipe {
 public:
  DualPipe(const std::shared_ptr<Module>& model, const DeviceMesh& ep_mesh,
           Device device = Device::cpu(), HookCoordinatorOptions options = {});

  // DualPipeSchedule::run with this model's MoE layer count.
  DualPipeResult run(int micro_batches, const std::function<Tensor(int)>& forward,
                     bool overlap = true);
  void abort_on_failure(const DeviceMesh& mesh) { schedule_.abort_on_failure(mesh); }

  int moe_layers() const { return moe_layers_; }
  const std::shared_ptr<HookCoordinator>& coordinator() const { return coordinator_; }

 private:
  std::shared_ptr<HookCoordinator> coordinator_;
  int moe_layers_ = 0;
  DualPipeSchedule schedule_;
};

}  // namespace tandem
