// The fully sharded rows of `tandem-bench fsdp` (parallel/fsdp.h): memory per
// rank and the communication FSDP hides, on 4 rank threads.
//
// Note [FSDP benchmark]
// ~~~~~~~~~~~~~~~~~~~~~
// The model: kBlocks blocks of Linear(kWidth, kWidth) + tanh, each block one
// FSDP group (the root has no parameters of its own), AdamW, few rows per
// rank so that parameters and their state dominate a step's memory, as they
// do in the large models FSDP is for. One step = forward, backward,
// finish(), optimizer step.
//   fsdp-memory state   parameters + gradients + AdamW state held by a rank
//                       between steps (counted from the tensors, exact),
//                       against the same model unsharded on one rank;
//                       target <= 1/4 + 5% (issue 19), i.e. ratio >= 3.33.
//   fsdp-memory peak    a step's peak per rank against the unsharded
//                       step's (one rank alone on this thread, peak
//                       allocated minus what was allocated before its
//                       model existed). The rank threads share one
//                       allocator, so a rank's peak is the process peak
//                       over the step / 4, as `cp` does (Note [CP benchmark
//                       method]); target <= 0.4x (ratio >= 2.5).
//   fsdp-link hidden    the threads backend behind a simulated link whose
//                       bandwidth makes one block's all-gather take as long
//                       as one block's forward on the free link. Each trial
//                       runs one step on that link and one on a free link
//                       (zero latency, infinite bandwidth, the data still
//                       moves), the order alternating; exposed = link step -
//                       free step, median over trials. The collectives' time
//                       is what the link charges for one step's collectives
//                       (per group: the forward's all-gather, the backward's
//                       and the reduce-scatter; Note [Simulated link
//                       timing]). Target exposed <= 0.2x of it (>= 80%
//                       hidden), as the ratio comm / exposed >= 5.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "tandem/autograd/nn/container.h"
#include "tandem/autograd/nn/linear.h"
#include "tandem/autograd/ops.h"
#include "tandem/autograd/optim.h"
#include "tandem/comm/sim_link.h"
#include "tandem/comm/threads/threads_backend.h"
#include "tandem/parallel/fsdp.h"
#include "tandem/runtime/allocator.h"
#include "tandem/tensor/ops.h"
#include "tools/bench/bench.h"

namespace tandem::bench {
namespace {

using Clock = std::chrono::steady_clock;
using Json = nlohmann::ordered_json;

constexpr int kRanks = 4;
constexpr int64_t kWidth = 512, kRows = 32;
constexpr double kStateTarget = 1.0 / kRanks + 0.05, kPeakTarget = 0.4, kExposedTarget = 0.2;
constexpr double kLatencyUs = 5;

class Block final : public Module {
 public:
  explicit Block(Generator& gen) : Module("Block") {
    linear_ = register_module(
        "linear", nn::make<nn::Linear>({.in_features = kWidth, .out_features = kWidth}, gen));
  }

 protected:
  std::vector<Tensor> forward(Args& args) override {
    return {tanh((*linear_)(nn::single_input(args, "Block")))};
  }

 private:
  std::shared_ptr<nn::Linear> linear_;
};

class Stack final : public Module {
 public:
  explicit Stack(int blocks) : Module("Stack") {
    Generator gen(11);  // the same weights on every rank
    for (int i = 0; i < blocks; ++i)
      blocks_.push_back(register_module("b" + std::to_string(i), std::make_shared<Block>(gen)));
  }
  std::vector<std::shared_ptr<Module>> blocks() const { return {blocks_.begin(), blocks_.end()}; }

 protected:
  std::vector<Tensor> forward(Args& args) override {
    Tensor h = nn::single_input(args, "Stack");
    for (auto& b : blocks_)
      h = (*b)(h);
    return {mean(h)};
  }

