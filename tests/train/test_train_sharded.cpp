// tandem-train's sharded data parallelism and mixed precision (issue 19):
// FSDP/HSDP and ZeRO-1 against DDP on the same data ranks, their
// checkpoints, and bf16 / f16 with f32 master weights against f32.
#include <catch2/catch.hpp>

#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "tandem/parallel/checkpoint.h"
#include "tandem/tensor/io/safetensors.h"
#include "tandem/tensor/ops.h"
#include "tests/support/test_util.h"
#include "tests/support/train_util.h"
#include "tools/train/options.h"
#include "tools/train/trainer.h"

using namespace tandem;
using tandem::test::losses;
using tandem::test::on_layout;
using tandem::test::sharded;
using tandem::test::TempDir;
using tandem::test::tiny;
using namespace tandem::train;
namespace fs = std::filesystem;

TEST_CASE("FSDP and HSDP train like DDP on the same data ranks", "[train][fsdp]") {
  struct Layout {
    int dp, dp_shard, ep, cp, tp;
  };
  // tp 2: FSDP over the colwise weights' tensor-parallel rows (a nested
  // split, Note [FSDP]).
  for (Layout l : {Layout{4, 4, 1, 1, 1}, Layout{4, 2, 1, 1, 1}, Layout{2, 2, 1, 2, 1},
                   Layout{2, 2, 2, 1, 1}, Layout{2, 2, 1, 1, 2}}) {
    INFO("dp " << l.dp << " dp_shard " << l.dp_shard << " ep " << l.ep << " cp " << l.cp << " tp "
               << l.tp);
    auto layout = [&](int dp_shard) {
      TrainOptions o = sharded(l.dp, dp_shard, l.ep, l.cp);
      o.tp = l.tp;
      return o;
    };
    const TrainResult ddp = run_training(layout(1));
    const TrainResult fsdp = run_training(layout(l.dp_shard));
    REQUIRE(fsdp.steps.size() == ddp.steps.size());
    for (size_t i = 0; i < ddp.steps.size(); ++i) {
      INFO("step " << i);
      CHECK(fsdp.steps[i].loss == Approx(ddp.steps[i].loss).epsilon(1e-5));
    }
    // Parameters, gradients and AdamW state of rank 0: about 1/dp_shard of
    // DDP's (a rank's share of each parameter's rows, rounded up).
    const double share = static_cast<double>(fsdp.steps.back().state_bytes) /
                         static_cast<double>(ddp.steps.back().state_bytes);
    CHECK(share <= 1.0 / l.dp_shard + 0.05);
    CHECK(share >= 1.0 / l.dp_shard - 0.05);
  }
}

TEST_CASE("an FSDP checkpoint resumes bit-exactly, and on DDP", "[train][checkpoint][fsdp]") {
  for (int tp : {1, 2}) {
    INFO("tp " << tp);
    TempDir dir("train");
    auto layout = [&](int dp_shard) {
      TrainOptions o = sharded(4 / tp, dp_shard, 1, 1);
      o.tp = tp;
      return o;
    };
    TrainOptions o = layout(2);
    o.save_dir = (dir.path / "ckpt").string();
    o.save_every = 3;
    const std::vector<double> full = losses(run_training(o));
    REQUIRE(full.size() == 6);

    TrainOptions again = layout(2);
    again.resume = (dir.path / "ckpt" / "step-00000003").string();
    CHECK(losses(run_training(again)) == std::vector<double>(full.begin() + 3, full.end()));

    // Each rank wrote its rows of every parameter (with tp: its rows of its
    // tp rank's rows); DDP reads them back whole (its tp shard).
    TrainOptions ddp = layout(1);
    ddp.resume = again.resume;
    const std::vector<double> resharded = losses(run_training(ddp));
    REQUIRE(resharded.size() == 3);
    for (size_t i = 0; i < 3; ++i)
      CHECK(resharded[i] == Approx(full[3 + i]).epsilon(1e-4));
  }
}

