#include "tools/train/trainer.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>
#include <utility>

#include "tandem/autograd/mixed_precision.h"
#include "tandem/autograd/node.h"
#include "tandem/autograd/ops.h"
#include "tandem/autograd/optim.h"
#include "tandem/comm/backend.h"
#include "tandem/comm/threads/threads_backend.h"
#include "tandem/comm/work.h"
#include "tandem/parallel/checkpoint.h"
#include "tandem/parallel/context_parallel.h"
#include "tandem/parallel/data_parallel.h"
#include "tandem/parallel/ddp.h"
#include "tandem/parallel/device_mesh.h"
#include "tandem/parallel/dual_pipe.h"
#include "tandem/parallel/fsdp.h"
#include "tandem/parallel/param_placement.h"
#include "tandem/parallel/placement.h"
#include "tandem/parallel/tensor_parallel.h"
#include "tandem/parallel/zero.h"
#include "tandem/runtime/allocator.h"
#include "tandem/runtime/config.h"
#include "tandem/runtime/error.h"
#include "tandem/runtime/trace.h"
#include "tandem/tensor/io/safetensors.h"
#include "tools/train/progress.h"
#include "tools/train/train_model.h"

namespace tandem::train {

namespace {

using Clock = std::chrono::steady_clock;
using Json = nlohmann::json;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// AdamW, or with --zero1 its ZeRO-1 form over the dp dim (Note [ZeRO-1]).
struct StepOptimizer {
  std::unique_ptr<optim::AdamW> adamw;
  std::unique_ptr<ZeroRedundancyOptimizer> zero;

  void set_lr(double lr) { zero ? zero->set_lr(lr) : adamw->set_lr(lr); }
  void step() { zero ? zero->step() : adamw->step(); }
  void zero_grad() { zero ? zero->zero_grad() : adamw->zero_grad(); }
  std::map<std::string, Tensor> state_dict() const {
    return zero ? zero->state_dict() : adamw->state_dict();
  }
  void load_state_dict(const std::map<std::string, Tensor>& state) {
    zero ? zero->load_state_dict(state) : adamw->load_state_dict(state);
  }
};

// Everything one rank builds once.
struct Rank {
  const TrainOptions& options;
  const Task& task;
  ProcessGroupPtr world;
  Device device = Device::cpu();
  DeviceMesh mesh;
  int dp_rank = 0, ep_rank = 0, cp_rank = 0;
  std::unique_ptr<TrainModel> model;
  std::unique_ptr<DualPipe> pipe;              // a model with experts
  std::unique_ptr<DualPipeSchedule> schedule;  // a dense one: sequential
  optim::NamedParams params;    // this rank's pieces, placed (Note [Parameter placements])
  std::vector<Tensor> tensors;  // the same, without names
  StepOptimizer optimizer;
  std::unique_ptr<DistributedDataParallel> ddp;    // gradient reduction (Note [DDP buckets])
  std::unique_ptr<FullyShardedDataParallel> fsdp;  // --dp-shard > 1 (Note [FSDP])
  std::unique_ptr<MasterWeights> master;           // --precision bf16/f16 (Note [Master weights])
  std::unique_ptr<LossScaler> scaler;              // f16 (Note [Dynamic loss scaling])
  // The mesh dims of the data ranks and of what DDP sums over (Note
  // [Training layout]): with FSDP, dp is ("dp_replicate", "dp_shard") and
  // FSDP reduces over dp_shard itself.
  std::vector<std::string> data_dims, ddp_dims;

