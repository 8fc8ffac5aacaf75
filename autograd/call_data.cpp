#include "tandem/autograd/call_data.h"

#include <utility>

namespace tandem {
namespace {
thread_local CallDataStack call_data;  // Note [Per-call data]
}  // namespace

CallDataScope::CallDataScope(const void* key, std::shared_ptr<const void> value) {
  call_data.push_back(CallDataEntry{key, std::move(value)});
}

CallDataScope::~CallDataScope() {
  call_data.pop_back();
}

std::shared_ptr<const void> find_call_data(const void* key) {
  for (auto it = call_data.rbegin(); it != call_data.rend(); ++it) {
    if (it->key == key) return it->value;
  }
  return nullptr;
}

CallDataStack call_data_snapshot() {
  return call_data;
}

CallDataRestore::CallDataRestore(CallDataStack stack)
    : saved_(std::exchange(call_data, std::move(stack))) {}

CallDataRestore::~CallDataRestore() {
  call_data = std::move(saved_);
}

}  // namespace tandem
