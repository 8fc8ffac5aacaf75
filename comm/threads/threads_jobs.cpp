// The jobs of the threads backend's rounds (threads_jobs.h).
#include "tandem/comm/threads/threads_jobs.h"

#include <algorithm>
#include <type_traits>
#include <utility>

#include <fmt/format.h>

#include "tandem/runtime/cuda/cuda_api.h"
#include "tandem/runtime/error.h"
#include "tandem/runtime/stream.h"
#include "tandem/tensor/cpu/copy_bytes.h"
#include "tandem/tensor/dtype.h"
#include "tandem/tensor/kernels.h"

namespace tandem::threads_detail {

// Note [Threads ranks on one CUDA device]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// NCCL cannot put two ranks on one GPU, so rank threads that share a CUDA
// device (a single lent GPU, or the emulated one in CI) communicate through
// this backend. Everything about rounds, claims, seals and retirement stays
// as on the CPU, because a job still keeps Note [Threads jobs]' promise: when
// it ends, it has read its inputs and written its output. A job on CUDA
// tensors moves bytes with a device-to-device copy and reduces with the
// elementwise CUDA kernels (the same chain in rank order as the CPU's, so the
// same bits), on a stream of its own thread (one per thread and device, since
// any rank's thread may run any job), and synchronizes that stream before it
// ends. The inputs are ordered by the launch's ready event, recorded on the
// caller's stream (ProcessGroup::issue): a post waits for it. The outputs are
// complete when the Work is, so Work::wait() of a CUDA output blocks the
// caller until then, and the caller's stream, which only runs what is
// enqueued after that, reads finished data. Every post of a round must be on
// one device; a mixture is an error naming both.

namespace {

// The calling thread's stream for jobs on `device` (Note [Threads ranks on
// one CUDA device]).
const Stream& job_stream(Device device) {
  thread_local std::vector<Stream> streams;
  const auto index = static_cast<size_t>(device.index());
  if (streams.size() <= index) streams.resize(index + 1);
  if (!streams[index].defined()) streams[index] = Stream::create(device);
  return streams[index];
}

TensorArg flat_arg(const void* data, DType dtype, int64_t count) {
  TensorArg a;
  a.data = const_cast<void*>(data);
  a.dtype = dtype;
  a.ndim = 1;
  a.shape[0] = count;
  a.strides[0] = 1;
  a.numel = count;
  return a;
}

}  // namespace

Device device_of(const Post& p) {
  return p.output.defined()  ? p.output.device()
         : p.input.defined() ? p.input.device()
                             : Device::cpu();
}

void move_bytes(Device device, void* dst, const void* src, size_t nbytes) {
  if (nbytes == 0) return;
  if (device.is_cpu()) {
    cpu::copy_bytes(dst, src, nbytes);
    return;
  }
  DeviceGuard guard(device);
  const Stream& stream = job_stream(device);
  cuda_api::memcpy_async(dst, src, nbytes, cuda_api::CopyKind::DeviceToDevice,
                         stream.native_handle());
  stream.synchronize();
}

namespace {

// Note [Threads reductions]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// out[i] = in_0[i] op in_1[i] op ... op in_{n-1}[i] in rank order, stored in
// the dtype after every step (exactly what a chain of reduce_into() calls
// computes, with the same arithmetic), then divided by n for Avg. Every rank,
// and every way of splitting the elements between ranks, so produces the
// same bits. The partial result of a block of elements stays in cache while
// the ranks' inputs stream through, instead of one pass over the whole
// output per rank.
//
// An all_reduce of at least kSplitAllReduceBytes is split, reduce-scatter
// style, into two phases of jobs (Note [Threads rounds]): first, job r
// reduces chunk r (1/n of the elements) into rank r's output; once all those
// ended, job r copies the other chunks into rank r's output from the outputs
// that hold them. Each output then costs reading about 2x the buffer instead
// of n x, at the price of a wait between the phases, which only pays off for
// large buffers.
constexpr int64_t kReduceBlock = 8192;
constexpr size_t kSplitAllReduceBytes = 256 * 1024;

// y[i] = f(...f(f(start[i], x[0][i]), x[1][i])..., x[k-1][i]) for k <= 3,
// stored as T after every step. `start` may be `y`.
template <class T, class A, class F>
void accumulate(T* y, const T* start, const T* const* x, int k, int64_t m, F f) {
  switch (k) {
    case 1:
      for (int64_t i = 0; i < m; ++i)
        y[i] = static_cast<T>(f(A(start[i]), A(x[0][i])));
      return;
    case 2:
      for (int64_t i = 0; i < m; ++i) {
        T t = static_cast<T>(f(A(start[i]), A(x[0][i])));
        y[i] = static_cast<T>(f(A(t), A(x[1][i])));
      }
      return;
    default:
      for (int64_t i = 0; i < m; ++i) {
        T t = static_cast<T>(f(A(start[i]), A(x[0][i])));
        t = static_cast<T>(f(A(t), A(x[1][i])));
        y[i] = static_cast<T>(f(A(t), A(x[2][i])));
      }
      return;
  }
}

// `inputs` point at the first element to reduce of each rank's input. Up to
// three ranks are folded in per pass over a block, with the elementwise
// kernels' arithmetic (tensor/cpu/elementwise.cpp), so the bits are those of
// reduce_into() chains.
void reduce_ranks(RedOp op, DType dtype, const std::vector<const void*>& inputs, void* out,
                  int64_t count) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = std::conditional_t<std::is_same_v<T, bool>, int32_t, acc_t<T>>;
    const int n = static_cast<int>(inputs.size());
    auto run = [&](auto f) {
      std::vector<const T*> x(static_cast<size_t>(n));
      for (int64_t b = 0; b < count; b += kReduceBlock) {
        const int64_t m = std::min(kReduceBlock, count - b);
        for (int r = 0; r < n; ++r)
          x[r] = static_cast<const T*>(inputs[r]) + b;
        T* y = static_cast<T*>(out) + b;
        if (n == 1) std::copy(x[0], x[0] + m, y);
        for (int done = 1; done < n; done += 3) {
          accumulate<T, A>(y, done == 1 ? x[0] : y, x.data() + done, std::min(3, n - done), m, f);
        }
        if (op == RedOp::Avg) {
          if constexpr (std::is_integral_v<A>) {
            for (int64_t i = 0; i < m; ++i)
              y[i] = static_cast<T>(A(y[i]) / static_cast<A>(n));
          } else {
            const A d = static_cast<A>(n);
            for (int64_t i = 0; i < m; ++i)
              y[i] = static_cast<T>(A(y[i]) / d);
          }
        }
      }
    };
    switch (op) {
      case RedOp::Sum:
      case RedOp::Avg:
        run([](A a, A v) { return static_cast<A>(a + v); });
        break;
      case RedOp::Max:
        run([](A a, A v) { return a != a ? a : (a > v ? a : v); });
        break;
      case RedOp::Min:
        run([](A a, A v) { return a != a ? a : (a < v ? a : v); });
        break;
    }
  });
}