  Rank(const TrainOptions& o, const Task& t, ProcessGroupPtr w)
      : options(o), task(t), world(std::move(w)), device(Device::parse(o.device)) {}
  int data_rank() const { return dp_rank * options.ep + ep_rank; }
  bool root() const { return world->rank() == 0; }
};

// Whether the CP layers are AsyncContextParallel's (--cp-async on or auto):
// Ulysses, all-gather KV and hybrid. Ring keeps its transfers in flight
// behind each block's compute in any case (Note [Ring backward in flight]).
// The llama model's QK-norm and rotary embedding move into the projection
// hooks (Note [Rotary before the exchange]).
bool cp_async(const TrainOptions& o) {
  return o.cp > 1 && o.cp_mode != "ring" && o.cp_async != "off";
}

std::string layout_string(const TrainOptions& o, int world) {
  std::string cp;
  if (o.cp > 1) {
    cp = fmt::format(" ({}{}{}{})", o.cp_mode,
                     o.cp_mode == "hybrid" ? fmt::format(", Ulysses degree {}", o.ulysses_degree)
                                           : std::string(),
                     o.load_balance ? ", load-balanced" : "", cp_async(o) ? ", async" : "");
  }
  const std::string dp = o.dp_shard == 1 ? fmt::format("dp {}{}", o.dp, o.zero1 ? " (ZeRO-1)" : "")
                         : o.dp_shard == o.dp ? fmt::format("dp {} (FSDP)", o.dp)
                                              : fmt::format("dp {} (HSDP: {} x FSDP {})", o.dp,
                                                            o.dp / o.dp_shard, o.dp_shard);
  return fmt::format(
      "{} ranks, {} backend, {}: {} x ep {} x cp {}{} x tp {}; {} micro-batches, "
      "{}{}",
      world, o.backend, o.device, dp, o.ep, o.cp, cp, o.tp, o.micro_batches,
      o.overlap ? "dual-pipe overlap" : "sequential schedule",
      o.precision == "bf16"  ? ", bf16 with f32 master weights"
      : o.precision == "f16" ? ", f16 with f32 master weights and dynamic loss scaling"
                             : "");
}

void build(Rank& r) {
  const TrainOptions& o = r.options;
  if (o.dp_shard > 1) {
    r.mesh = DeviceMesh(r.world, {o.dp / o.dp_shard, o.dp_shard, o.ep, o.cp, o.tp},
                        {"dp_replicate", "dp_shard", "ep", "cp", "tp"}, {}, r.device);
    // Row-major: the same data rank as the 4-D mesh's "dp" coordinate.
    r.dp_rank =
        r.mesh.get_local_rank("dp_replicate") * o.dp_shard + r.mesh.get_local_rank("dp_shard");
    r.data_dims = {"dp_replicate", "dp_shard", "ep", "cp"};
    r.ddp_dims = {"dp_replicate", "ep", "cp"};
  } else {
    r.mesh = DeviceMesh(r.world, {o.dp, o.ep, o.cp, o.tp}, {"dp", "ep", "cp", "tp"}, {}, r.device);
    r.dp_rank = r.mesh.get_local_rank("dp");
    r.data_dims = {"dp", "ep", "cp"};
    r.ddp_dims = r.data_dims;
  }
  r.ep_rank = r.mesh.get_local_rank("ep");
  r.cp_rank = r.mesh.get_local_rank("cp");

  // The same initial weights on every rank; the styles then keep each rank's part.
  Generator init(o.seed);
  r.model = make_train_model(o, r.task, init);
  const std::shared_ptr<Module> module = r.model->module();
  if (!r.device.is_cpu()) module->to(r.device);

  if (o.tp > 1) parallelize_module(module, r.mesh.slice("tp"), r.model->tp_plan());
  if (o.cp > 1) {
    ContextParallel cp;
    cp.load_balance = o.load_balance;
    cp.ulysses_degree = o.cp_mode == "ulysses"  ? o.cp
                        : o.cp_mode == "hybrid" ? o.ulysses_degree
                                                : 1;
    if (o.cp_mode == "ring") cp.mode = CPMode::Ring;
    const DeviceMesh cp_mesh = r.mesh.slice("cp");
    for (const std::shared_ptr<nn::SelfAttention>& attn : r.model->attention_layers())
      apply_context_parallel(*attn, cp, cp_mesh, cp_async(o));
  }
  // A failure on either worker aborts every group this rank's peers may be
  // waiting in, so they stop at once with an error naming this rank.
  if (r.model->has_experts()) {
    r.pipe = std::make_unique<DualPipe>(module, r.mesh.slice("ep"), r.device);
    r.pipe->abort_on_failure(r.mesh);
  } else {
    r.schedule = std::make_unique<DualPipeSchedule>(std::make_shared<HookCoordinator>(), r.device);
    r.schedule->abort_on_failure(r.mesh);
  }

  // The styles keep their placement records through the cast.
  const bool low = o.precision != "f32";
  if (low) module->to(o.precision == "f16" ? DType::F16 : DType::BF16);
  // After the styles above: FSDP shards what they left on each rank, one
  // group per decoder layer and the rest (embeddings, norm, head) as the root's.
  if (o.dp_shard > 1) {
    r.fsdp = std::make_unique<FullyShardedDataParallel>(
        module, r.model->blocks(), r.mesh,
        FSDPOptions{.shard_dim = "dp_shard",
                    .replicate_dim = "",
                    .op = RedOp::Sum,
                    .reduce_dtype = low ? std::optional<DType>(DType::F32) : std::nullopt});
  }
  r.params = module->named_parameters();
  for (const auto& [name, p] : r.params)
    r.tensors.push_back(p);
  // Note [Training layout]: summed over the data ranks each parameter is
  // replicated over (experts: not over ep), bucket by bucket as the last
  // micro-batch's backward produces them. With FSDP the shards' gradients
  // appear at fsdp->finish(), which reduced them over dp_shard, and DDP sums
  // them over the other data dims at its finish().
  r.ddp = std::make_unique<DistributedDataParallel>(
      r.params, r.mesh, r.ddp_dims,
      DDPOptions{.bucket_bytes = static_cast<int64_t>(o.grad_bucket_mb * (1 << 20)),
                 .reduce_dtype = low ? std::optional<DType>(DType::F32) : std::nullopt});
  if (low) r.master = std::make_unique<MasterWeights>(r.params);
  if (o.precision == "f16")
    r.scaler = std::make_unique<LossScaler>(LossScalerOptions{.init_scale = o.loss_scale});
  const optim::AdamWOptions adamw{
      .lr = o.lr, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = o.weight_decay};
  const optim::NamedParams& updated = r.master ? r.master->params() : r.params;
  if (o.zero1) {
    r.optimizer.zero = std::make_unique<ZeroRedundancyOptimizer>(updated, r.mesh, "dp", adamw);
  } else {
    r.optimizer.adamw = std::make_unique<optim::AdamW>(updated, adamw);
  }
}

// ---- one step ----

// The resident set of this process (/proc/self/statm), 0 where unavailable.
int64_t resident_set_bytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t pages = 0, resident = 0;
  if (!(statm >> pages >> resident)) return 0;
  return resident * static_cast<int64_t>(sysconf(_SC_PAGESIZE));
}

// Note [Injected faults]: fires when this rank reaches `kind` at the step.
void maybe_fault(const Rank& r, const Fault& f, int64_t step, const char* kind) {
  if (f.rank != r.world->rank() || f.step != step || f.kind != kind) return;
  const std::string what =
      fmt::format("injected fault '{}' on rank {} at step {}", f.kind, f.rank, f.step);
  if (f.kind == "exit") {
    std::fprintf(stderr, "tandem-train: %s: the process exits now\n", what.c_str());
    std::fflush(stderr);
    std::_Exit(3);
  }
  if (f.kind == "hang") {
    std::this_thread::sleep_for(2 * wait_timeout());
    return;
  }
  TANDEM_FAIL("[train] {}", what);
}

struct MicroStats {
  double ce_sum = 0;
  double correct = 0;
  double scored = 0;
};

StepStats run_step(Rank& r, int64_t step, const optim::CosineSchedule& schedule,
                   const Fault& fault) {
  const TrainOptions& o = r.options;
  const Clock::time_point start = Clock::now();
  const int64_t wait_before = comm_wait_ns();
  const double lr = schedule.lr(step);
  r.optimizer.set_lr(lr);

  const int64_t S = r.task.seq_len();
  const double scored_global =
      static_cast<double>(o.batch * r.task.scored_per_sequence() * o.dp * o.ep);
  const double replicas = static_cast<double>(o.dp * o.ep * o.cp);
  std::vector<MicroStats> stats(static_cast<size_t>(o.micro_batches));
  const std::vector<int64_t> positions = sequence_positions(S, o.cp, r.cp_rank, o.load_balance);
  // Every CP rank's length, declared so that no CP layer gathers it (Note
  // [Sequence layout as data]).
  const std::optional<DeviceMesh> cp_mesh =
      o.cp > 1 ? std::optional<DeviceMesh>(r.mesh.slice("cp")) : std::nullopt;
  const SequenceLayout cp_layout = shard_sequence_layout(S, o.cp, o.load_balance);

  auto forward = [&](int i) {
    if (i == 1) {
      maybe_fault(r, fault, step, "forward");
      maybe_fault(r, fault, step, "exit");
      maybe_fault(r, fault, step, "hang");
    }
    Batch b = r.task.sample(o.seed, step, i, r.data_rank(), o.batch);
    Tensor tokens = shard_sequence(b.tokens, 1, o.cp, r.cp_rank, o.load_balance);
    Tensor targets = shard_sequence(b.targets, 1, o.cp, r.cp_rank, o.load_balance);
    if (!r.device.is_cpu()) {
      tokens = ops::to(tokens, r.device);
      targets = ops::to(targets, r.device);
    }
    std::optional<SequenceLayoutScope> declared;
    if (cp_mesh) declared.emplace(*cp_mesh, cp_layout);
    const auto [logits, aux_loss] = r.model->forward(tokens, positions);
    declared.reset();
    const int64_t V = logits.shape()[2];
    Tensor flat_logits = reshape(logits, Shape{-1, V});
    if (flat_logits.dtype() != DType::F32) flat_logits = to(flat_logits, DType::F32);
    Tensor flat_targets = ops::reshape(targets, Shape{-1});
    MicroStats& s = stats[static_cast<size_t>(i)];
    Tensor scored_mask = ops::ne(flat_targets, static_cast<double>(kIgnore));
    s.scored = ops::sum(ops::to(scored_mask, DType::F64)).item_double();
    Tensor ce_sum;
    if (s.scored > 0) {
      // cross_entropy averages over the scored tokens; × their count = the sum.
      ce_sum = mul(cross_entropy(flat_logits, flat_targets, kIgnore), s.scored);
      NoGradGuard no_grad;
      s.ce_sum = ce_sum.item_double();
      // Unscored targets are kIgnore, which no argmax equals.
      Tensor hit = ops::eq(ops::argmax(flat_logits, 1), flat_targets);
      s.correct = ops::sum(ops::to(hit, DType::F64)).item_double();
    } else {
      // No scored token here (a context-parallel piece of the prompt): the
      // graph must still reach every layer, whose backward is collective.
      ce_sum = mul(sum(flat_logits), 0.0);
    }
    Tensor loss = div(ce_sum, scored_global);
    if (aux_loss.defined()) loss = add(loss, mul(aux_loss, o.aux_weight / replicas));
    loss = div(loss, static_cast<double>(o.micro_batches));
    if (r.scaler) loss = r.scaler->scale(loss);
    if (i == o.micro_batches - 1) {
      // The last micro-batch's backward reduces what all of them accumulated.
      register_hook(loss, [&r](const Tensor& g) {
        r.ddp->set_sync(true);
        return g;
      });
    }
    if (i == 0 && fault.kind == "backward") {
      register_hook(loss, [&r, &fault, step](const Tensor& g) {
        maybe_fault(r, fault, step, "backward");
        return g;
      });
    }
    return loss;
  };
  r.ddp->set_sync(false);
  if (r.pipe) {
    r.pipe->run(o.micro_batches, forward, o.overlap);
  } else {
    r.schedule->run(o.micro_batches, forward, false);  // validate() refused --overlap
  }
  maybe_fault(r, fault, step, "step-end");

  if (r.fsdp) r.fsdp->finish();
  r.ddp->finish();  // then clipped by the global norm
  if (r.master) r.master->grads_to_master();
  const std::vector<Tensor> updated = r.master ? r.master->tensors() : r.tensors;
  const double loss_scale = r.scaler ? r.scaler->scale() : 0.0;
  if (r.scaler) r.scaler->unscale(updated);
  // The same global norm on every rank: an overflow anywhere skips the step
  // everywhere (Note [Dynamic loss scaling]).
  const double norm = clip_grad_norm(updated, r.mesh, o.clip);
  const bool stepped = !r.scaler || r.scaler->update(!std::isfinite(norm));
  if (stepped) {
    r.optimizer.step();
    if (r.master) r.master->master_to_model();
  }
  // What this rank holds: the model's parameters (and their gradients), the
  // masters', and AdamW's two moment buffers per updated parameter (f32, f64
  // for f64 parameters: optim.h), counted without copying the state.
  int64_t state_bytes = 0;
  for (const std::vector<Tensor>* held : {&std::as_const(r.tensors), &updated}) {
    for (const Tensor& p : *held) {
      state_bytes += static_cast<int64_t>(p.nbytes());
      if (grad(p).defined()) state_bytes += static_cast<int64_t>(grad(p).nbytes());
    }
    if (!r.master) break;  // the same tensors
  }
  if (r.optimizer.zero) {
    state_bytes += r.optimizer.zero->state_bytes();  // its rows' moments (and step counts)
  } else {
    for (const Tensor& p : updated)
      state_bytes += 2 * p.numel() * (p.dtype() == DType::F64 ? 8 : 4);
  }
  r.optimizer.zero_grad();

  MicroStats total;
  for (const MicroStats& s : stats) {
    total.ce_sum += s.ce_sum;
    total.correct += s.correct;
    total.scored += s.scored;
  }
  const std::vector<double> m =
      sum_over(r.mesh, r.data_dims, {total.ce_sum, total.correct, total.scored});
  StepStats s;
  s.step = step;
  s.loss = m[0] / std::max(m[2], 1.0);
  s.accuracy = m[1] / std::max(m[2], 1.0);
  s.lr = lr;
  s.grad_norm = norm;
  s.loss_scale = loss_scale;
  s.skipped = !stepped;
  s.seconds = seconds_since(start);
  const double tokens = static_cast<double>(o.micro_batches * o.batch * S * o.dp * o.ep);
  s.tokens_per_second = tokens / s.seconds;
  // comm_wait_ns is per process: divide by the ranks it holds.
  const int ranks_here = o.backend == "threads" ? r.world->size() : 1;
  s.comm_wait = static_cast<double>(comm_wait_ns() - wait_before) * 1e-9 / ranks_here / s.seconds;
  const MemoryStats mem = memory_stats(r.device);
  s.peak_bytes = mem.peak_allocated_bytes;
  s.reserved_bytes = mem.reserved_bytes;
  s.resident_bytes = resident_set_bytes();
  s.state_bytes = state_bytes;
  return s;
}

// ---- checkpoints ----

// This rank's pieces of the model and optimizer state (Note [Checkpoint
// layout and atomicity] in parallel/checkpoint.h): a piece is written by the
// rank whose coordinates are 0 on every dim that holds a copy of it.
std::vector<TensorPiece> state_pieces(Rank& r, std::map<std::string, Tensor>& optimizer_state) {
  std::vector<TensorPiece> pieces;
  // With master weights the checkpoint holds them (f32), not their rounding.
  const optim::NamedParams& params = r.master ? r.master->params() : r.params;
  for (const auto& [name, p] : params)
    pieces.push_back(placed_piece("model." + name, p, p, r.mesh));
  for (const auto& [name, p] : params) {
    for (const std::string buffer : {"exp_avg", "exp_avg_sq", "step"}) {
      const std::string key = name + "." + buffer;
      auto it = optimizer_state.find(key);
      TANDEM_INTERNAL_ASSERT(it != optimizer_state.end(), "optimizer state {} missing", key);
      if (!r.optimizer.zero || buffer == "step") {
        pieces.push_back(placed_piece("optim." + key, it->second, p, r.mesh));
        continue;
      }
      // ZeRO-1: this dp rank's rows of the moments (Note [ZeRO-1]), so a
      // checkpoint holds each row once and resumes with or without it.
      const auto [start, length] = r.optimizer.zero->rows_of(name);
      if (length > 0)
        pieces.push_back(placed_rows_piece("optim." + key, it->second, start, p, r.mesh, "dp"));
    }
  }
  return pieces;
}

void save(Rank& r, int64_t next_step) {
  std::map<std::string, Tensor> state = r.optimizer.state_dict();
  std::vector<TensorPiece> pieces = state_pieces(r, state);
  const TrainOptions& o = r.options;
  std::map<std::string, std::string> meta = {
      {"next_step", std::to_string(next_step)},
      {"layout",
       Json({{"dp", o.dp}, {"dp_shard", o.dp_shard}, {"ep", o.ep}, {"cp", o.cp}, {"tp", o.tp}})
           .dump()},
      {"model", r.model->identity().dump()},
      {"seed", std::to_string(o.seed)}};
  if (r.scaler) {
    const LossScaler::State st = r.scaler->state();
    meta["loss_scale"] = Json({{"scale", st.scale}, {"good_steps", st.good_steps}}).dump();
  }
  save_checkpoint(o.save_dir, next_step, pieces, meta, r.world, o.keep);
}

// Loads model and optimizer state; returns the step to continue from.
int64_t resume(Rank& r) {
  const TrainOptions& o = r.options;
  CheckpointInfo info = find_checkpoint(o.resume);
  auto model_it = info.meta.find("model");
  TANDEM_CHECK(model_it != info.meta.end() && info.meta.count("next_step"),
               "[train] expected a tandem-train checkpoint in '{}', got one without model "
               "metadata",
               info.path);
  Json saved = Json::parse(model_it->second);
  Json wanted = r.model->identity();
  TANDEM_CHECK(saved == wanted,
               "[train] the checkpoint '{}' holds a different model: expected {}, got {}",
               info.path, wanted.dump(), saved.dump());
  std::map<std::string, Tensor> state = r.optimizer.state_dict();
  std::vector<TensorPiece> pieces = state_pieces(r, state);
  load_checkpoint(info, pieces);
  // Model pieces alias the parameters (filled in place); the optimizer's
  // pieces are copies from state_dict(): hand them back.
  r.optimizer.load_state_dict(state);
  if (r.master) r.master->master_to_model();
  // An f16 run goes on with its loss scale; one resumed from an f32 or bf16
  // checkpoint starts from the default.
  auto scale_it = info.meta.find("loss_scale");
  if (r.scaler && scale_it != info.meta.end()) {
    const Json st = Json::parse(scale_it->second);
    r.scaler->load_state({st.at("scale").get<double>(), st.at("good_steps").get<int64_t>()});
  }
  return std::stoll(info.meta.at("next_step"));
}

// ---- tracing ----

// Under mpi/nccl each process recorded its own ranks: gather the events on
// rank 0 and merge them into one document.
void write_trace(Rank& r, const std::string& path) {
  if (r.options.backend == "threads") {
    r.world->barrier({"trace"})->synchronize();
    if (r.root()) trace_write(path);
    return;
  }
  const std::string mine = trace_json();
  std::vector<uint8_t> bytes(mine.begin(), mine.end());
  Tensor length = ops::scalar_tensor(static_cast<double>(bytes.size()), DType::I64);
  WorkPtr lw = r.world->all_gather(ops::reshape(length, Shape{1}), {});
  lw->wait();
  std::vector<int64_t> lengths = lw->result().to_vector<int64_t>();
  const int64_t longest = *std::max_element(lengths.begin(), lengths.end());
  std::vector<int64_t> padded(static_cast<size_t>(longest), 0);
  for (size_t i = 0; i < bytes.size(); ++i)
    padded[i] = bytes[i];
  WorkPtr w = r.world->all_gather(ops::from_vector(padded, Shape{longest}), {});
  w->wait();
  if (!r.root()) return;
  std::vector<int64_t> all = w->result().to_vector<int64_t>();
  Json merged = {{"traceEvents", Json::array()}, {"displayTimeUnit", "ms"}};
  for (size_t rank = 0; rank < lengths.size(); ++rank) {
    std::string text;
    for (int64_t i = 0; i < lengths[rank]; ++i)
      text.push_back(static_cast<char>(all[rank * longest + i]));
    Json doc = Json::parse(text);
    for (auto& e : doc["traceEvents"])
      merged["traceEvents"].push_back(e);
  }
  write_file_atomically(path, [&](FileWriter& f) {
    const std::string s = merged.dump();
    f.write(s.data(), s.size());
  });
}

// ---- the job ----

void run_rank(const TrainOptions& o, const Task& task, ProcessGroupPtr world, std::FILE* out,
              TrainResult& result) {
  Rank r(o, task, std::move(world));
  build(r);
  std::unique_ptr<Progress> progress;
  if (r.root()) {
    progress = std::make_unique<Progress>(out, o.progress, o.steps, o.log_every);
    progress->message("tandem-train: " + task.describe());
    progress->message("  layout: " + layout_string(o, r.world->size()));
    int64_t n = 0;
    for (auto& [name, p] : r.params)
      n += p.numel();
    progress->message(
        fmt::format("  model: {}; rank 0 holds {} parameters", r.model->describe(), n));
  }
  int64_t first = 0;
  if (!o.resume.empty()) {
    first = resume(r);
    if (progress) progress->message(fmt::format("  resumed from '{}' at step {}", o.resume, first));
  }
  if (r.root()) result.first_step = first;  // TrainResult is rank 0's
  const Fault fault = parse_fault(o.fault);
  const optim::CosineSchedule schedule({.base_lr = o.lr,
                                        .warmup_steps = std::min(o.warmup, o.steps),
                                        .total_steps = o.steps,
                                        .min_lr = o.min_lr});
  const int64_t trace_first = std::min<int64_t>(first + 1, o.steps - 1);
  for (int64_t step = first; step < o.steps; ++step) {
    const bool tracing =
        !o.trace.empty() && step >= trace_first && step < trace_first + o.trace_steps;
    if (tracing && step == trace_first) {
      r.world->barrier({"trace start"})->synchronize();
      if (r.root() || o.backend != "threads") trace_start();
      r.world->barrier({"trace started"})->synchronize();
    }
    if (r.root()) reset_peak_memory(r.device);
    StepStats s = run_step(r, step, schedule, fault);
    if (o.settle_memory) {
      r.world->barrier({"settle"})->synchronize();
      if (r.root()) {
        const MemoryStats mem = memory_stats(r.device);
        s.settled_bytes = mem.allocated_bytes;
        s.peak_bytes = mem.peak_allocated_bytes;  // now covering every rank's step
      }
      r.world->barrier({"settled"})->synchronize();
    }
    const bool last = step + 1 == o.steps;
    const bool stop = o.stop_accuracy > 0 && s.accuracy >= o.stop_accuracy &&
                      ((step + 1) % std::max<int64_t>(o.log_every, 1) == 0 || last);
    if (tracing && (step + 1 == trace_first + o.trace_steps || last || stop)) {
      r.world->barrier({"trace stop"})->synchronize();
      if (r.root() || o.backend != "threads") trace_stop();
      write_trace(r, o.trace);
      if (progress)
        progress->message(
            fmt::format("  trace of {} step(s) written to '{}'", step + 1 - trace_first, o.trace));
    }
    if (r.root()) {
      result.steps.push_back(s);
      progress->step(s, last || stop);
    }
    const bool save_now = !o.save_dir.empty() &&
                          ((o.save_every > 0 && (step + 1) % o.save_every == 0) || last || stop);
    if (save_now) {
      save(r, step + 1);
      if (progress)
        progress->message(
            fmt::format("  checkpoint of step {} saved in '{}'", step + 1, o.save_dir));
    }
    if (stop) {
      if (progress)
        progress->message(fmt::format("  reached {:.1f}% accuracy: stopping", 100.0 * s.accuracy));
      break;
    }
  }
}

}  // namespace

