// Distributed checkpoints: every rank writes the pieces of the tensors it
// holds into one safetensors file of a checkpoint directory, with where each
// piece sits in its whole tensor; loading reassembles any piece of any tensor
// from whichever files hold it, so a checkpoint saved with one parallel
// layout loads into another (resharding on load), and the pieces consolidate
// into one file of whole tensors that other frameworks read.
//
// Note [Checkpoint layout and atomicity]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
//   ROOT/latest                    the name of the newest complete checkpoint
//   ROOT/step-00000100/
//     rank-00000-of-00004.safetensors   each rank's pieces; __metadata__
//     …                                 "tandem.pieces" = {name: {"global_shape",
//                                       "offsets"}} (tensor-parallel shards,
//                                       owned experts, …)
//     checkpoint.json              step, world size, files, the caller's meta
// A save writes into ROOT/step-N.tmp/ (each file atomically: temporary name,
// fsync, rename), then — after a barrier proves every rank's file is durable —
// rank 0 writes checkpoint.json, renames the directory to step-N, fsyncs ROOT,
// and only then replaces ROOT/latest (again atomically), then prunes all but
// the newest `keep` checkpoints and any step-*.tmp left by a crashed save. A
// process that dies anywhere in between leaves `latest` naming the previous
// complete checkpoint, which nothing has touched. Every file carries a
// checksum (Note [Safetensors checksum]), so a truncated or corrupted file is
// an error on load, never silently wrong weights.
//
// A replica (a tensor several ranks hold identically) is written once: the
// caller marks the other copies write = false.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "tandem/comm/process_group.h"
#include "tandem/tensor/tensor.h"

namespace tandem {

// A block of a whole ("global") tensor that this rank holds.
struct TensorPiece {
  std::string name;
  Tensor local;                  // the block; load_checkpoint copies into it
  Shape global_shape;            // of the whole tensor
  std::vector<int64_t> offsets;  // of the block's first element, per dim (empty: all 0)
  bool write = true;             // false: another rank writes this block
};

struct CheckpointInfo {
  std::string path;  // the step directory
  int64_t step = 0;
  int world_size = 0;
  std::vector<std::string> files;
  std::map<std::string, std::string> meta;
};

// Collective over `world`: saves `pieces` as checkpoint `step` under `root`
// (created if missing) and returns the step directory. `meta` is stored in
// checkpoint.json (rank 0's is used).
std::string save_checkpoint(const std::string& root, int64_t step,
                            const std::vector<TensorPiece>& pieces,
                            const std::map<std::string, std::string>& meta,
                            const ProcessGroupPtr& world, int keep = 2);

// `path` is a step directory or a root holding `latest`. Reads checkpoint.json
// and checks that every file it lists exists.
CheckpointInfo find_checkpoint(const std::string& path);

// Fills every piece's `local` (any shape the layout asks for) from the files
// of `info`: the union of the saved blocks of a tensor must cover the piece.
// Errors name the tensor and what was missing or mismatched.
void load_checkpoint(const CheckpointInfo& info, std::vector<TensorPiece>& pieces);

// Every tensor whose name starts with `prefix`, whole, into one safetensors
// file (names without the prefix), atomically.
void consolidate_checkpoint(const CheckpointInfo& info, const std::string& out_path,
                            const std::string& prefix = "");

// Fault injection (tests): called at each stage of save_checkpoint with its
// name — "files" (this rank's file written), "barrier" (every file written),
// "meta" (checkpoint.json written), "renamed" (step directory in place),
// "latest" (latest replaced). A hook that throws or exits simulates a crash there.
void set_checkpoint_fault_hook(std::function<void(const std::string& stage)> hook);

}  // namespace tandem
