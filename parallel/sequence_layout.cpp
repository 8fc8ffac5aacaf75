#include "tandem/parallel/sequence_layout.h"

#include <algorithm>
#include <mutex>
#include <numeric>
#include <set>
#include <string>
#include <utility>

#include "tandem/parallel/collectives.h"
#include "tandem/runtime/error.h"
#include "tandem/runtime/logging.h"

namespace tandem {
namespace {

const void* key_of(const DeviceMesh& mesh) {
  TANDEM_CHECK(mesh.ndim() >= 1, "[parallel::SequenceLayoutScope] expected a mesh, got {}",
               mesh.str());
  return mesh.group_over(mesh.dim_names()).get();
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

std::vector<int64_t> sequence_lengths(const Tensor& local, int64_t dim,
                                      const ProcessGroupPtr& group, const char* who) {
  TANDEM_CHECK(group != nullptr, "[parallel::sequence_lengths] expected a process group for {}",
               who);
  const int d = wrap_dim(dim, local.dim(), "sequence_lengths");
  const auto layout = declared_sequence_layout(*group);
  if (!layout) {
    static std::mutex mu;
    static std::set<std::string> said;
    bool first = false;
    {
      // Not held across the gather: the other rank threads come here too.
      std::lock_guard<std::mutex> lock(mu);
      first = said.insert(who).second;
    }
    if (first) {
      log_debug(
          "[parallel] {} gathers every rank's sequence length from its group: no "
          "SequenceLayoutScope declares the layout",
          who);
    }
    return gather_lengths(local, group, d);
  }
  const int64_t want = layout->lengths.at(static_cast<size_t>(group->rank()));
  TANDEM_CHECK(want == local.size(d),
               "[parallel] expected rank {}'s sequence shard (dim {}) to hold the {} tokens the "
               "declared layout gives it ({}), got {}",
               group->rank(), d, want, who, local.size(d));
  return layout->lengths;
}

}  // namespace tandem
