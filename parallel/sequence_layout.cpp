#include "tandem/parallel/sequence_layout.h"

#include <algorithm>
#include <numeric>
#include <utility>

#include "tandem/runtime/error.h"

namespace tandem {
namespace {

const void* key_of(const DeviceMesh& mesh) {
  TANDEM_CHECK(mesh.ndim() == 1, "[parallel::SequenceLayoutScope] expected a 1-D mesh, got {}",
               mesh.str());
  return mesh.get_group().get();
}

std::shared_ptr<const void> checked(const DeviceMesh& mesh, SequenceLayout layout) {
  key_of(mesh);
  TANDEM_CHECK(static_cast<int64_t>(layout.lengths.size()) == mesh.size(),
               "[parallel::SequenceLayoutScope] expected one length per rank of {} ({}), got {}",
               mesh.str(), mesh.size(), layout.lengths.size());
  for (int64_t n : layout.lengths) {
    TANDEM_CHECK(n >= 0, "[parallel::SequenceLayoutScope] expected lengths >= 0, got {}", n);
  }
  return std::make_shared<const SequenceLayout>(std::move(layout));
}

}  // namespace

int64_t SequenceLayout::total() const {
  return std::accumulate(lengths.begin(), lengths.end(), int64_t{0});
}

SequenceLayout SequenceLayout::chunked(int64_t total, int ranks) {
  TANDEM_CHECK(total >= 0 && ranks > 0,
               "[parallel::SequenceLayout::chunked] expected total >= 0 and ranks > 0, got {} "
               "and {}",
               total, ranks);
  const int64_t chunk = (total + ranks - 1) / ranks;
  SequenceLayout layout;
  for (int r = 0; r < ranks; ++r)
    layout.lengths.push_back(std::clamp<int64_t>(total - r * chunk, 0, chunk));
  return layout;
}

SequenceLayoutScope::SequenceLayoutScope(const DeviceMesh& mesh, SequenceLayout layout)
    : scope_(key_of(mesh), checked(mesh, std::move(layout))) {}

std::shared_ptr<const SequenceLayout> declared_sequence_layout(const ProcessGroup& group) {
  return std::static_pointer_cast<const SequenceLayout>(find_call_data(&group));
}

}  // namespace tandem
