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

#include "tandem/runtime/config.h"
#include "tandem/runtime/device.h"
#include "tandem/runtime/error.h"
#include "tandem/runtime/hook_coordinator.h"
#include "tandem/runtime/logging.h"
#include "tandem/runtime/stream.h"
#include "tandem/runtime/trace.h"
#include "tandem/runtime/worker_pair.h"

#include "tandem/tensor/dtype.h"
#include "tandem/tensor/io/safetensors.h"
#include "tandem/tensor/ops.h"
#include "tandem/tensor/random.h"
#include "tandem/tensor/tensor.h"

#include "tandem/autograd/call_data.h"
#include "tandem/autograd/checkpoint.h"
#include "tandem/autograd/engine.h"
#include "tandem/autograd/function.h"
#include "tandem/autograd/grad_ready.h"
#include "tandem/autograd/gradcheck.h"
#include "tandem/autograd/init.h"
#include "tandem/autograd/mixed_precision.h"
#include "tandem/autograd/module.h"
#include "tandem/autograd/nn/attention.h"
#include "tandem/autograd/nn/container.h"
#include "tandem/autograd/nn/dropout.h"
#include "tandem/autograd/nn/linear.h"
#include "tandem/autograd/nn/moe.h"
#include "tandem/autograd/nn/norm.h"
#include "tandem/autograd/nn/rope.h"
#include "tandem/autograd/nn/transformer.h"
#include "tandem/autograd/ops.h"
#include "tandem/autograd/optim.h"

#include "tandem/comm/backend.h"
#include "tandem/comm/process_group.h"
#include "tandem/comm/sim_link.h"
#include "tandem/comm/threads/threads_backend.h"
#include "tandem/comm/types.h"
#include "tandem/comm/work.h"

#include "tandem/parallel/checkpoint.h"
#include "tandem/parallel/collectives.h"
#include "tandem/parallel/context_parallel.h"
#include "tandem/parallel/data_parallel.h"
#include "tandem/parallel/ddp.h"
#include "tandem/parallel/device_mesh.h"
#include "tandem/parallel/dtensor.h"
#include "tandem/parallel/dtensor_ops.h"
#include "tandem/parallel/dual_pipe.h"
#include "tandem/parallel/expert_parallel.h"
#include "tandem/parallel/fsdp.h"
#include "tandem/parallel/param_placement.h"
#include "tandem/parallel/placement.h"
#include "tandem/parallel/sequence_layout.h"
#include "tandem/parallel/tensor_parallel.h"
#include "tandem/parallel/zero.h"
