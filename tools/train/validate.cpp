// tandem-train's checks of its options before any rank starts: every
// refusal names the flag and what it got (Note [Training layout], Note
// [Injected faults] in trainer.h).
#include <fmt/format.h>

#include <string>

#include "tandem/runtime/error.h"
#include "tools/train/train_model.h"
#include "tools/train/trainer.h"

namespace tandem::train {

Fault parse_fault(const std::string& spec) {
  Fault f;
  if (spec.empty()) return f;
  const size_t a = spec.find(':'), b = spec.find(':', a == std::string::npos ? a : a + 1);
  bool ok = a != std::string::npos && b != std::string::npos;
  if (ok) {
    try {
      size_t used = 0;
      f.rank = std::stoi(spec.substr(0, a), &used);
      ok = used == a;
      f.step = std::stoll(spec.substr(a + 1, b - a - 1), &used);
      ok = ok && used == b - a - 1;
    } catch (const std::exception&) {
      ok = false;
    }
    f.kind = spec.substr(b + 1);
  }
  ok = ok && f.rank >= 0 && f.step >= 0;
  TANDEM_CHECK(ok && (f.kind == "forward" || f.kind == "backward" || f.kind == "step-end" ||
                      f.kind == "exit" || f.kind == "hang"),
               "[train] expected --inject-fault RANK:STEP:KIND with KIND forward|backward|step-end|"
               "exit|hang, got '{}'",
               spec);
  return f;
}

void validate(const TrainOptions& o, int world_size) {
  const Fault fault = parse_fault(o.fault);
  TANDEM_CHECK(fault.rank < world_size, "[train] --inject-fault names rank {} of a world of {}",
               fault.rank, world_size);
  TANDEM_CHECK(fault.kind != "hang" || o.backend != "threads",
               "[train] --inject-fault ...:hang needs one process per rank (mpirun): rank threads "
               "share one process, which a rank stuck past its wait deadline aborts (Note [Stuck "
               "worker])");
  TANDEM_CHECK(o.dp >= 1 && o.ep >= 1 && o.cp >= 1 && o.tp >= 1,
               "[train] expected --dp, --ep, --cp and --tp >= 1, got {}, {}, {}, {}", o.dp, o.ep,
               o.cp, o.tp);
  const int64_t product = int64_t{o.dp} * o.ep * o.cp * o.tp;
  TANDEM_CHECK(product == world_size,
               "[train] expected dp x ep x cp x tp to equal the world size {}, got {} x {} x {} x "
               "{} = {}{}",
               world_size, o.dp, o.ep, o.cp, o.tp, product,
               o.backend == "threads" ? " (set --ranks, or leave it out to use the product)"
                                      : " (the number of processes mpirun started)");
  TANDEM_CHECK(!o.zero1 || o.dp_shard == 1,
               "[train] expected --zero1 with DDP (--dp-shard 1), got --dp-shard {}: FSDP "
               "already holds each rank's rows of the optimizer state only",
               o.dp_shard);
  TANDEM_CHECK(o.dp_shard >= 1 && o.dp % o.dp_shard == 0,
               "[train] expected --dp-shard to divide --dp (the data ranks it groups), got "
               "--dp-shard {} with --dp {}",
               o.dp_shard, o.dp);
  TANDEM_CHECK(o.dp_shard == 1 || !o.overlap,
               "[train] --dp-shard {} with the dual-pipe overlap: FSDP's hooks run on one thread "
               "at a time; pass --no-overlap",
               o.dp_shard);
  TANDEM_CHECK(o.cp_mode == "ulysses" || o.cp_mode == "allgather" || o.cp_mode == "hybrid" ||
                   o.cp_mode == "ring",
               "[train] expected --cp-mode ulysses|allgather|hybrid|ring, got '{}'", o.cp_mode);
  TANDEM_CHECK(o.model_type == "moe" || o.model_type == "llama",
               "[train] expected --model moe|llama, got '{}'", o.model_type);
  TANDEM_CHECK(o.model_type == "llama" || (o.llama_config.empty() && o.init_from.empty()),
               "[train] --config and --init-from apply to --model llama, got --model {}",
               o.model_type);
  int64_t heads = 0, experts = 0;
  if (o.model_type == "llama") {
    const LlamaConfig c = llama_config(o);
    heads = c.num_attention_heads;
    experts = c.num_local_experts;
    TANDEM_CHECK(experts > 0 || o.ep == 1,
                 "[train] --model llama with a dense config ({}) has no experts to place: "
                 "expected --ep 1, got {}",
                 c.model_type, o.ep);
    TANDEM_CHECK(experts == 0 || experts % o.ep == 0,
                 "[train] expected --ep {} to divide the config's {} experts", o.ep, experts);
    TANDEM_CHECK(c.num_attention_heads % o.tp == 0 && c.num_key_value_heads % o.tp == 0 &&
                     c.intermediate_size % o.tp == 0,
                 "[train] expected --tp {} to divide the config's {} attention heads, {} KV heads "
                 "and intermediate_size {}",
                 o.tp, c.num_attention_heads, c.num_key_value_heads, c.intermediate_size);
  } else {
    const ModelConfig& m = o.model;
    heads = m.heads;
    experts = m.experts;
    TANDEM_CHECK(m.d_model > 0 && m.layers > 0 && m.heads > 0 && m.hidden > 0,
                 "[train] expected positive --d-model, --layers, --heads, --hidden, got {}, {}, "
                 "{}, {}",
                 m.d_model, m.layers, m.heads, m.hidden);
    TANDEM_CHECK(m.d_model % m.heads == 0, "[train] expected --heads {} to divide --d-model {}",
                 m.heads, m.d_model);
    TANDEM_CHECK(m.heads % o.tp == 0, "[train] expected --tp {} to divide --heads {}", o.tp,
                 m.heads);
    TANDEM_CHECK(m.experts >= 1 && m.experts % o.ep == 0,
                 "[train] expected --ep {} to divide --experts {}", o.ep, m.experts);
    TANDEM_CHECK(m.top_k >= 1 && m.top_k <= m.experts,
                 "[train] expected 1 <= --top-k <= --experts {}, got {}", m.experts, m.top_k);
  }
  const int64_t local_heads = heads / o.tp;
  if (o.cp > 1 && o.cp_mode == "ulysses") {
    TANDEM_CHECK(local_heads % o.cp == 0,
                 "[train] --cp-mode ulysses splits each rank's {} heads ({} heads / --tp {}) "
                 "over --cp {}: expected cp to divide them",
                 local_heads, heads, o.tp, o.cp);
  }
  if (o.cp_mode == "hybrid") {
    TANDEM_CHECK(o.ulysses_degree > 1 && o.ulysses_degree < o.cp && o.cp % o.ulysses_degree == 0,
                 "[train] --cp-mode hybrid expects 1 < --ulysses-degree < --cp {} dividing it, "
                 "got {}",
                 o.cp, o.ulysses_degree);
    TANDEM_CHECK(local_heads % o.ulysses_degree == 0,
                 "[train] expected --ulysses-degree {} to divide each rank's {} heads",
                 o.ulysses_degree, local_heads);
  }
  TANDEM_CHECK(o.cp_async == "auto" || o.cp_async == "on" || o.cp_async == "off",
               "[train] expected --cp-async auto|on|off, got '{}'", o.cp_async);
  TANDEM_CHECK(o.cp_async != "on" || o.cp_mode != "ring",
               "[train] --cp-async on expects --cp-mode ulysses, allgather or hybrid (ring keeps "
               "its transfers in flight behind each block in any case), got '{}'",
               o.cp_mode);
  TANDEM_CHECK(!o.load_balance || o.cp_mode == "allgather" || o.cp_mode == "ring",
               "[train] --cp-load-balance applies to --cp-mode allgather or ring, got '{}'",
               o.cp_mode);
  TANDEM_CHECK(o.micro_batches >= 1, "[train] expected --micro-batches >= 1, got {}",
               o.micro_batches);
  TANDEM_CHECK(!o.overlap || experts > 0,
               "[train] --overlap pairs each side's expert all-to-all with the other side's "
               "compute, and this --model {} has no experts: expected --no-overlap",
               o.model_type);
  TANDEM_CHECK(!o.overlap || o.micro_batches >= 2,
               "[train] --overlap pairs the backward of one micro-batch with the forward of the "
               "next: expected --micro-batches >= 2, got {}",
               o.micro_batches);
  TANDEM_CHECK(o.steps >= 1 && o.batch >= 1,
               "[train] expected --steps and --batch >= 1, got {} "
               "and {}",
               o.steps, o.batch);
  TANDEM_CHECK(o.lr > 0 && o.min_lr >= 0 && o.warmup >= 0 && o.weight_decay >= 0 && o.clip >= 0,
               "[train] expected --lr > 0 and non-negative --min-lr, --warmup, --weight-decay, "
               "--clip");
  TANDEM_CHECK(o.save_every >= 0 && o.keep >= 1,
               "[train] expected --save-every >= 0 and --keep >= 1, got {} and {}", o.save_every,
               o.keep);
  TANDEM_CHECK(o.save_every == 0 || !o.save_dir.empty(), "[train] --save-every {} needs --save DIR",
               o.save_every);
  TANDEM_CHECK(o.trace_steps >= 1, "[train] expected --trace-steps >= 1, got {}", o.trace_steps);
  TANDEM_CHECK(o.device == "cpu" || o.device == "cuda",
               "[train] expected --device cpu|cuda, got "
               "'{}'",
               o.device);
  TANDEM_CHECK(o.device == "cpu" || o.backend != "mpi",
               "[train] --device cuda runs with --backend threads (the ranks share one device) or "
               "nccl (one device per rank), got --backend {}",
               o.backend);
}

}  // namespace tandem::train
