// NcclGroup and nccl_world (nccl_backend.h). The engine thread that makes
// every NCCL call is in nccl_engine.cpp (Note [NCCL engine]).
#include "tandem/comm/nccl/nccl_backend.h"

#include <cuda_runtime_api.h>
#include <unistd.h>

#include <climits>
#include <cstdlib>
#include <cstring>
#include <numeric>

#include <fmt/ranges.h>

#include "tandem/comm/mpi/mpi_backend.h"
#include "tandem/comm/nccl/nccl_check.h"
#include "tandem/comm/nccl/nccl_group.h"
#include "tandem/runtime/config.h"
#include "tandem/runtime/device.h"
#include "tandem/runtime/logging.h"
#include "tandem/tensor/dispatch.h"
#include "tandem/tensor/kernels.h"
#include "tandem/tensor/ops.h"

namespace tandem {
namespace nccl {
namespace {

using Clock = std::chrono::steady_clock;

ncclDataType_t type_of(DType dtype) {
  switch (dtype) {
    case DType::F32:
      return ncclFloat32;
    case DType::F64:
      return ncclFloat64;
    case DType::BF16:
      return ncclBfloat16;
    case DType::F16:
      return ncclFloat16;
    case DType::I32:
      return ncclInt32;
    case DType::I64:
      return ncclInt64;
    case DType::Bool:
      return ncclUint8;
  }
  TANDEM_FAIL("[comm::nccl] expected a valid dtype, got {}", static_cast<int>(dtype));
}

// bf16/f16 reduce natively. Avg is ncclAvg on floats; integers sum and then
// divide on the comm stream (as the CPU backends do). Bool reduces as or/and.
struct Reduction {
  ncclRedOp_t op;
  bool divide_after;
};
Reduction reduction_for(DType dtype, RedOp op) {
  if (dtype == DType::Bool) return {op == RedOp::Min ? ncclMin : ncclMax, false};
  switch (op) {
    case RedOp::Sum:
      return {ncclSum, false};
    case RedOp::Max:
      return {ncclMax, false};
    case RedOp::Min:
      return {ncclMin, false};
    case RedOp::Avg:
      return is_floating(dtype) ? Reduction{ncclAvg, false} : Reduction{ncclSum, true};
  }
  TANDEM_FAIL("[comm::nccl] expected a valid reduction, got {}", static_cast<int>(op));
}

cudaStream_t native(void* stream) {
  return static_cast<cudaStream_t>(stream);
}

// Lower world ranks on this host: OMPI_COMM_WORLD_LOCAL_RANK when mpirun set
// it for this world, else counted from an all_gather of host-name hashes.
int local_rank(ProcessGroup& control) {
  if (const char* text = std::getenv("OMPI_COMM_WORLD_LOCAL_RANK")) {
    char* end = nullptr;
    long value = std::strtol(text, &end, 10);
    if (end != text && *end == '\0' && value >= 0 && value < INT_MAX)
      return static_cast<int>(value);
  }
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  uint64_t hash = 1469598103934665603ull;
  for (const char* p = host; *p != '\0'; ++p)
    hash = (hash ^ static_cast<unsigned char>(*p)) * 1099511628211ull;
  Tensor mine = ops::from_vector<int64_t>({static_cast<int64_t>(hash >> 1)}, Shape{1});
  WorkPtr gathered = control.all_gather(mine, {0, "nccl local rank"});
  gathered->synchronize();
  std::vector<int64_t> hashes = gathered->result().to_vector<int64_t>();
  int local = 0;
  for (int r = 0; r < control.rank(); ++r)
    local += hashes[r] == hashes[control.rank()] ? 1 : 0;
  return local;
}

}  // namespace

ncclConfig_t nonblocking_config() {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  return config;
}

NcclGroup::NcclGroup(std::shared_ptr<Engine> engine, ncclComm_t comm, ProcessGroupPtr control,
                     Device device, int rank, std::vector<int> world_ranks,
                     ProcessGroupOptions options)
    : ProcessGroup(rank, static_cast<int>(world_ranks.size()), world_ranks, std::move(options)),
      engine_(std::move(engine)),
      lane_(std::make_shared<Lane>()),
      control_(std::move(control)),
      device_(device),
      stream_(Stream::create(device, CpuStreamMode::Async,
                             fmt::format("comm nccl r{} {}", rank, this->options().name))),
      barrier_buffer_(empty(Shape{1}, DType::I32, device)),  // its value does not matter
      comm_(comm) {
  detail::record_streams_for(stream_, {&barrier_buffer_});
}

// Runs once no launch holds the group (launches keep it alive).
NcclGroup::~NcclGroup() {
  if (comm_ == nullptr) return;
  ncclComm_t comm = comm_;
  Device device = device_;
  engine_->submit(nullptr, Step([comm, device] {
                    DeviceGuard guard(device);
                    auto deadline = Clock::now() + wait_timeout();
                    try {
                      TANDEM_NCCL_SETTLE(comm, ncclCommFinalize(comm), deadline);
                      ncclCommDestroy(comm);
                    } catch (const std::exception& e) {
                      log_warn("[comm::nccl] freeing a communicator failed, aborting it: {}",
                               e.what());
                      ncclCommAbort(comm);
                    }
                  }));
}

std::shared_ptr<NcclGroup> NcclGroup::self() {
  return std::static_pointer_cast<NcclGroup>(shared_from_this());
}

std::optional<std::string> NcclGroup::unusable_reason() const {
  std::lock_guard<std::mutex> lock(mu_);
  return unusable_;
}

void NcclGroup::abort(const std::string& reason) noexcept {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!unusable_) unusable_ = reason;
  }
  if (comm_ != nullptr) {
    ncclCommAbort(comm_);
    comm_ = nullptr;
  }
}

