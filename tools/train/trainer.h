// tandem-train's training loop, callable in-process (tests) as well as from
// the command line (tools/train/main.cpp).
//
// Note [Training layout]
// ~~~~~~~~~~~~~~~~~~~~~~
// The world is a 4-D mesh ("dp", "ep", "cp", "tp"), tp innermost (adjacent
// ranks share a node's fastest links, as in Megatron), product = world size.
//   tp  the attention projections: q/k/v column-wise, o row-wise (Megatron);
//       the MoE layers run replicated over tp.
//   cp  the sequence: every core attention is context-parallel (--cp-mode).
//   ep  the experts of every MoE layer (install_dual_pipe: expert parallelism
//       with the dual-pipe sync hooks); the ep ranks see different sequences,
//       so for every other parameter ep is one more data-parallel dim.
//   dp  data parallelism: DDP, or with --dp-shard S the mesh's dp dim is two,
//       ("dp_replicate", "dp_shard") of dp / S and S, the parameters are
//       sharded over dp_shard (FSDP, one group per block) and replicated
//       over dp_replicate (HSDP). The data rank is the same either way.
// --precision bf16 casts the model after the styles (their records stay) and
// gives AdamW f32 master weights (Note [Master weights]); DDP and FSDP sum
// in f32. --precision f16 does the same in f16 and scales the loss (Note
// [Dynamic loss scaling]), skipping the steps whose gradients overflowed.
// The data ranks — the replicas that draw different sequences — are dp × ep;
// every cp and tp rank of one data rank holds the same sequences.
//
// Loss and gradients. A micro-batch's loss on a rank is
//   (Σ over its scored tokens of the cross-entropy) / N
//     + aux_weight · aux / (dp · ep · cp)
// with N the scored tokens of the micro-batch over all data ranks, divided by
// the number of micro-batches. Summed over the dp·ep·cp ranks this is the
// mean loss of the global batch, whichever rank holds which token — a rank
// of a context-parallel group may hold no scored token at all. Gradients are
// therefore summed, not averaged, over the data dims ("dp","ep","cp") each
// parameter is replicated over: expert parameters (owned by one ep rank) over
// ("dp","cp") only. Parameters without a gradient this step (an expert that
// got no token) contribute zeros, so every rank launches the same reductions
// and every parameter's optimizer state advances on every step. Clipping uses
// the global norm, each element of the whole model counted once. Both read
// the placements the styles recorded (DistributedDataParallel, parallel/ddp.h,
// whose buckets launch during the last micro-batch's backward, and
// clip_grad_norm, parallel/data_parallel.h; Note [Parameter placements]).
#pragma once

#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "tools/train/data.h"
#include "tools/train/model.h"

