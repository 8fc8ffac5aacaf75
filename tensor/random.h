// Counter-based random numbers (Philox4x32-10). Element i of a draw uses the
// counter offset + i and key = seed (uniform: word 0; normal: Box-Muller on
// words 0 and 1, evaluated in double), so the same
// (seed, offset) gives the same numbers on CPU and CUDA, in any order and on
// any number of threads; distributed tests compare ranks by regenerating.
#pragma once

#include <cmath>
#include <cstdint>

#include "tandem/tensor/half.h"

namespace tandem {

class Generator {
 public:
  explicit Generator(uint64_t seed = 0) : seed_(seed) {}
  uint64_t seed() const { return seed_; }
  uint64_t offset() const { return offset_; }
  void set_state(uint64_t seed, uint64_t offset) {
    seed_ = seed;
    offset_ = offset;
  }
  // Reserves `n` counters (one per element) and returns the first.
  uint64_t advance(uint64_t n) {
    uint64_t start = offset_;
    offset_ += n;
    return start;
  }

 private:
  uint64_t seed_;
  uint64_t offset_ = 0;
};

struct Philox4 {
  uint32_t x[4];
};

TANDEM_HOST_DEVICE inline Philox4 philox4x32(uint64_t counter, uint64_t seed) {
  uint32_t c0 = static_cast<uint32_t>(counter), c1 = static_cast<uint32_t>(counter >> 32);
  uint32_t c2 = 0, c3 = 0;
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    uint64_t p0 = static_cast<uint64_t>(0xD2511F53u) * c0;
    uint64_t p1 = static_cast<uint64_t>(0xCD9E8D57u) * c2;
    uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    uint32_t n0 = hi1 ^ c1 ^ k0, n1 = lo1, n2 = hi0 ^ c3 ^ k1, n3 = lo0;
    c0 = n0;
    c1 = n1;
    c2 = n2;
    c3 = n3;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return Philox4{{c0, c1, c2, c3}};
}

// Uniform in [0, 1) with 24 random bits: exact in float, same on every device.
TANDEM_HOST_DEVICE inline float philox_uniform(uint64_t offset, uint64_t seed, int64_t i) {
  Philox4 r = philox4x32(offset + static_cast<uint64_t>(i), seed);
  return static_cast<float>(r.x[0] >> 8) * (1.0f / 16777216.0f);
}

// Standard normal by Box-Muller (u1 in (0, 1], so the log is finite).
TANDEM_HOST_DEVICE inline double philox_normal(uint64_t offset, uint64_t seed, int64_t i) {
  Philox4 r = philox4x32(offset + static_cast<uint64_t>(i), seed);
  double u1 = (static_cast<double>(r.x[0]) + 1.0) * (1.0 / 4294967296.0);
  double u2 = static_cast<double>(r.x[1]) * (1.0 / 4294967296.0);
  // Qualified: tandem:: has a sqrt and a log of its own (tensor/unary_ops.h).
  return ::sqrt(-2.0 * ::log(u1)) * ::cos(6.283185307179586 * u2);
}

}  // namespace tandem
