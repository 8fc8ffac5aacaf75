// The layout of a sharded sequence, declared by the caller of a forward as
// data (Note [Sequence layout as data]):
//
//   SequenceLayoutScope layout(tp_mesh, SequenceLayout{.lengths = {171, 171, 170}});
//   Tensor y = model->forward(x_shard);   // no collective discovers the lengths
//
// The scope covers the forwards run on this thread while it lives, and their
// re-runs under checkpoint (Note [Per-call data]).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "tandem/autograd/call_data.h"
#include "tandem/comm/process_group.h"
#include "tandem/parallel/device_mesh.h"

namespace tandem {

struct SequenceLayout {
  // Every rank's local sequence length, in the group's rank order.
  std::vector<int64_t> lengths;

  int64_t total() const;
  // The lengths of `total` tokens split over `ranks` by chunk semantics (what
  // Shard placements and DTensor::distribute make).
  static SequenceLayout chunked(int64_t total, int ranks);
};

// Note [Sequence layout as data]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A layer that receives a local shard of a sequence sometimes needs every
// rank's length: to gather it (an uneven all-gather must know each piece), to
// know the global positions of its tokens. Under chunk semantics a short last
// shard makes the whole length ambiguous from one rank's view, so without help
// the layer must ask its peers — a small collective read on the host, a
// synchronisation in the middle of the forward. The caller knows the layout
// before the step (the data loader made it), so it declares it: the layers
// look it up by their group (declared_sequence_layout) and check it against
// the shard they hold. Where nothing is declared they fall back to the
// collective and say so once at debug level.
class SequenceLayoutScope {
 public:
  // `mesh`: the ranks over which the sequence is sharded, in the rank order
  // of its group (a mesh of several dims stands for the group over all of
  // them, as flatten() makes: context parallelism's (co, ds) mesh).
  SequenceLayoutScope(const DeviceMesh& mesh, SequenceLayout layout);

 private:
  CallDataScope scope_;
};

// The layout declared for sequences sharded over `group` on this thread; null
// when none is in scope.
std::shared_ptr<const SequenceLayout> declared_sequence_layout(const ProcessGroup& group);

// Every rank's local length of the sequence that `local` holds a shard of
// along `dim`, sharded over `group`: the declared layout, checked against this
// rank's shard, or, where none is declared, gathered from the group (a small
// collective read on the host; `who` says so once, at debug level).
std::vector<int64_t> sequence_lengths(const Tensor& local, int64_t dim,
                                      const ProcessGroupPtr& group, const char* who);

}  // namespace tandem