// reduce_ranks() on a CUDA device (Note [Threads ranks on one CUDA device]):
// out = in_0, then out = op(out, in_r) for r = 1..n-1 with the elementwise
// kernels, which compute in acc_t and store the dtype after every step as the
// CPU loop does; Avg then divides by n.
void reduce_ranks_on(Device device, RedOp op, DType dtype, const std::vector<const void*>& inputs,
                     void* out, int64_t count) {
  if (count == 0) return;
  DeviceGuard guard(device);
  const Stream& stream = job_stream(device);
  void* handle = stream.native_handle();
  const TensorArg y = flat_arg(out, dtype, count);
  if (out != inputs[0]) {
    cuda_api::memcpy_async(out, inputs[0], static_cast<size_t>(count) * dtype_size(dtype),
                           cuda_api::CopyKind::DeviceToDevice, handle);
  }
  const BinaryOp b = op == RedOp::Max   ? BinaryOp::Maximum
                     : op == RedOp::Min ? BinaryOp::Minimum
                                        : BinaryOp::Add;
  for (size_t r = 1; r < inputs.size(); ++r)
    cuda::binary(b, y, flat_arg(inputs[r], dtype, count), y, handle);
  if (op == RedOp::Avg) {
    cuda::binary_scalar(BinaryOp::Div, y, static_cast<double>(inputs.size()), false, y, handle);
  }
  stream.synchronize();
}

void reduce_ranks(Device device, RedOp op, DType dtype, const std::vector<const void*>& inputs,
                  void* out, int64_t count) {
  if (device.is_cpu()) {
    reduce_ranks(op, dtype, inputs, out, count);
  } else {
    reduce_ranks_on(device, op, dtype, inputs, out, count);
  }
}

// Elements [lo, hi) of `count` that rank r reduces in a split all_reduce.
std::pair<int64_t, int64_t> chunk_of(int r, int n, int64_t count) {
  const int64_t per = (count + n - 1) / n;
  const int64_t lo = std::min<int64_t>(r * per, count);
  return {lo, std::min(lo + per, count)};
}

}  // namespace