void NcclGroup::launch(Collective& c) {
  const char* name = collective_name(c.kind);
  auto on_device = [&](const Tensor& t) {
    TANDEM_CHECK(!t.defined() || t.device() == device_,
                 "[comm::{}] expected CUDA tensors on {} for the nccl backend, got a tensor on {} "
                 "({})",
                 name, device_.str(), t.device().str(), where());
  };
  on_device(c.input);
  on_device(c.output);
  for (const P2POp& op : c.p2p)
    on_device(op.tensor);
  if (c.kind == CollectiveKind::AllReduce || c.kind == CollectiveKind::ReduceScatter) {
    TANDEM_CHECK(c.input.dtype() != DType::Bool || c.op != RedOp::Avg,
                 "[comm::{}] expected sum, max or min for a bool tensor, got avg ({})", name,
                 where());
  }
  if (std::optional<std::string> reason = unusable_reason()) {
    c.work->finish(std::make_exception_ptr(CommAbortedError(fmt::format(
        "[comm::nccl] {} #{} {} failed at once: expected a usable communicator, got one aborted "
        "earlier: {}",
        where(), c.entry.seq, name, *reason))));
    return;
  }
  Launch launch;
  launch.group = self();
  // Submitted now, under the issue lock: the control group sees the launch order.
  if (options().checked && c.kind != CollectiveKind::BatchP2P) {
    launch.check = mpi_check_entry(*control_, c.entry);
  }
  // The comm stream waits for the caller's stream (Note [Stream ordering]):
  // c.ready was recorded there after the input; without an input (barrier,
  // receives only) an event recorded now orders the outputs' allocation.
  if (c.input.defined()) {
    launch.caller = c.ready;
  } else {
    launch.caller.record(current_stream(device_));
  }
  // Blocks the comm stream uses return to the caching allocator only after it.
  detail::record_streams_for(stream_, {&c.input, &c.output});
  for (const P2POp& op : c.p2p)
    detail::record_streams_for(stream_, {&op.tensor});
  for (const Tensor& t : c.p2p_outputs)
    detail::record_streams_for(stream_, {&t});
  launch.c = std::move(c);  // the front end no longer uses it
  engine_->submit(lane_, std::move(launch));
}

void NcclWork::mark_enqueued(const Event& end, Device device) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    end_ = end;
    device_ = device;
    enqueued_ = true;
  }
  cv_.notify_all();
}

void NcclWork::wait() {
  // Note [NCCL Work]. Wake up on completion too: a launch that failed before
  // it was enqueued is finished with its error and never marked enqueued.
  on_completion([this] {
    std::lock_guard<std::mutex> lock(mu_);  // no lost wake-up against the predicate
    cv_.notify_all();
  });
  std::unique_lock<std::mutex> lock(mu_);
  bool ready = cv_.wait_for(lock, wait_timeout(), [&] { return enqueued_ || is_completed(); });
  if (!ready) {
    throw TimeoutError(fmt::format(
        "[comm::nccl] wait on {} expected the collective to be enqueued within {} ms, got "
        "nothing (the engine thread is stuck; see the watchdog report)",
        description(), wait_timeout().count()));
  }
  if (!enqueued_) {
    lock.unlock();
    rethrow_if_failed();
    return;
  }
  Event end = end_;
  Device device = device_;
  lock.unlock();
  end.wait(current_stream(device));
}

