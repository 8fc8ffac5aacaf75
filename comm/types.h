// Options of each collective (one struct per collective, defaults included;
// STYLE, after c10d's Types.hpp).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tandem/tensor/tensor.h"

namespace tandem {

enum class RedOp : uint8_t { Sum, Avg, Max, Min };
const char* red_op_name(RedOp op);

struct AllReduceOptions {
  RedOp op = RedOp::Sum;
  std::string tag;  // free text recorded in the ledger
};

struct BroadcastOptions {
  int root = 0;  // group rank
  std::string tag;
};

// Concatenates every rank's tensor along `dim` (equal shapes).
struct AllGatherOptions {
  int64_t dim = 0;
  std::string tag;
};

// Reduces across ranks, then rank r keeps chunk r of `dim` (divisible by size).
struct ReduceScatterOptions {
  RedOp op = RedOp::Sum;
  int64_t dim = 0;
  std::string tag;
};

// Rows of dim 0: input_split_sizes[r] rows go to rank r; output_split_sizes[r]
// rows come from rank r. Empty lists mean even splits.
struct AllToAllOptions {
  std::vector<int64_t> input_split_sizes;
  std::vector<int64_t> output_split_sizes;
  std::string tag;
};

struct P2POptions {
  int peer = 0;  // group rank
  int tag_id = 0;
  std::string tag;
};

struct BarrierOptions {
  std::string tag;
};

struct P2POp {
  enum class Kind : uint8_t { Send, Recv };
  Kind kind = Kind::Send;
  Tensor tensor;  // the data to send, or a tensor of the expected shape/dtype to receive
  int peer = 0;
  int tag_id = 0;
  static P2POp send(Tensor t, int peer, int tag_id = 0) {
    return {Kind::Send, std::move(t), peer, tag_id};
  }
  static P2POp recv(Tensor like, int peer, int tag_id = 0) {
    return {Kind::Recv, std::move(like), peer, tag_id};
  }
};

}  // namespace tandem
