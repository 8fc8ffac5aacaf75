#include "tools/train/options.h"

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "tandem/runtime/error.h"

namespace tandem::train {

Command parse_command_line(const std::vector<std::string>& args) {
  Command c;
  TrainOptions& o = c.options;
  CLI::App app{
      "tandem-train: trains a small mixture-of-experts language model, or a Llama-family model "
      "from a Hugging Face config and checkpoint, with data, tensor, context and expert "
      "parallelism and the dual-pipe overlap (defaults: 4 rank threads, cp 2 x ep 2, overlap "
      "on (llama: ep 1, no overlap), the embedded associative-recall task)",
      "tandem-train"};
  app.set_help_all_flag("--help-all", "every option, grouped");

  const std::string launch = "Launch", layout = "Parallel layout", model = "Model and task",
                    optim = "Optimisation", ckpt = "Checkpoints", output = "Output";
  app.add_option("--backend", o.backend, "threads (rank threads in this process), mpi or nccl")
      ->check(CLI::IsMember({"threads", "mpi", "nccl"}))
      ->group(launch);
  app.add_option("--ranks", o.ranks, "threads backend: world size (default dp x ep x cp x tp)")
      ->check(CLI::Range(1, 1024))
      ->group(launch);
  app.add_option("--device", o.device,
                 "cpu, or cuda (threads: the ranks share cuda:0; nccl: one GPU per rank)")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->group(launch);

  app.add_option("--dp", o.dp, "data-parallel degree")->check(CLI::Range(1, 1024))->group(layout);
  int dp_replicate = 0;
  app.add_option("--dp-shard", o.dp_shard,
                 "FSDP: groups of this many data ranks hold each parameter once (default 1: "
                 "DDP; alone it sets --dp)")
      ->check(CLI::Range(1, 1024))
      ->group(layout);
  app.add_flag("--zero1", o.zero1,
               "ZeRO-1: shard AdamW's state over the --dp ranks (each updates its rows of every "
               "parameter, then all-gathers them); with DDP, not --dp-shard")
      ->group(layout);
  app.add_option("--precision", o.precision,
                 "f32, bf16 or f16: compute in bf16/f16 with f32 master weights, optimizer "
                 "state and gradient sums (f16: with dynamic loss scaling)")
      ->check(CLI::IsMember({"f32", "bf16", "f16"}))
      ->group(layout);
  app.add_option("--loss-scale", o.loss_scale,
                 "f16: the initial loss scale (halved on overflow, doubled after 2000 steps "
                 "without one)")
      ->check(CLI::PositiveNumber)
      ->group(layout);
  app.add_option("--dp-replicate", dp_replicate,
                 "HSDP: this many replicas of the --dp-shard groups (--dp = replicate x shard)")
      ->check(CLI::Range(1, 1024))
      ->group(layout);
  app.add_option("--ep", o.ep, "expert-parallel degree (divides --experts)")
      ->check(CLI::Range(1, 1024))
      ->group(layout);
  app.add_option("--cp", o.cp, "context-parallel degree (shards the sequence)")
      ->check(CLI::Range(1, 1024))
      ->group(layout);
  app.add_option("--tp", o.tp, "tensor-parallel degree (attention heads)")
      ->check(CLI::Range(1, 1024))
      ->group(layout);
  app.add_option("--cp-mode", o.cp_mode, "ulysses, allgather (K/V), hybrid or ring")
      ->check(CLI::IsMember({"ulysses", "allgather", "hybrid", "ring"}))
      ->group(layout);
  app.add_option("--ulysses-degree", o.ulysses_degree, "hybrid: the Ulysses part of --cp")
      ->check(CLI::Range(1, 1024))
      ->group(layout);
  app.add_flag("--cp-load-balance", o.load_balance,
               "allgather/ring: chunks r and 2cp-1-r per rank (even causal work)")
      ->group(layout);
  app.add_option("--cp-async", o.cp_async,
                 "collectives launched from the q/k/v projections (ulysses, allgather, hybrid): "
                 "on, off or auto (on where it applies)")
      ->check(CLI::IsMember({"auto", "on", "off"}))
      ->group(layout);
  app.add_option("--micro-batches", o.micro_batches, "micro-batches per step")
      ->check(CLI::Range(1, 4096))
      ->group(layout);
  app.add_option("--grad-bucket-mb", o.grad_bucket_mb,
                 "gradient buckets reduced while the last micro-batch's backward runs (MiB)")
      ->check(CLI::PositiveNumber)
      ->group(layout);
  app.add_flag("--overlap,!--no-overlap", o.overlap,
               "dual-pipe schedule: backward of micro-batch i with forward of i+1 (default on)")
      ->group(layout);

  app.add_option("--model", o.model_type,
                 "moe (the small mixture-of-experts model) or llama (a Llama-family model from "
                 "--config)")
      ->check(CLI::IsMember({"moe", "llama"}))
      ->group(model);
  app.add_option("--config", o.llama_config, "llama: a Hugging Face config.json")->group(model);
  app.add_option("--init-from", o.init_from,
                 "llama: start from this Hugging Face checkpoint directory's weights")
      ->group(model);
  app.add_option("--d-model", o.model.d_model, "model width")
      ->check(CLI::Range(1, 1 << 16))
      ->group(model);
  app.add_option("--layers", o.model.layers, "transformer blocks")
      ->check(CLI::Range(1, 1024))
      ->group(model);
  app.add_option("--heads", o.model.heads, "attention heads")
      ->check(CLI::Range(1, 1024))
      ->group(model);
  app.add_option("--hidden", o.model.hidden, "SwiGLU hidden size per expert")
      ->check(CLI::Range(1, 1 << 20))
      ->group(model);
  app.add_option("--experts", o.model.experts, "experts per MoE layer")
      ->check(CLI::Range(1, 4096))
      ->group(model);
  app.add_option("--top-k", o.model.top_k, "experts per token")
      ->check(CLI::Range(1, 4096))
      ->group(model);
  app.add_option("--pairs", o.recall.pairs, "recall task: key/value pairs per sequence")
      ->check(CLI::Range(1, 1 << 16))
      ->group(model);
  app.add_option("--queries", o.recall.queries, "recall task: queries per sequence")
      ->check(CLI::Range(1, 1 << 16))
      ->group(model);
  app.add_option("--keys", o.recall.keys, "recall task: key vocabulary")
      ->check(CLI::Range(1, 1 << 20))
      ->group(model);
  app.add_option("--values", o.recall.values, "recall task: value vocabulary")
      ->check(CLI::Range(1, 1 << 20))
      ->group(model);
  app.add_option("--data", o.data,
                 "moe: train a byte-level model on this text file instead; llama: the token file "
                 "(llm.c format) to train on")
      ->group(model);
  app.add_option("--seq-len", o.seq_len, "with --data: tokens (bytes) per sequence")
      ->check(CLI::Range(2, 1 << 20))
      ->group(model);

  app.add_option("--steps", o.steps, "optimizer steps")
      ->check(CLI::Range(1, 1 << 30))
      ->group(optim);
  app.add_option("--batch", o.batch, "sequences per micro-batch per data rank")
      ->check(CLI::Range(1, 1 << 20))
      ->group(optim);
  app.add_option("--lr", o.lr, "peak learning rate (AdamW)")
      ->check(CLI::PositiveNumber)
      ->group(optim);
  app.add_option("--min-lr", o.min_lr, "final learning rate of the cosine schedule")
      ->check(CLI::NonNegativeNumber)
      ->group(optim);
  app.add_option("--warmup", o.warmup, "warm-up steps")
      ->check(CLI::NonNegativeNumber)
      ->group(optim);
  app.add_option("--weight-decay", o.weight_decay, "AdamW decoupled weight decay")
      ->check(CLI::NonNegativeNumber)
      ->group(optim);
  app.add_option("--clip", o.clip, "clip the global gradient norm (0: off)")
      ->check(CLI::NonNegativeNumber)
      ->group(optim);
  app.add_option("--aux-weight", o.aux_weight, "weight of the MoE load-balancing loss")
      ->check(CLI::NonNegativeNumber)
      ->group(optim);
  app.add_option("--seed", o.seed, "initial weights and data")->group(optim);
  app.add_option("--stop-accuracy", o.stop_accuracy,
                 "stop at a logged step whose accuracy reaches this (0..1)")
      ->check(CLI::Range(0.0, 1.0))
      ->group(optim);

  app.add_option("--save", o.save_dir, "checkpoint root directory")->group(ckpt);
  app.add_option("--save-every", o.save_every, "save every N steps (and at the end)")
      ->check(CLI::NonNegativeNumber)
      ->group(ckpt);
  app.add_option("--keep", o.keep, "complete checkpoints to keep")
      ->check(CLI::Range(1, 1 << 20))
      ->group(ckpt);
  app.add_option("--resume", o.resume, "continue from a checkpoint (root or step directory)")
      ->group(ckpt);

  app.add_option("--trace", o.trace, "write a Chrome trace of a few steps (view: tandem-trace)")
      ->group(output);
  app.add_option("--trace-steps", o.trace_steps, "steps to trace")
      ->check(CLI::Range(1, 1 << 20))
      ->group(output);
  app.add_option("--log-every", o.log_every, "a permanent progress line every N steps")
      ->check(CLI::Range(1, 1 << 30))
      ->group(output);
  app.add_option("--progress", o.progress,
                 "auto (in-place line on a terminal), line, plain or quiet")
      ->check(CLI::IsMember({"auto", "line", "plain", "quiet"}))
      ->group(output);

  app.add_option("--inject-fault", o.fault,
                 "testing: RANK:STEP:KIND with KIND forward|backward|step-end|exit|hang")
      ->group(output);

  CLI::App* exp = app.add_subcommand(
      "export",
      "write a checkpoint's model whole: a llama model as a Hugging Face checkpoint directory, "
      "the moe model as one safetensors file");
  exp->add_option("checkpoint", c.export_from, "checkpoint root or step directory")->required();
  exp->add_option("out", c.export_to,
                  "llama: output directory (config.json, model.safetensors); moe: output "
                  ".safetensors file")
      ->required();
  exp->add_option("--dtype", c.export_dtype, "llama: weights as f32 or bf16")
      ->check(CLI::IsMember({"f32", "bf16"}));

  std::vector<std::string> reversed(args.rbegin(), args.rend() - (args.empty() ? 0 : 1));
  try {
    app.parse(reversed);
  } catch (const CLI::CallForHelp&) {
    c.kind = Command::Kind::Help;
    c.help = app.help();
    return c;
  } catch (const CLI::CallForAllHelp&) {
    c.kind = Command::Kind::Help;
    c.help = app.help("", CLI::AppFormatMode::All);
    return c;
  } catch (const CLI::ParseError& e) {
    TANDEM_FAIL("{} (run with --help for the options)", e.what());
  }
  if (*exp) c.kind = Command::Kind::Export;
  // --dp = --dp-replicate x --dp-shard; --dp-shard alone shards over every
  // data rank.
  if (app.count("--dp-replicate") > 0) {
    const int implied = dp_replicate * o.dp_shard;
    TANDEM_CHECK(app.count("--dp") == 0 || o.dp == implied,
                 "[train] expected --dp = --dp-replicate x --dp-shard = {} x {} = {}, got --dp {}",
                 dp_replicate, o.dp_shard, implied, o.dp);
    o.dp = implied;
  } else if (app.count("--dp-shard") > 0 && app.count("--dp") == 0) {
    o.dp = o.dp_shard;
  }
  // A dense model has no experts to place: its default layout has no ep, nor
  // expert all-to-alls for the dual-pipe overlap to pair (a Mixtral config
  // asks for them with --ep and --overlap).
  if (o.model_type == "llama" && app.count("--ep") == 0) o.ep = 1;
  if (o.model_type == "llama" && app.count("--overlap") + app.count("--no-overlap") == 0)
    o.overlap = false;
  return c;
}

}  // namespace tandem::train
