// The threads backend with the rank threads sharing one CUDA device (Note
// [Threads ranks on one CUDA device] in comm/threads/threads_jobs.cpp): every
// collective on CUDA tensors gives the bits it gives on CPU tensors, inputs
// produced on the caller's asynchronous stream are waited for, and a round
// that mixes devices fails with both named. The suite runs with
// TANDEM_CUDA=emulated (tests/meson.build), so these run in CI on the
// emulated device and natively on a GPU machine.
#include <catch2/catch.hpp>

#include <iostream>
#include <string>
#include <vector>

#include "tandem/comm/threads/threads_backend.h"
#include "tandem/runtime/device.h"
#include "tandem/runtime/stream.h"
#include "tandem/tensor/ops.h"
#include "tests/comm/collective_values.h"
#include "tests/support/skip_cuda.h"

namespace tandem {
namespace {

using namespace collective_test;
using test::random_tensor;

// cuda:0, made when a test runs (Device::cuda throws where no CUDA device
// exists, so not at static initialisation).
Device cuda0() {
  return Device::cuda(0);
}

// Runs `collective` on the CPU copy and the CUDA copy of the same input and
// records a failure unless the two results hold the same values.
template <class F>
void same_on_both(Failures& failures, int rank, const std::string& what, const Tensor& x,
                  F&& collective) {
  Tensor on_cpu = collective(x);
  Tensor on_cuda = collective(ops::to(x, cuda0()));
  if (!on_cuda.device().is_cuda()) {
    failures.add(fmt::format("rank {}: {}: result on {}, expected cuda", rank, what,
                             on_cuda.device().str()));
    return;
  }
  Tensor back = ops::to(on_cuda, Device::cpu());
  if (back.shape() != on_cpu.shape()) {
    failures.add(fmt::format("rank {}: {}: shape {} on cuda, {} on cpu", rank, what,
                             back.shape().str(), on_cpu.shape().str()));
    return;
  }
  if (values_of(back) != values_of(on_cpu))
    failures.add(fmt::format("rank {}: {}: cuda and cpu results differ", rank, what));
}

Tensor finished(const WorkPtr& w) {
  w->wait();
  return w->result();
}

TEST_CASE("threads backend: every collective on CUDA tensors gives the CPU's bits",
          "[collectives][cuda]") {
  TANDEM_SKIP_WITHOUT_CUDA();
  for (int world : {1, 2, 3, 4}) {
    for (DType dtype : kDtypes) {
      DYNAMIC_SECTION(case_name(world, dtype)) {
        Failures failures;
        run_ranks(world, [&](ProcessGroupPtr pg) {
          const int rank = pg->rank();
          const auto seed = static_cast<uint32_t>(100 * world + rank);
          Tensor x = random_tensor({6, 4}, dtype, seed, -8, 8);
          for (RedOp op : ops_for(dtype)) {
            same_on_both(
                failures, rank, fmt::format("all_reduce {}", red_op_name(op)), x,
                [&](const Tensor& t) { return finished(pg->all_reduce(t, reduce_with(op))); });
          }
          // At least 256 KiB: the reduction splits into two phases (Note [Threads reductions]).
          Tensor big = random_tensor({70000}, dtype, seed + 7, -8, 8);
          same_on_both(failures, rank, "split all_reduce", big,
                       [&](const Tensor& t) { return finished(pg->all_reduce(t)); });
          same_on_both(failures, rank, "broadcast", x, [&](const Tensor& t) {
            return finished(pg->broadcast(t, from_root(world - 1)));
          });
          for (int64_t dim : {0, 1}) {
            same_on_both(
                failures, rank, fmt::format("all_gather dim {}", dim), x,
                [&](const Tensor& t) { return finished(pg->all_gather(t, gather_along(dim))); });
          }
          Tensor rows = random_tensor({2 * world, 3}, dtype, seed + 11, -8, 8);
          same_on_both(failures, rank, "reduce_scatter", rows, [&](const Tensor& t) {
            return finished(pg->reduce_scatter(t, scatter_along(0, RedOp::Sum)));
          });
          // Rank r sends r + p rows to rank p.
          AllToAllOptions uneven;
          int64_t in_rows = 0;
          for (int p = 0; p < world; ++p) {
            uneven.input_split_sizes.push_back(rank + p);
            uneven.output_split_sizes.push_back(p + rank);
            in_rows += rank + p;
          }
          Tensor a2a = random_tensor({in_rows, 3}, dtype, seed + 13, -8, 8);
          same_on_both(failures, rank, "all_to_all_single uneven", a2a,
                       [&](const Tensor& t) { return finished(pg->all_to_all_single(t, uneven)); });
          if (world > 1) {
            same_on_both(failures, rank, "send/recv around a ring", x, [&](const Tensor& t) {
              WorkPtr w = pg->batch_isend_irecv(
                  {P2POp::send(t, (rank + 1) % world), P2POp::recv(t, (rank + world - 1) % world)});
              w->wait();
              return w->results().at(0);
            });
          }
        });
        REQUIRE_NO_FAILURES(failures);
      }
    }
  }
}

TEST_CASE("threads backend: a 16 MiB all_gather on CUDA tensors copies in parts",
          "[collectives][cuda]") {
  TANDEM_SKIP_WITHOUT_CUDA();
  Failures failures;
  // 4 MiB pieces are split into parts (Note [Threads job order]).
  run_ranks(4, [&](ProcessGroupPtr pg) {
    Tensor x = ops::full({1 << 20}, pg->rank() + 1, DType::F32, cuda0());
    Tensor out = ops::to(finished(pg->all_gather(x)), Device::cpu());
    std::vector<float> v = out.to_vector<float>();
    for (int r = 0; r < 4; ++r) {
      const size_t lo = static_cast<size_t>(r) << 20;
      bool ok = v[lo] == r + 1 && v[lo + (1 << 19)] == r + 1 && v[lo + (1 << 20) - 1] == r + 1;
      failures.expect(pg->rank(), fmt::format("piece from rank {}", r), ok);
    }
  });
  REQUIRE_NO_FAILURES(failures);
}

TEST_CASE("threads backend: a CUDA input still queued on the caller's stream is waited for",
          "[collectives][cuda]") {
  TANDEM_SKIP_WITHOUT_CUDA();
  Failures failures;
  run_ranks(4, [&](ProcessGroupPtr pg) {
    const int rank = pg->rank();
    // A stream of this rank's own; its work runs behind the host's back.
    Stream stream = Stream::create(cuda0());
    StreamGuard guard(stream);
    Tensor x = ops::full({1 << 16}, 1.0, DType::F32, cuda0());
    for (int i = 0; i < 20; ++i)
      x = ops::add(x, x);  // 2^20 once the stream ran them all
    Tensor sum = finished(pg->all_reduce(ops::mul(x, static_cast<double>(rank + 1))));
    // The caller's stream reads the result after wait(): it is complete.
    Tensor scaled = ops::to(ops::div(sum, 1024.0), Device::cpu());
    const float expected = 1024.0F * (1 + 2 + 3 + 4);
    std::vector<float> v = scaled.to_vector<float>();
    failures.expect(rank, fmt::format("first element {} == {}", v.front(), expected),
                    v.front() == expected && v.back() == expected);
  });
  REQUIRE_NO_FAILURES(failures);
}

TEST_CASE("threads backend: ranks on different devices fail naming both", "[collectives][cuda]") {
  TANDEM_SKIP_WITHOUT_CUDA();
  testing::RankChecks checks;
  try {
    run_ranks(2, [&](ProcessGroupPtr pg) {
      Device d = pg->rank() == 0 ? Device::cpu() : cuda0();
      pg->all_reduce(ops::ones({4}, DType::F32, d))->synchronize();
    });
    checks.check(false, "mixed devices: no exception");
  } catch (const std::exception& e) {
    const std::string what = e.what();
    checks.check(what.find("expected every rank's tensors on one device") != std::string::npos &&
                     what.find("cuda:0") != std::string::npos &&
                     what.find("cpu") != std::string::npos,
                 "mixed devices: " + what);
  }
  checks.report();
}

}  // namespace
}  // namespace tandem