// ---- the jobs (any thread runs them; they only read the round's posts) ----
//
// Note [Threads jobs]
// ~~~~~~~~~~~~~~~~~~~
// An all_gather or all_to_all of rank r is n *pieces*: piece (r, s) copies
// rank s's part into rank r's output and can run as soon as r and s have
// posted, so the first ranks to post start copying while the last ones are
// still launching (the naive version waits for everyone). Other collectives
// give each rank one job, runnable once every rank has posted (a reduction
// reads every input), and a split all_reduce a second one (Note [Threads
// reductions]).
//
// A job's claim flag opens when its inputs are posted. A poster publishes
// its post in its `posted` counter, then opens the pieces it can now run
// with every rank that has posted already, and, if every rank has, the
// whole-part jobs. Publications and the checks that follow them are
// sequentially consistent, so of two ranks posting at once at least one
// sees the other (opening twice is harmless). Drivers claim open jobs (Note
// [Threads job order]), run them and count them down in `left`, which every poster
// raises by its number of jobs before it publishes: a rank's jobs all need
// every rank's post, so `left` reaches 0 exactly once, when every job of
// the round has run, and whoever brings it there retires the round. A
// poster also counts itself until its open_jobs ends, since that reads the
// posts that retirement clears (two ranks may post, and open, at once: each
// rank has its own issue lock, Note [Issue lock]).
//
// Shared cache lines cost: when the host puts two rank threads' cores on two
// dies (Note [Core round trip] in tools/bench/bench_comm.cpp), every line one
// of them writes and the other then touches crosses between the dies. So a
// driver counts down `left` once per pass over the jobs, not once per job,
// and retirement resets no claim flag: flags only grow (use u's values are
// 4u..4u+3) and any value below open_in(u) reads as closed in use u, so a
// flag left from an earlier use of the ring slot needs no write (a round of
// 4 ranks has 132 flags). The retirer also lets go of every member's Work
// before it moves the round's state on, which is what releases the members'
// drivers: the last reference to an output then goes with its own rank's
// thread, whose next output reuses that block (Note [Allocator thread
// affinity]).
//
// Note [Threads job order]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// A driver runs its own rank's whole-part job (a reduction's output stays
// in its core's cache), then the open pieces source by source: (0, s) ...
// (n-1, s) before (., s+1). Every thread that drives therefore copies from
// the same input at about the same time, as the naive version's ranks do
// when each copies its peers' shards in rank order, and a large input is
// read from memory once and from the shared cache by the others (had each
// driver started at its own rank's pieces, inputs larger than the L3 would
// stream four at once).
//
// A piece of 4 MiB or more is copied as several jobs (parts of at least
// 2 MiB, at most Round::max_parts(n); boundaries on 64-byte lines), part p
// of every rank's piece from a source before part p + 1: the drivers then
// read the same 2 MiB of an input together, and the last job of a round is
// short, so no core idles at the end while another copies a whole 16 MiB
// piece.
// A poster counts its parts from its own post (parts_of), which is also
// what peers read when they open its pieces.
//
// A sealed round (Note [Threads rounds]) may have pieces running: a claim
// re-reads the state after it is taken and skips the job once sealed, and
// a Work of a sealed round fails only after the claims in flight have ended
// (compare-and-swap on the claim, then read the state; compare-and-swap on
// the state, then read the claims: either the claimer sees the seal or the
// sealer sees the claim).

bool has_pieces(const Post& p) {
  return p.kind == CollectiveKind::AllGather || p.kind == CollectiveKind::AllToAll;
}

// Whether rank p's all_reduce is split into two phases (Note [Threads reductions]).
bool splits(const Post& p, int n) {
  return n > 1 && p.kind == CollectiveKind::AllReduce && p.input.nbytes() >= kSplitAllReduceBytes;
}

int64_t jobs_of(const Post& p, int n, int max_parts) {
  if (!has_pieces(p)) return splits(p, n) ? 2 : 1;
  int64_t jobs = 0;
  for (int s = 0; s < n; ++s)
    jobs += parts_of(p, s, max_parts);
  return jobs;
}

