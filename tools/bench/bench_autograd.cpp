// Placeholder until the autograd benchmark lands.
#include "tools/bench/bench.h"

#include <stdexcept>

namespace tandem::bench {
int run_autograd(const Options&) { throw std::runtime_error("the autograd benchmark is not built yet"); }
}  // namespace tandem::bench