void NcclGroup::enqueue(Launch& launch) {
  DeviceGuard guard(device_);
  Collective& c = launch.c;
  auto deadline = Clock::now() + timeout();
  try {
    launch.caller.wait(stream_);
    if (c.kind == CollectiveKind::BatchP2P) {
      enqueue_p2p(c, stream_.native_handle(), deadline);
    } else {
      enqueue_collective(c, stream_.native_handle(), deadline);
    }
    launch.end.record(stream_);
    if (auto* w = dynamic_cast<NcclWork*>(c.work.get())) w->mark_enqueued(launch.end, device_);
  } catch (const std::exception& e) {
    // A failed or unsettled call leaves the communicator in an unknown state.
    abort(fmt::format("rank {} failed to enqueue #{} {}: {}", rank(), c.entry.seq,
                      collective_name(c.kind), e.what()));
    throw;
  }
  launch.deadline = Clock::now() + timeout();
}

void NcclGroup::enqueue_collective(Collective& c, void* stream, Clock::time_point deadline) {
  const Tensor& in = c.input;
  const Tensor& out = c.output;
  ncclComm_t comm = comm_;
  cudaStream_t s = native(stream);
  switch (c.kind) {
    case CollectiveKind::AllReduce:
    case CollectiveKind::ReduceScatter: {
      Reduction red = reduction_for(in.dtype(), c.op);
      if (c.kind == CollectiveKind::AllReduce) {
        TANDEM_NCCL_SETTLE(
            comm,
            ncclAllReduce(in.raw_data(), out.raw_data(), static_cast<size_t>(in.numel()),
                          type_of(in.dtype()), red.op, comm, s),
            deadline);
      } else {
        TANDEM_NCCL_SETTLE(
            comm,
            ncclReduceScatter(in.raw_data(), out.raw_data(), static_cast<size_t>(out.numel()),
                              type_of(in.dtype()), red.op, comm, s),
            deadline);
      }
      if (red.divide_after) {
        TensorArg arg = arg_of(out);
        cuda::binary_scalar(BinaryOp::Div, arg, static_cast<double>(size()), false, arg, stream);
      }
      return;
    }
    case CollectiveKind::Broadcast:
      TANDEM_NCCL_SETTLE(
          comm,
          ncclBroadcast(in.raw_data(), out.raw_data(), static_cast<size_t>(out.numel()),
                        type_of(out.dtype()), c.peer, comm, s),
          deadline);
      return;
    case CollectiveKind::AllGather:
      TANDEM_NCCL_SETTLE(
          comm,
          ncclAllGather(in.raw_data(), out.raw_data(), static_cast<size_t>(in.numel()),
                        type_of(in.dtype()), comm, s),
          deadline);
      return;
    case CollectiveKind::AllToAll: {
      // Rows move as bytes, one send and one receive per peer, grouped.
      const int64_t rows = in.shape()[0] > 0 ? in.shape()[0] : out.shape()[0];
      const size_t row_bytes =
          rows > 0 ? (in.shape()[0] > 0 ? in.nbytes() : out.nbytes()) / static_cast<size_t>(rows)
                   : 0;
      const char* send = static_cast<const char*>(in.raw_data());
      char* recv = static_cast<char*>(out.raw_data());
      auto grouped = [](ncclResult_t rc, const char* call) {
        TANDEM_CHECK(rc == ncclSuccess || rc == ncclInProgress, "[nccl] {} failed: {} ({})", call,
                     ncclGetErrorString(rc), static_cast<int>(rc));
      };
      grouped(ncclGroupStart(), "ncclGroupStart()");
      for (int r = 0; r < size(); ++r) {
        size_t send_bytes = static_cast<size_t>(c.input_splits[r]) * row_bytes;
        size_t recv_bytes = static_cast<size_t>(c.output_splits[r]) * row_bytes;
        if (send_bytes > 0) grouped(ncclSend(send, send_bytes, ncclInt8, r, comm, s), "ncclSend");
        if (recv_bytes > 0) grouped(ncclRecv(recv, recv_bytes, ncclInt8, r, comm, s), "ncclRecv");
        send += send_bytes;
        recv += recv_bytes;
      }
      TANDEM_NCCL_SETTLE(comm, ncclGroupEnd(), deadline);
      return;
    }
    case CollectiveKind::Barrier:
      TANDEM_NCCL_SETTLE(comm,
                         ncclAllReduce(barrier_buffer_.raw_data(), barrier_buffer_.raw_data(), 1,
                                       ncclInt32, ncclSum, comm, s),
                         deadline);
      return;
    default:
      unsupported(collective_name(c.kind));
  }
}