std::unique_ptr<Task> make_task(const TrainOptions& o) {
  if (o.model_type == "llama") {
    TANDEM_CHECK(!o.data.empty(),
                 "[train] --model llama trains on a token file: expected --data TOKENS.BIN "
                 "(tools/tokenize_text.py writes one)");
    return std::make_unique<TokenTask>(o.data, o.seq_len, llama_config(o).vocab_size);
  }
  if (!o.data.empty()) return std::make_unique<TextTask>(o.data, o.seq_len);
  return std::make_unique<RecallTask>(o.recall);
}

TrainResult run_training(const TrainOptions& options, std::FILE* out) {
  std::unique_ptr<Task> task = make_task(options);  // a bad data file fails here, before any rank
  TrainResult result;
  result.task = task->describe();
  if (!options.resume.empty()) find_checkpoint(options.resume);  // fail early
  if (options.backend == "threads") {
    const int world =
        options.ranks > 0 ? options.ranks : options.dp * options.ep * options.cp * options.tp;
    validate(options, world);
    result.layout = layout_string(options, world);
    run_ranks(world, [&](ProcessGroupPtr pg) { run_rank(options, *task, pg, out, result); });
    return result;
  }
  TANDEM_CHECK(options.backend == "mpi" || options.backend == "nccl",
               "[train] expected --backend threads|mpi|nccl, got '{}'", options.backend);
  TANDEM_CHECK(backend_available(options.backend),
               "[train] the {} backend is not available in this build or on this machine",
               options.backend);
  ProcessGroupPtr world = create_world(options.backend);
  validate(options, world->size());
  result.layout = layout_string(options, world->size());
  run_rank(options, *task, world, world->rank() == 0 ? out : nullptr, result);
  return result;
}