namespace tandem::train {

struct TrainOptions {
  // launch
  std::string backend = "threads";  // threads | mpi | nccl
  int ranks = 0;                    // threads: world size (0: dp·ep·cp·tp)
  std::string device = "cpu";
  // parallel layout (Note [Training layout])
  int dp = 1, ep = 2, cp = 2, tp = 1;
  // Of the dp data ranks, groups of dp_shard hold each parameter once
  // (FSDP, parallel/fsdp.h); dp / dp_shard such groups replicate it (HSDP
  // when both exceed 1). 1: every dp rank holds every parameter (DDP).
  int dp_shard = 1;
  // ZeRO-1 (parallel/zero.h): with DDP, AdamW's state sharded over the dp
  // ranks by rows; each updates its rows and all-gathers them.
  bool zero1 = false;
  // f32, or bf16 / f16: the model computes in that dtype, AdamW updates f32
  // master weights (Note [Master weights]), DDP and FSDP sum gradients in
  // f32, the loss is computed in f32; f16 also scales the loss dynamically
  // (Note [Dynamic loss scaling]).
  std::string precision = "f32";
  double loss_scale = 65536.0;      // f16: the initial loss scale
  std::string cp_mode = "ulysses";  // ulysses | allgather | hybrid | ring
  int ulysses_degree = 0;           // hybrid: the Ulysses degree (1 < d < cp, divides cp)
  bool load_balance = false;        // allgather / ring: balanced causal work
  // AsyncContextParallel (collectives launched from the q/k/v projections):
  // on | off | auto (on for ulysses, allgather and hybrid; ring overlaps its
  // own transfers).
  std::string cp_async = "auto";
  int micro_batches = 2;
  bool overlap = true;  // the dual-pipe schedule
  // Gradient buckets reduced during the last micro-batch's backward (Note
  // [DDP buckets] in parallel/ddp.h), in MiB.
  double grad_bucket_mb = 25;
  // model and task (Note [Training models] in tools/train/train_model.h)
  std::string model_type = "moe";  // moe | llama
  ModelConfig model;               // moe: vocab and max_seq come from the task
  std::string llama_config;        // llama: a Hugging Face config.json
  std::string init_from;           // llama: a Hugging Face checkpoint directory
  RecallConfig recall;
  // moe: a text file, a byte-level model instead of recall; llama: a token
  // file (Note [Token files]).
  std::string data;
  int64_t seq_len = 128;  // with --data
  // optimisation
  int64_t steps = 300;
  int64_t batch = 8;  // sequences per micro-batch per data rank
  double lr = 3e-3;
  double min_lr = 3e-4;
  int64_t warmup = 30;
  double weight_decay = 0.01;
  double clip = 1.0;  // global gradient norm; 0: off
  double aux_weight = 0.01;
  uint64_t seed = 1234;
  // checkpoints
  std::string save_dir;
  int64_t save_every = 0;  // 0: only at the end when save_dir is given
  int keep = 2;            // complete checkpoints kept in save_dir
  std::string resume;      // a checkpoint directory (or its parent holding `latest`)
  // output
  std::string trace;  // Chrome trace-event JSON of a few steps
  int64_t trace_steps = 2;
  int64_t log_every = 10;
  std::string progress = "auto";  // auto | line | plain | quiet
  double stop_accuracy = 0;       // > 0: stop once the logged accuracy reaches it
  // Fault injection (Note [Injected faults]): "RANK:STEP:KIND", empty = none.
  std::string fault;
  // Memory that does not depend on thread timing (tests; two barriers a
  // step): every rank meets at a barrier after each step, rank 0 reads the
  // allocator's current bytes into StepStats::settled_bytes, and a second
  // barrier starts the next step on every rank at once, so that each step's
  // peak covers that step of every rank and nothing else.
  bool settle_memory = false;
};

// Note [Injected faults]
// ~~~~~~~~~~~~~~~~~~~~~~
// --inject-fault RANK:STEP:KIND makes world rank RANK fail at 0-based step
// STEP, to show (and test) what every failure looks like to the user:
//   forward    throws as micro-batch 1's forward begins (peers are inside, or
//              about to enter, the collectives of their forwards)
//   backward   throws inside micro-batch 0's backward (on the backward worker)
//   step-end   throws after the schedule, before the gradient reduction
//   exit       the process dies on the spot (_Exit(3)): a crashed rank
//   hang       stops for 2 × the wait timeout at the forward, then goes on:
//              a rank that never arrives, as far as its peers can tell
//              (mpi/nccl only: its process is ended by mpirun once the
//              peers have failed; rank threads share one process, which a
//              rank stuck past its deadlines aborts: Note [Stuck worker])
// Every kind must end the job with a clear error on every rank within the
// wait deadline (TANDEM_WAIT_TIMEOUT_S), and leave earlier checkpoints intact.
struct Fault {
  int rank = -1;
  int64_t step = -1;
  std::string kind;
};
// Parses --inject-fault; throws naming the expected form.
Fault parse_fault(const std::string& spec);

// What one step measured, as rank 0 reports it (already reduced over ranks).
struct StepStats {
  int64_t step = 0;  // 0-based
  double loss = 0;   // mean cross-entropy over the scored tokens of the step
  double accuracy = 0;
  double lr = 0;
  double grad_norm = 0;  // before clipping; not finite on a skipped step
  // f16: the loss scale the step ran with, and whether its gradients
  // overflowed (the optimizer skipped it); 0 / false otherwise.
  double loss_scale = 0;
  bool skipped = false;
  double seconds = 0;
  double tokens_per_second = 0;
  double comm_wait = 0;        // fraction of the step the ranks' threads waited for comm
  int64_t peak_bytes = 0;      // allocator peak during the step (process-wide)
  int64_t reserved_bytes = 0;  // allocator cache after the step (process-wide)
  int64_t resident_bytes = 0;  // the process's resident set after the step
  // Parameters, their gradients and the optimizer state rank 0 holds at
  // the end of the step (counted from its tensors): what FSDP divides.
  int64_t state_bytes = 0;
  // Allocated bytes once every rank has finished the step (settle_memory
  // only; 0 otherwise): what outlives a step, e.g. parameters, gradients and
  // optimizer state, independent of how the ranks' threads interleaved.
  int64_t settled_bytes = 0;
};

struct TrainResult {
  std::vector<StepStats> steps;  // every step run (rank 0)
  int64_t first_step = 0;        // > 0 when resumed
  std::string task;
  std::string layout;
};

// The task the options select: recall, a TextTask on options.data, or
// (llama) a TokenTask on it.
std::unique_ptr<Task> make_task(const TrainOptions& options);

// Checks the options against a world of `world_size` ranks; throws
// tandem::Error naming the first problem.
void validate(const TrainOptions& options, int world_size);

// Runs the whole job: the threads backend starts its ranks here, mpi/nccl
// use the processes of mpirun. Progress goes to `out` from rank 0.
TrainResult run_training(const TrainOptions& options, std::FILE* out = stdout);

// `tandem-train export`: the model's full parameters from a checkpoint
// directory. A llama checkpoint becomes a Hugging Face checkpoint directory
// `out_path` (config.json, model.safetensors in `dtype`) that transformers
// loads; the moe model one safetensors file `out_path` (f32).
void export_checkpoint(const std::string& checkpoint, const std::string& out_path,
                       DType dtype = DType::F32);

}  // namespace tandem::train