void NcclGroup::enqueue_p2p(Collective& c, void* stream, Clock::time_point deadline) {
  ncclComm_t comm = comm_;
  cudaStream_t s = native(stream);
  auto grouped = [](ncclResult_t rc, const char* call) {
    TANDEM_CHECK(rc == ncclSuccess || rc == ncclInProgress, "[nccl] {} failed: {} ({})", call,
                 ncclGetErrorString(rc), static_cast<int>(rc));
  };
  grouped(ncclGroupStart(), "ncclGroupStart()");
  size_t recv_index = 0;
  for (const P2POp& op : c.p2p) {
    if (op.kind == P2POp::Kind::Send) {
      grouped(ncclSend(op.tensor.raw_data(), static_cast<size_t>(op.tensor.numel()),
                       type_of(op.tensor.dtype()), op.peer, comm, s),
              "ncclSend");
    } else {
      const Tensor& out = c.p2p_outputs[recv_index++];
      grouped(ncclRecv(out.raw_data(), static_cast<size_t>(out.numel()), type_of(out.dtype()),
                       op.peer, comm, s),
              "ncclRecv");
    }
  }
  TANDEM_NCCL_SETTLE(comm, ncclGroupEnd(), deadline);
}

bool NcclGroup::poll(Launch& launch) {
  Collective& c = launch.c;
  if (std::optional<std::string> reason = unusable_reason()) {
    c.work->finish(std::make_exception_ptr(CommAbortedError(
        fmt::format("[comm::nccl] {} #{} {} failed: its communicator was aborted: {}", where(),
                    c.entry.seq, collective_name(c.kind), *reason))));
    return true;
  }
  if (launch.end.query()) {
    c.work->finish();
    return true;
  }
  ncclResult_t async = ncclSuccess;
  if (ncclCommGetAsyncError(comm_, &async) != ncclSuccess) async = ncclInternalError;
  if (async != ncclSuccess && async != ncclInProgress) {
    std::string detail = fmt::format("{} ({}): {}", ncclGetErrorString(async),
                                     static_cast<int>(async), ncclGetLastError(comm_));
    abort(fmt::format("rank {} saw NCCL fail in #{} {}: {}", rank(), c.entry.seq,
                      collective_name(c.kind), detail));
    TANDEM_FAIL(
        "[comm::nccl] {} #{} {}: NCCL failed while the collective ran: {}; the "
        "communicator was aborted",
        where(), c.entry.seq, collective_name(c.kind), detail);
  }
  if (Clock::now() > launch.deadline) time_out(launch);
  return false;
}

void NcclGroup::time_out(const Launch& launch) {
  const Collective& c = launch.c;
  std::string report = fmt::format(
      "[comm::watchdog] {} waited {} ms in #{} {} for its NCCL kernels on {} to complete (the "
      "group's world ranks are [{}]; at least one of them has not joined, or a stream it waits "
      "on is stalled). The communicator was aborted (ncclCommAbort): later calls on it fail at "
      "once. Last collectives of this rank:\n{}",
      where(), timeout().count(), c.entry.seq, collective_name(c.kind), device_.str(),
      fmt::join(world_ranks(), ","), ledger().tail_str(8));
  abort(fmt::format("rank {} timed out after {} ms in #{} {}", rank(), timeout().count(),
                    c.entry.seq, collective_name(c.kind)));
  log_error("{}", report);
  throw TimeoutError(report);
}

