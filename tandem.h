// tandem: the one header a model file includes (Note [Installed layout] in
// meson.build). It re-exports the user-facing headers of every layer: devices,
// streams and errors (runtime), tensors and their raw ops (tensor), the
// differentiable ops, modules, nn layers and optimizers (autograd), process
// groups and backends (comm), and DeviceMesh, DTensor and the parallel styles
// (parallel). Headers of one backend's internals (MPI, NCCL, CUDA, the CPU
// kernels) are not part of it and are not installed.
//
// Two op namespaces: tandem:: (autograd/ops.h) records the ops for backward;
// tandem::ops:: (tensor/ops.h) computes without recording. A model's forward
// uses the first.
#pragma once

#include "runtime/config.h"
#include "runtime/device.h"
#include "runtime/error.h"
#include "runtime/hook_coordinator.h"
#include "runtime/logging.h"
#include "runtime/stream.h"
#include "runtime/trace.h"
#include "runtime/worker_pair.h"

#include "tensor/dtype.h"
#include "tensor/io/safetensors.h"
#include "tensor/ops.h"
#include "tensor/random.h"
#include "tensor/tensor.h"

#include "autograd/checkpoint.h"
#include "autograd/engine.h"
#include "autograd/function.h"
#include "autograd/gradcheck.h"
#include "autograd/init.h"
#include "autograd/module.h"
#include "autograd/nn/attention.h"
#include "autograd/nn/container.h"
#include "autograd/nn/dropout.h"
#include "autograd/nn/linear.h"
#include "autograd/nn/moe.h"
#include "autograd/nn/norm.h"
#include "autograd/nn/transformer.h"
#include "autograd/ops.h"
#include "autograd/optim.h"

#include "comm/backend.h"
#include "comm/process_group.h"
#include "comm/sim_link.h"
#include "comm/threads/threads_backend.h"
#include "comm/types.h"
#include "comm/work.h"

#include "parallel/checkpoint.h"
#include "parallel/context_parallel.h"
#include "parallel/data_parallel.h"
#include "parallel/device_mesh.h"
#include "parallel/dtensor.h"
#include "parallel/dtensor_ops.h"
#include "parallel/dual_pipe.h"
#include "parallel/expert_parallel.h"
#include "parallel/functional.h"
#include "parallel/param_placement.h"
#include "parallel/placement.h"
#include "parallel/tensor_parallel.h"
