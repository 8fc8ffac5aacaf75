// The model a tandem-train job trains, as its loop sees it.
//
// Note [Training models]
// ~~~~~~~~~~~~~~~~~~~~~~
// The loop (tools/train/trainer.cpp) asks five things of a model: its module
// (whose named parameters the optimizer, the gradient reduction and the
// checkpoints hold), the tensor-parallel plan over its parameter names, the
// attention layers that context parallelism applies to, a forward from
// tokens at global positions to logits (and an auxiliary loss, if any), and
// an identity that a checkpoint records so that a resume is refused on a
// different model. Everything else — data and expert parallelism, the
// dual-pipe schedule, the loss, clipping, checkpoints — is the same for
// every model. Two models implement it:
//   moe    the small mixture-of-experts model of tools/train/model.h, with
//          learned positions, trained from scratch (the default);
//   llama  the Llama family of tools/train/llama.h from a Hugging Face
//          config.json, optionally starting from a checkpoint's weights;
//          a rank declares its tokens' global positions around the forward
//          (Note [Rotary positions]), so every CP layout sees the right
//          rotation. Dense (--ep 1, no dual-pipe overlap), or Mixtral, whose
//          experts take expert parallelism and the overlap as moe's do.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tandem/autograd/module.h"
#include "tandem/autograd/nn/attention.h"
#include "tandem/autograd/nn/moe.h"
#include "tandem/parallel/tensor_parallel.h"
#include "tools/train/data.h"
#include "tools/train/llama.h"

namespace tandem::train {

struct TrainOptions;

class TrainModel {
 public:
  virtual ~TrainModel() = default;
  virtual std::shared_ptr<Module> module() const = 0;
  // For the progress output: what the model is.
  virtual std::string describe() const = 0;
  // Recorded in a checkpoint; a resume compares it with its own.
  virtual nlohmann::json identity() const = 0;
  // Megatron's plan: q/k/v (and MLP up-projections) column-wise, o (and MLP
  // down-projections) row-wise.
  virtual ParallelizePlan tp_plan() const = 0;
  virtual std::vector<std::shared_ptr<nn::SelfAttention>> attention_layers() const = 0;
  // The decoder layers in order: one FSDP group each (--dp-shard).
  virtual std::vector<std::shared_ptr<Module>> blocks() const = 0;
  // Whether module() holds nn::MoE layers: expert parallelism and the
  // dual-pipe overlap apply to those.
  virtual bool has_experts() const = 0;
  // logits (B, S, vocab) of `tokens` (B, S) whose positions in the whole
  // sequence are `positions` (this rank's, in local order); aux_loss is
  // undefined for a model without one.
  virtual nn::AuxOutput forward(const Tensor& tokens, const std::vector<int64_t>& positions) = 0;
};

// The model the options select, its weights drawn from `init` (the same on
// every rank) or, for --init-from, read from a Hugging Face checkpoint.
std::unique_ptr<TrainModel> make_train_model(const TrainOptions& options, const Task& task,
                                             Generator& init);

// The Llama config --config names (read once per call; refused by field).
LlamaConfig llama_config(const TrainOptions& options);

}  // namespace tandem::train
