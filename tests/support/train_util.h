// Helpers of the tandem-train suites (tests/train).
#pragma once

#include <vector>

#include "tests/support/test_device.h"
#include "tools/train/trainer.h"

namespace tandem::test {

// Rank 0's loss of every step run.
inline std::vector<double> losses(const train::TrainResult& r) {
  std::vector<double> out;
  for (const train::StepStats& s : r.steps)
    out.push_back(s.loss);
  return out;
}

// A small job that runs in well under a second per step on 2 cores.
inline train::TrainOptions tiny() {
  train::TrainOptions o;
  o.model.d_model = 32;
  o.model.layers = 2;
  o.model.heads = 4;
  o.model.hidden = 32;
  o.model.experts = 4;
  o.recall = {8, 4, 6, 10};  // keys, values, pairs, queries: S = 16
  o.batch = 4;
  o.steps = 6;
  o.warmup = 2;
  o.lr = 1e-2;
  o.progress = "quiet";
  o.device = test_device().is_cuda() ? "cuda" : "cpu";
  return o;
}

// tiny() on the mesh (dp, ep, cp, tp).
inline train::TrainOptions on_layout(int dp, int ep, int cp, int tp) {
  train::TrainOptions o = tiny();
  o.dp = dp;
  o.ep = ep;
  o.cp = cp;
  o.tp = tp;
  return o;
}

// tiny() on a (dp, ep, cp) layout, dp_shard of the dp ranks sharding the
// parameters (FSDP), with the sequential schedule.
inline train::TrainOptions sharded(int dp, int dp_shard, int ep, int cp) {
  train::TrainOptions o = on_layout(dp, ep, cp, 1);
  o.dp_shard = dp_shard;
  o.overlap = false;
  return o;
}

}  // namespace tandem::test