namespace {

[[noreturn]] void diverge(const Round& R, int index, int other) {
  const Post& me = R.posts[index];
  throw Error(fmt::format(
      "[comm::checked] {}: collectives diverge: rank {} launched {} while rank {} launched "
      "{} (same position in the group's launch order; check that every rank issues the "
      "same collectives in the same order with the same shapes)",
      *me.where, index, me.entry.str(), other, R.posts[other].entry.str()));
}

// Rank `source`'s post is on rank `index`'s device (Note [Threads ranks on
// one CUDA device]).
void check_device(const Round& R, int index, int source) {
  const Post& me = R.posts[index];
  const Post& peer = R.posts[source];
  const Device mine = device_of(me), theirs = device_of(peer);
  TANDEM_CHECK(mine == theirs,
               "[comm::{}] {}: expected every rank's tensors on one device (rank threads share "
               "their device), got {} from rank {} and {} from rank {}",
               collective_name(me.kind), *me.where, theirs.str(), source, mine.str(), index);
}

void check_fingerprints(const Round& R, int index) {
  const Post& me = R.posts[index];
  if (!me.checked) return;
  for (int r = 0; r < R.n; ++r) {
    if (R.posts[r].fingerprint != me.fingerprint) diverge(R, index, r);
  }
}

}  // namespace

namespace {

// Bytes of one row of an all_to_all post (0 when it has no rows at all).
int64_t row_bytes_of(const Post& me) {
  const int64_t in_rows = me.input.shape()[0], out_rows = me.output.shape()[0];
  return in_rows > 0    ? static_cast<int64_t>(me.input.nbytes()) / in_rows
         : out_rows > 0 ? static_cast<int64_t>(me.output.nbytes()) / out_rows
                        : 0;
}

// Bytes of the piece `me` receives from `source`.
int64_t piece_bytes(const Post& me, int source) {
  if (me.kind == CollectiveKind::AllGather) return static_cast<int64_t>(me.input.nbytes());
  return me.output_splits[source] * row_bytes_of(me);
}

// Parts of at least this many bytes (Note [Threads job order]).
constexpr int64_t kPartBytes = int64_t{2} << 20;

}  // namespace

int parts_of(const Post& me, int source, int max_parts) {
  const int64_t parts = piece_bytes(me, source) / kPartBytes;
  return static_cast<int>(std::clamp<int64_t>(parts, 1, max_parts));
}

// Part `part` of piece (index, source) of an all_gather or all_to_all (Note
// [Threads jobs]): bytes [bytes * part / parts, bytes * (part + 1) / parts),
// boundaries on 64-byte lines.
void copy_piece(const Round& R, int index, int source, int part) {
  const Post& me = R.posts[index];
  const Post& peer = R.posts[source];
  if (me.checked && peer.fingerprint != me.fingerprint) diverge(R, index, source);
  check_device(R, index, source);
  // Only reachable with checked mode off; guards the reads below.
  TANDEM_CHECK(peer.kind == me.kind && peer.input.dtype() == me.input.dtype() &&
                   (me.kind == CollectiveKind::AllToAll
                        ? peer.input_splits.size() == static_cast<size_t>(R.n)
                        : peer.input.nbytes() == me.input.nbytes()),
               "[comm::{}] {}: rank {} posted {} while rank {} runs {} (checked mode is off)",
               collective_name(me.kind), *me.where, source, peer.entry.str(), index,
               me.entry.str());
  char* out = static_cast<char*>(me.output.raw_data());
  const char* in = static_cast<const char*>(peer.input.raw_data());
  const int parts = parts_of(me, source, R.parts);
  auto part_range = [&](int64_t bytes) {
    auto boundary = [&](int p) { return p == parts ? bytes : bytes * p / parts / 64 * 64; };
    return std::pair<int64_t, int64_t>{boundary(part), boundary(part + 1)};
  };
  if (me.kind == CollectiveKind::AllGather) {
    const int64_t chunk = static_cast<int64_t>(me.input.nbytes());
    const auto [lo, hi] = part_range(chunk);
    move_bytes(device_of(me), out + source * chunk + lo, in + lo, static_cast<size_t>(hi - lo));
    return;
  }
  TANDEM_CHECK(peer.input_splits[index] == me.output_splits[source],
               "[comm::all_to_all] {}: split sizes disagree: rank {} sends {} rows to rank {}, "
               "which expects {} rows from it",
               *me.where, source, peer.input_splits[index], index, me.output_splits[source]);
  const int64_t row_bytes = row_bytes_of(me);
  int64_t out_row = 0, in_row = 0;
  for (int r = 0; r < source; ++r)
    out_row += me.output_splits[r];
  for (int r = 0; r < index; ++r)
    in_row += peer.input_splits[r];
  const auto [lo, hi] = part_range(me.output_splits[source] * row_bytes);
  if (hi > lo) {
    move_bytes(device_of(me), out + out_row * row_bytes + lo, in + in_row * row_bytes + lo,
               static_cast<size_t>(hi - lo));
  }
}

