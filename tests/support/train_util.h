// Helpers of the tandem-train suites (tests/train).
#pragma once

#include <vector>

#include "tools/train/trainer.h"

namespace tandem::test {

// Rank 0's loss of every step run.
inline std::vector<double> losses(const train::TrainResult& r) {
  std::vector<double> out;
  for (const train::StepStats& s : r.steps)
    out.push_back(s.loss);
  return out;
}

}  // namespace tandem::test