TEST_CASE("--dp-shard and --dp-replicate set the data layout", "[train][fsdp]") {
  CHECK(parse_command_line({"tandem-train", "--dp-shard", "4"}).options.dp == 4);
  Command hsdp = parse_command_line({"tandem-train", "--dp-replicate", "2", "--dp-shard", "2"});
  CHECK(hsdp.options.dp == 4);
  CHECK(hsdp.options.dp_shard == 2);
  CHECK_THROWS_WITH(
      parse_command_line({"tandem-train", "--dp", "3", "--dp-replicate", "2", "--dp-shard", "2"}),
      Catch::Contains("--dp = --dp-replicate x --dp-shard = 2 x 2 = 4, got --dp 3"));
  TrainOptions o = sharded(4, 3, 1, 1);
  CHECK_THROWS_WITH(validate(o, 4), Catch::Contains("--dp-shard to divide --dp"));
  o = sharded(2, 2, 2, 1);
  o.overlap = true;
  CHECK_THROWS_WITH(validate(o, 4), Catch::Contains("--no-overlap"));
}

// Note [Master weights] through tandem-train (--precision bf16 / f16): the
// model computes in 16 bits, AdamW updates f32 masters, DDP and FSDP sum in
// f32; f16 also scales the loss (Note [Dynamic loss scaling]).
TEST_CASE("bf16 and f16 with f32 master weights follow the f32 loss curve", "[train][bf16][f16]") {
  for (bool fsdp : {false, true}) {
    INFO((fsdp ? "dp 4 x FSDP 4" : "the default layout (ep 2 x cp 2, dual-pipe)"));
    TrainOptions o = fsdp ? sharded(4, 4, 1, 1) : tiny();
    o.steps = 30;
    const std::vector<double> f32 = losses(run_training(o));
    for (const char* precision : {"bf16", "f16"}) {
      INFO(precision);
      o.precision = precision;
      // A scale the gradients of this small model fit from the first step
      // (2^16 overflows them twice: the next test).
      o.loss_scale = 1024;
      const TrainResult r = run_training(o);
      const std::vector<double> low = losses(r);
      REQUIRE(low.size() == f32.size());
      CHECK(low != f32);  // it did compute in 16 bits
      // Where the curve ends (the mean of its last 10 steps: one step's loss
      // moves by about 1% with its batch's rounding) within 2% (issue 19), and
      // every step's within 5%.
      auto tail = [](const std::vector<double>& v) {
        double sum = 0;
        for (size_t i = v.size() - 10; i < v.size(); ++i)
          sum += v[i];
        return sum / 10;
      };
      CHECK(tail(low) == Approx(tail(f32)).epsilon(0.02));
      for (size_t i = 0; i < f32.size(); ++i) {
        INFO("step " << i << ": f32 " << f32[i] << ", " << precision << " " << low[i]);
        CHECK(low[i] == Approx(f32[i]).epsilon(0.05));
      }
      for (const StepStats& s : r.steps) {
        CHECK(s.loss_scale == (o.precision == "f16" ? 1024.0 : 0.0));
        CHECK_FALSE(s.skipped);
      }
    }
    o.precision = "f32";
  }
}

// Too high a loss scale overflows the f16 gradients: those steps are skipped
// (the weights keep their values: a step with inf gradients would make them
// NaN) and the scale halves until the gradients fit; a checkpoint keeps the
// scale, so a resumed run goes on skipping where the first would have.
TEST_CASE("f16 skips the steps whose scaled gradients overflow, and resumes the scale",
          "[train][f16][checkpoint]") {
  TempDir dir("train");
  TrainOptions o = tiny();
  o.precision = "f16";
  o.steps = 10;
  o.loss_scale = 1 << 22;
  o.save_dir = (dir.path / "ckpt").string();
  o.save_every = 2;
  o.keep = 10;
  const TrainResult r = run_training(o);
  REQUIRE(r.steps.size() == 10);
  int skipped = 0;
  double scale = o.loss_scale;
  for (const StepStats& s : r.steps) {
    INFO("step " << s.step << ": scale " << s.loss_scale << (s.skipped ? ", skipped" : ""));
    CHECK(s.loss_scale == scale);
    CHECK(std::isfinite(s.loss));
    if (s.skipped) {
      ++skipped;
      CHECK_FALSE(std::isfinite(s.grad_norm));
      scale /= 2;
    }
  }
  CHECK(skipped >= 3);               // 2^22 and the scales just below it overflow
  CHECK(!r.steps[skipped].skipped);  // then the scale fits and stays
  CHECK(r.steps.back().loss < r.steps.front().loss);
  TrainOptions again = o;
  again.save_dir.clear();
  again.save_every = 0;
  again.resume = (dir.path / "ckpt" / "step-00000002").string();
  const TrainResult resumed = run_training(again);
  const std::vector<double> full = losses(r);
  CHECK(losses(resumed) == std::vector<double>(full.begin() + 2, full.end()));
  REQUIRE(resumed.steps.size() == 8);
  CHECK(resumed.steps[0].loss_scale == r.steps[2].loss_scale);
}