std::shared_ptr<ProcessGroup> NcclGroup::make_subgroup(const std::vector<int>& ranks, int new_rank,
                                                       const std::string& name) {
  // The control split is bounded and proves every parent rank reached this
  // split, so the ncclCommSplit below (in the parent's lane) finds them all.
  ProcessGroupPtr sub_control = control_->split(ranks, name);
  auto sub = std::make_shared<ncclComm_t>(nullptr);
  std::shared_ptr<NcclGroup> parent = self();
  engine_->run(
      lane_,
      [parent, sub, new_rank] {
        if (std::optional<std::string> reason = parent->unusable_reason()) {
          TANDEM_FAIL("[comm::split] {}: expected a usable parent, got one aborted earlier: {}",
                      parent->where(), *reason);
        }
        DeviceGuard guard(parent->device_);
        ncclConfig_t config = nonblocking_config();
        auto deadline = Clock::now() + parent->timeout();
        ncclComm_t out = nullptr;
        ncclResult_t rc = ncclCommSplit(parent->comm_, new_rank >= 0 ? 0 : NCCL_SPLIT_NOCOLOR,
                                        std::max(new_rank, 0), &out, &config);
        try {
          settle(out != nullptr ? out : parent->comm_, rc, "ncclCommSplit", deadline);
        } catch (const std::exception& e) {
          if (out != nullptr) ncclCommAbort(out);
          parent->abort(
              fmt::format("rank {} failed in ncclCommSplit: {}", parent->rank(), e.what()));
          throw;
        }
        *sub = out;
      },
      fmt::format("ncclCommSplit of {}", where()));
  if (new_rank < 0) return nullptr;
  std::vector<int> members;
  members.reserve(ranks.size());
  for (int r : ranks)
    members.push_back(world_ranks()[r]);
  ProcessGroupOptions options = this->options();
  options.name = name;
  return std::make_shared<NcclGroup>(engine_, *sub, sub_control, device_, new_rank,
                                     std::move(members), options);
}

}  // namespace nccl

ProcessGroupPtr nccl_world(ProcessGroupOptions options) {
  // Checked before any collective: a rank without a GPU fails alone and at once.
  const int devices = cuda_device_count();
  TANDEM_CHECK(devices > 0, "[comm::nccl] expected a CUDA device on every rank, got none ({})",
               built_with_cuda() ? "no GPU or driver on this machine" : "built without CUDA");
  TANDEM_CHECK(!cuda_emulated(),
               "[comm::nccl] expected a real GPU on every rank, got the emulated CUDA device "
               "(TANDEM_CUDA=emulated); NCCL cannot run on it");
  // The control plane: an MPI group over the same ranks, same options.
  ProcessGroupPtr control = mpi_world(options);
  const int rank = control->rank(), size = control->size();
  const Device device = Device::cuda(nccl::local_rank(*control) % devices);

  // Rank 0's ncclUniqueId reaches every rank as 16 i64 words.
  static_assert(sizeof(ncclUniqueId) % sizeof(int64_t) == 0);
  constexpr int64_t kWords = sizeof(ncclUniqueId) / sizeof(int64_t);
  ncclUniqueId id{};
  Tensor words = empty(Shape{kWords}, DType::I64);
  if (rank == 0) {
    TANDEM_NCCL_CHECK(ncclGetUniqueId(&id));
    std::memcpy(words.raw_data(), &id, sizeof(id));
  }
  WorkPtr shared = control->broadcast(words, {0, "ncclUniqueId"});
  shared->synchronize();
  std::vector<int64_t> received = shared->result().to_vector<int64_t>();
  std::memcpy(&id, received.data(), sizeof(id));

  std::shared_ptr<nccl::Engine> engine = nccl::engine();
  auto comm = std::make_shared<ncclComm_t>(nullptr);
  engine->run(
      nullptr,
      [comm, device, id, rank, size] {
        DeviceGuard guard(device);
        ncclConfig_t config = nccl::nonblocking_config();
        // Setup waits for the slowest rank up to wait_timeout() (Note [Bounded waits]).
        auto deadline = std::chrono::steady_clock::now() + wait_timeout();
        ncclResult_t rc = ncclCommInitRankConfig(comm.get(), size, id, rank, &config);
        try {
          nccl::settle(*comm, rc, "ncclCommInitRankConfig", deadline);
        } catch (...) {
          if (*comm != nullptr) ncclCommAbort(*comm);
          *comm = nullptr;
          throw;
        }
      },
      fmt::format("ncclCommInitRankConfig on rank {}", rank));
  std::vector<int> ranks(static_cast<size_t>(size));
  std::iota(ranks.begin(), ranks.end(), 0);
  log_debug("[comm::nccl] rank {}/{} on {}", rank, size, device.str());
  return std::make_shared<nccl::NcclGroup>(engine, *comm, control, device, rank, std::move(ranks),
                                           std::move(options));
}

bool nccl_built() {
  return true;
}

}  // namespace tandem
