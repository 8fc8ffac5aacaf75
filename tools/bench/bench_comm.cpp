// Placeholder until the comm benchmark lands.
#include "tools/bench/bench.h"

#include <stdexcept>

namespace tandem::bench {
int run_comm(const Options&) { throw std::runtime_error("the comm benchmark is not built yet"); }
}  // namespace tandem::bench
