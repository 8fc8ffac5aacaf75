// Per-call data: what the caller of a forward knows about this call (the
// sequence layout of this micro-batch, its document boundaries) and layers
// deep inside the model need, without threading it through every forward.
//
// Note [Per-call data]
// ~~~~~~~~~~~~~~~~~~~~
// A forward runs on one thread from its first op to its last (the dual-pipe
// workers run different micro-batches on different threads), so the data of
// one call lives in a thread-local stack of scopes: CallDataScope puts a
// value in scope for the forwards run on this thread while it lives, and
// find_call_data() returns the innermost value for a key. A checkpointed
// segment runs its forward again during backward, on the backward thread:
// checkpoint() snapshots the stack when its forward runs and reinstates it
// for the re-run (CallDataRestore), so the re-run sees the data its forward
// saw. Keys are addresses the owner chooses (a process group, a static);
// values are immutable and shared, so a snapshot is a cheap copy.
#pragma once

#include <memory>
#include <vector>

namespace tandem {

struct CallDataEntry {
  const void* key = nullptr;
  std::shared_ptr<const void> value;
};
using CallDataStack = std::vector<CallDataEntry>;

class CallDataScope {
 public:
  CallDataScope(const void* key, std::shared_ptr<const void> value);
  ~CallDataScope();
  CallDataScope(const CallDataScope&) = delete;
  CallDataScope& operator=(const CallDataScope&) = delete;
};

// The innermost value in scope on this thread for `key`; null when none.
std::shared_ptr<const void> find_call_data(const void* key);

// This thread's scopes, innermost last.
CallDataStack call_data_snapshot();

// Replaces this thread's scopes with `stack` while it lives.
class CallDataRestore {
 public:
  explicit CallDataRestore(CallDataStack stack);
  ~CallDataRestore();
  CallDataRestore(const CallDataRestore&) = delete;
  CallDataRestore& operator=(const CallDataRestore&) = delete;

 private:
  CallDataStack saved_;
};

}  // namespace tandem