TEST_CASE("a bf16 checkpoint holds the f32 masters and resumes bit-exactly",
          "[train][bf16][checkpoint]") {
  TempDir dir("train");
  TrainOptions o = tiny();
  o.precision = "bf16";
  o.save_dir = (dir.path / "ckpt").string();
  o.save_every = 3;
  const std::vector<double> full = losses(run_training(o));
  REQUIRE(full.size() == 6);
  TrainOptions again = o;
  again.save_dir.clear();
  again.save_every = 0;
  again.resume = (dir.path / "ckpt" / "step-00000003").string();
  CHECK(losses(run_training(again)) == std::vector<double>(full.begin() + 3, full.end()));
  // The whole model as exported: f32 values that bf16 cannot hold.
  const std::string out = (dir.path / "model.safetensors").string();
  export_checkpoint((dir.path / "ckpt").string(), out);
  SafetensorsFile f = load_safetensors(out);
  int64_t not_bf16 = 0;
  for (const auto& [name, t] : f.tensors()) {
    REQUIRE(t.dtype() == DType::F32);
    not_bf16 +=
        ops::sum(ops::to(ops::ne(t, ops::to(ops::to(t, DType::BF16), DType::F32)), DType::I64))
            .item<int64_t>();
  }
  CHECK(not_bf16 > 0);
}

// ZeRO-1 (Note [ZeRO-1]) updates each row with AdamW's own arithmetic: the
// losses are DDP's bit for bit on every layout it composes with (cp, ep with
// the dual-pipe overlap, tp; bf16 masters), while a rank holds 1/dp of the
// moments.
TEST_CASE("ZeRO-1 trains bit-identically to DDP with cp, ep and tp", "[train][zero]") {
  struct Layout {
    int dp, ep, cp, tp;
    bool overlap;
    const char* precision;
  };
  for (Layout l : {Layout{2, 2, 1, 1, true, "f32"}, Layout{2, 1, 2, 1, false, "f32"},
                   Layout{2, 1, 1, 2, false, "f32"}, Layout{4, 1, 1, 1, false, "bf16"}}) {
    INFO("dp " << l.dp << " ep " << l.ep << " cp " << l.cp << " tp " << l.tp << " " << l.precision);
    TrainOptions o = on_layout(l.dp, l.ep, l.cp, l.tp);
    o.overlap = l.overlap;
    o.precision = l.precision;
    const TrainResult ddp = run_training(o);
    o.zero1 = true;
    const TrainResult zero = run_training(o);
    CHECK_THAT(zero.layout, Catch::Contains("(ZeRO-1)"));
    CHECK(losses(zero) == losses(ddp));
    CHECK(zero.steps.back().state_bytes < ddp.steps.back().state_bytes);
  }
}

// Each dp rank writes its rows of the moments: a ZeRO-1 checkpoint resumes
// bit-exactly with ZeRO-1 and on plain AdamW, and a DDP one on ZeRO-1.
TEST_CASE("a ZeRO-1 checkpoint resumes bit-exactly, and on plain AdamW",
          "[train][zero][checkpoint]") {
  TempDir dir("train");
  for (bool zero_first : {true, false}) {
    INFO((zero_first ? "saved by ZeRO-1" : "saved by DDP"));
    TrainOptions o = tiny();
    o.dp = 4;
    o.ep = 1;
    o.cp = 1;
    o.overlap = false;
    o.zero1 = zero_first;
    o.save_dir = (dir.path / (zero_first ? "zero" : "ddp")).string();
    o.save_every = 3;
    const std::vector<double> full = losses(run_training(o));
    REQUIRE(full.size() == 6);
    for (bool zero : {true, false}) {
      INFO((zero ? "resumed by ZeRO-1" : "resumed by DDP"));
      TrainOptions again = o;
      again.save_dir.clear();
      again.save_every = 0;
      again.zero1 = zero;
      again.resume = o.save_dir + "/step-00000003";
      CHECK(losses(run_training(again)) == std::vector<double>(full.begin() + 3, full.end()));
    }
  }
  TrainOptions fsdp = sharded(2, 2, 1, 1);
  fsdp.zero1 = true;
  CHECK_THROWS_WITH(run_training(fsdp), Catch::Contains("--zero1 with DDP"));
}