void export_checkpoint(const std::string& checkpoint, const std::string& out_path, DType dtype) {
  CheckpointInfo info = find_checkpoint(checkpoint);
  auto model_it = info.meta.find("model");
  const Json identity =
      model_it == info.meta.end() ? Json() : Json::parse(model_it->second, nullptr, false);
  const bool llama = identity.is_object() && identity.value("type", "") == "llama";
  if (!llama) {
    TANDEM_CHECK(dtype == DType::F32,
                 "[train::export] the moe model exports f32 only, got {} (--dtype applies to "
                 "llama checkpoints)",
                 dtype_name(dtype));
    consolidate_checkpoint(info, out_path, "model.");
    return;
  }
  // A Hugging Face directory: the whole tensors under their own names (the
  // model's names are the checkpoint format's), the config beside them, then
  // read back through the model, which checks every name and shape, and
  // written as save_pretrained writes it.
  namespace fs = std::filesystem;
  fs::create_directories(out_path);
  const LlamaConfig config = LlamaConfig::from_json(identity.at("config"));
  consolidate_checkpoint(info, (fs::path(out_path) / "model.safetensors").string(), "model.");
  Generator unused(0);
  LlamaForCausalLM model(config, unused);
  load_hf_checkpoint(model, out_path);
  save_hf_checkpoint(model, out_path, dtype);
}

}  // namespace tandem::train