namespace {

// First phase of a split all_reduce: chunk `index` of every input, reduced
// into the same chunk of rank `index`'s output.
void reduce_chunk(const Round& R, int index) {
  const Post& me = R.posts[index];
  const int n = R.n;
  const int64_t count = me.input.numel();
  for (int r = 0; r < n; ++r) {
    const Post& peer = R.posts[r];
    // Only reachable with checked mode off; guards the reads below.
    TANDEM_CHECK(peer.kind == CollectiveKind::AllReduce && peer.input.numel() == count &&
                     peer.input.dtype() == me.input.dtype(),
                 "[comm::all_reduce] {}: rank {} posted {} while rank {} all_reduces {} {} "
                 "(checked mode is off)",
                 *me.where, r, peer.entry.str(), index, dtype_name(me.input.dtype()),
                 me.input.shape());
    check_device(R, index, r);
  }
  auto [lo, hi] = chunk_of(index, n, count);
  if (hi <= lo) return;
  const size_t element = me.input.element_size();
  std::vector<const void*> inputs(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r)
    inputs[r] = static_cast<const char*>(R.posts[r].input.raw_data()) + lo * element;
  reduce_ranks(device_of(me), me.op, me.input.dtype(), inputs,
               static_cast<char*>(me.output.raw_data()) + lo * element, hi - lo);
}

}  // namespace

// Second phase: the other chunks, from the outputs of the ranks that reduced
// them (every rank splits: reduce_chunk checked it).
void copy_peer_chunks(Round& R, int index) {
  const Post& me = R.posts[index];
  const int n = R.n;
  {
    std::lock_guard<std::mutex> lock(R.errors_mu);
    if (R.errors[index]) return;  // its own first phase failed
    for (int r = 0; r < n; ++r) {
      if (R.errors[r]) {
        throw CommAbortedError(
            fmt::format("[comm::all_reduce] {}: rank {} failed to reduce its chunk: {}", *me.where,
                        r, what_of(R.errors[r])));
      }
    }
  }
  const int64_t count = me.output.numel();
  const size_t element = me.output.element_size();
  for (int r = 0; r < n; ++r) {
    auto [lo, hi] = chunk_of(r, n, count);
    if (r == index || hi <= lo) continue;
    move_bytes(device_of(me), static_cast<char*>(me.output.raw_data()) + lo * element,
               static_cast<const char*>(R.posts[r].output.raw_data()) + lo * element,
               static_cast<size_t>(hi - lo) * element);
  }
}

// Rank `index`'s whole part, once every rank has posted: a reduction,
// broadcast or barrier, or the first phase of a split all_reduce.
void run_whole(const Round& R, int index) {
  const Post& me = R.posts[index];
  const int n = R.n;
  check_fingerprints(R, index);
  for (int r = 0; r < n; ++r)
    check_device(R, index, r);
  if (splits(me, n)) {
    reduce_chunk(R, index);
    return;
  }
  switch (me.kind) {
    case CollectiveKind::Barrier:
      return;
    case CollectiveKind::AllReduce: {
      std::vector<const void*> inputs(static_cast<size_t>(n));
      for (int r = 0; r < n; ++r)
        inputs[r] = R.posts[r].input.raw_data();
      reduce_ranks(device_of(me), me.op, me.output.dtype(), inputs, me.output.raw_data(),
                   me.output.numel());
      return;
    }
    case CollectiveKind::Broadcast: {
      const Tensor& src = R.posts[me.root].input;
      move_bytes(device_of(me), me.output.raw_data(), src.raw_data(), me.output.nbytes());
      return;
    }
    case CollectiveKind::ReduceScatter: {
      const size_t offset = static_cast<size_t>(index) * me.output.nbytes();
      std::vector<const void*> inputs(static_cast<size_t>(n));
      for (int r = 0; r < n; ++r)
        inputs[r] = static_cast<const char*>(R.posts[r].input.raw_data()) + offset;
      reduce_ranks(device_of(me), me.op, me.output.dtype(), inputs, me.output.raw_data(),
                   me.output.numel());
      return;
    }
    default:
      TANDEM_FAIL("[comm::{}] backend threads does not support {} ({})", collective_name(me.kind),
                  collective_name(me.kind), *me.where);
  }
}

}  // namespace tandem::threads_detail