 private:
  std::vector<std::shared_ptr<Block>> blocks_;
};

double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Bytes a rank holds between steps: parameters, gradients, optimizer state.
double state_bytes(const Module& model, const optim::Optimizer& opt) {
  double bytes = 0;
  for (const auto& [name, p] : model.named_parameters()) {
    bytes += static_cast<double>(p.nbytes());
    const Tensor g = grad(p);
    if (g.defined()) bytes += static_cast<double>(g.nbytes());
  }
  for (const auto& [name, t] : opt.state_dict())
    bytes += static_cast<double>(t.nbytes());
  return bytes;
}

struct Single {
  double state = 0, peak = 0;
};

// The unsharded model alone on this thread.
Single run_single(int blocks) {
  Single s;
  Generator gen(100);
  const Tensor x = ops::randn({kRows * kRanks, kWidth}, gen);
  const int64_t base = memory_stats(Device::cpu()).allocated_bytes;
  {
    auto model = std::make_shared<Stack>(blocks);
    optim::AdamW opt(model->named_parameters(), {.lr = 1e-3});
    for (int step = 0; step < 2; ++step) {
      if (step == 1) reset_peak_memory(Device::cpu());
      backward((*model)(ops::narrow(x, 0, 0, kRows)));  // a rank's rows
      opt.step();
      if (step == 1) {
        s.peak = static_cast<double>(memory_stats(Device::cpu()).peak_allocated_bytes - base);
        s.state = state_bytes(*model, opt);
      }
      opt.zero_grad();
    }
  }
  empty_cache(Device::cpu());
  return s;
}

struct Sharded {
  double state = 0, peak = 0;  // per rank
  double block_forward_s = 0;  // rank 0's, on the free link, all ranks running
  LinkModel link;
  std::vector<double> link_s, free_s;
};

// The link on which a block's all-gather (the gathered bytes' (n-1)/n)
// takes `block_forward_s`.
LinkModel calibrated_link(double block_forward_s) {
  const double block_bytes = static_cast<double>(kWidth * kWidth + kWidth) * 4;
  LinkModel link;
  link.latency_us = kLatencyUs;
  link.bandwidth_gbps = (kRanks - 1.0) / kRanks * block_bytes /
                        std::max(block_forward_s * 1e6 - kLatencyUs, 1.0) / 1e3;
  return link;
}

// Rank threads, each with a model on the free link, then one on the link
// calibrated from the free steps' forwards.
Sharded run_sharded(int blocks, int trials) {
  Sharded out;
  const LinkModel free_link{0.0, std::numeric_limits<double>::infinity(), {}};
  Lockstep lockstep(kRanks);
  run_ranks(kRanks, [&](ProcessGroupPtr pg) {
    lockstep.guard([&] {
      ops::set_num_threads(1);  // one kernel thread per rank thread
      const bool leader = pg->rank() == 0;
      Generator gen(100);
      const Tensor x =
          ops::narrow(ops::randn({kRows * kRanks, kWidth}, gen), 0, kRows * pg->rank(), kRows);
      lockstep.sync();
      const int64_t base = memory_stats(Device::cpu()).allocated_bytes;
      lockstep.sync();
      struct Copy {
        std::shared_ptr<Stack> model;
        std::unique_ptr<FullyShardedDataParallel> fsdp;
        std::unique_ptr<optim::AdamW> opt;
      };
      auto make = [&](const LinkModel& l) {
        Copy c;
        c.model = std::make_shared<Stack>(blocks);
        DeviceMesh mesh(simulate_link(pg, l), {kRanks}, {"dp"});
        c.fsdp = std::make_unique<FullyShardedDataParallel>(c.model, c.model->blocks(), mesh);
        c.opt = std::make_unique<optim::AdamW>(c.model->named_parameters(),
                                               optim::AdamWOptions{.lr = 1e-3});
        return c;
      };
      double forward_s = 0;
      auto step = [&](Copy& c, bool read_state = false) {
        lockstep.sync();
        const auto t0 = Clock::now();
        Tensor loss = (*c.model)(x);
        forward_s = seconds_between(t0, Clock::now());
        backward(loss);
        c.fsdp->finish();
        c.opt->step();
        if (read_state && leader) out.state = state_bytes(*c.model, *c.opt);
        c.opt->zero_grad();
        lockstep.sync();
        return seconds_between(t0, Clock::now());
      };
      Copy free_copy = make(free_link);
      step(free_copy);  // the first step records the forward order
      lockstep.sync();
      if (leader) reset_peak_memory(Device::cpu());
      step(free_copy, /*read_state=*/true);
      if (leader) {
        out.peak =
            static_cast<double>(memory_stats(Device::cpu()).peak_allocated_bytes - base) / kRanks;
      }
      lockstep.sync();  // read before anybody allocates the next copy
      std::vector<double> forwards;
      for (int i = 0; i < 3; ++i) {
        step(free_copy);
        forwards.push_back(forward_s);
      }
      if (leader) {
        out.block_forward_s = sample_median(forwards) / blocks;
        out.link = calibrated_link(out.block_forward_s);
      }
      lockstep.sync();  // publishes out.link
      Copy link_copy = make(out.link);
      step(link_copy);
      for (int t = 0; t < trials; ++t) {
        double l = 0, f = 0;
        if (t % 2 == 0) {
          l = step(link_copy);
          f = step(free_copy);
        } else {
          f = step(free_copy);
          l = step(link_copy);
        }
        if (leader) {
          out.link_s.push_back(l);
          out.free_s.push_back(f);
        }
      }
    });
  });
  empty_cache(Device::cpu());
  return out;
}

Row memory_row(const std::string& name, double tandem, double baseline, double target_max) {
  Row row;
  row.group = "fsdp-memory";
  row.name = name;
  row.device = "cpu";
  row.threads = kRanks;
  row.baseline = "unsharded, one rank";
  row.memory = true;
  row.target = 1.0 / target_max;
  row.timing.tandem.median_s = row.timing.tandem.min_s = tandem;
  row.timing.baseline.median_s = row.timing.baseline.min_s = baseline;
  row.timing.ratio = baseline / tandem;
  return row;
}

}  // namespace

void bench_fsdp_sharded(Report& report, const Options& options) {
  const int blocks = options.quick ? 8 : 16, trials = options.quick ? 3 : 7;
  Row probe = memory_row("state per rank", 1, 1, 1);
  Row hidden;
  hidden.group = "fsdp-link";
  hidden.name = "fsdp comm hidden";
  if (!report.wants(probe) && !report.wants(hidden)) return;
  const Single single = run_single(blocks);
  const Sharded sharded = run_sharded(blocks, trials);
  const LinkModel& link = sharded.link;
  const double moved = (kRanks - 1.0) / kRanks * static_cast<double>(kWidth * kWidth + kWidth) * 4;
  // Per step: each block's forward all-gather, backward all-gather and
  // reduce-scatter (the same bytes each).
  const double comm_s = 3.0 * blocks * link.transfer_us(CollectiveKind::AllGather, moved) * 1e-6;
  std::vector<double> exposed;
  for (size_t t = 0; t < sharded.link_s.size(); ++t)
    exposed.push_back(sharded.link_s[t] - sharded.free_s[t]);
  const double exposed_s = std::max(sample_median(exposed), 0.0);
  report.set(
      "fsdp",
      {{"blocks", blocks},
       {"width", kWidth},
       {"rows_per_rank", kRows},
       {"ranks", kRanks},
       {"unsharded_state_bytes", single.state},
       {"state_bytes_per_rank", sharded.state},
       {"unsharded_peak_bytes", single.peak},
       {"peak_bytes_per_rank", sharded.peak},
       {"link", {{"latency_us", link.latency_us}, {"bandwidth_gbps", link.bandwidth_gbps}}},
       {"block_forward_ms", sharded.block_forward_s * 1e3},
       {"comm_ms", comm_s * 1e3},
       {"link_step_ms", sample_median(sharded.link_s) * 1e3},
       {"free_step_ms", sample_median(sharded.free_s) * 1e3},
       {"exposed_ms", exposed_s * 1e3},
       {"hidden_share", 1.0 - std::min(exposed_s / comm_s, 1.0)}},
      fmt::format("\nfsdp: {} blocks of Linear {}x{} + tanh, {} rows per rank, AdamW; state per "
                  "rank {:.2f} MiB (unsharded {:.2f}), step peak per rank {:.2f} MiB (unsharded "
                  "{:.2f}); link {:.1f} us + bytes / {:.3f} GB/s (a block's all-gather = its "
                  "forward, {:.2f} ms): step {:.1f} ms on it, {:.1f} ms on a free link, exposed "
                  "{:.1f} of {:.1f} ms of collectives ({:.0f}% hidden)",
                  blocks, kWidth, kWidth, kRows, sharded.state / (1 << 20),
                  single.state / (1 << 20), sharded.peak / (1 << 20), single.peak / (1 << 20),
                  link.latency_us, link.bandwidth_gbps, sharded.block_forward_s * 1e3,
                  sample_median(sharded.link_s) * 1e3, sample_median(sharded.free_s) * 1e3,
                  exposed_s * 1e3, comm_s * 1e3, 100 * (1.0 - std::min(exposed_s / comm_s, 1.0))));
  report.add(memory_row("state per rank", sharded.state, single.state, kStateTarget));
  report.add(memory_row("step peak per rank", sharded.peak, single.peak, kPeakTarget));
  hidden.device = "cpu";
  hidden.threads = kRanks;
  hidden.baseline = "link time of the collectives";
  hidden.target = 1.0 / kExposedTarget;
  hidden.timing.tandem = timing_of_steps({exposed_s});
  hidden.timing.baseline = timing_of_steps({comm_s});
  hidden.timing.ratio = comm_s / std::max(exposed_s, comm_s / 100);  // capped as the cp rows
  report.add(std::move(hidden));
}

}  // namespace tandem::bench
