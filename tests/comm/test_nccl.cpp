// The NCCL backend on GPUs, run as `mpirun -n 1` (one GPU) by the MPI block of
// tests/meson.build; with -n N on N GPUs the same cases hold (expected values
// are computed from the rank). Without a GPU (or built without NCCL) every
// case prints "SKIP: ..." and passes. Results are compared with values
// computed on the CPU.
#include <catch2/catch.hpp>
#include <iostream>

#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "tandem/comm/backend.h"
#include "tandem/comm/nccl/nccl_backend.h"
#include "tests/comm/mpi/mpi_test_util.h"
#include "tests/support/test_util.h"

namespace tandem {
namespace {

using Catch::Matchers::Contains;
using test::values_of;

// Prints the reason and returns true when this machine cannot run NCCL.
bool skip_without_gpu() {
  if (!nccl_built()) {
    std::cout << "SKIP: built without NCCL" << std::endl;
    return true;
  }
  if (!cuda_available()) {
    std::cout << "SKIP: no CUDA device" << std::endl;
    return true;
  }
  if (cuda_emulated()) {
    std::cout << "SKIP: NCCL needs a real GPU, the CUDA device is emulated" << std::endl;
    return true;
  }
  return false;
}

// The GPU nccl_world() picks for this process (local rank mod device count).
Device my_device() {
  const char* local = std::getenv("OMPI_COMM_WORLD_LOCAL_RANK");
  int index = local != nullptr ? std::atoi(local) : 0;
  return Device::cuda(index % cuda_device_count());
}

Tensor on_gpu(const std::vector<double>& values, const Shape& shape, DType dtype) {
  return ops::to(test::tensor_of(values, shape, dtype), my_device());
}

ProcessGroupPtr world(bool checked = true) {
  ProcessGroupOptions options;
  options.checked = checked;
  options.timeout = std::chrono::seconds(30);
  options.name = "nccl";
  return create_world("nccl", options);
}

}  // namespace

TEST_CASE("nccl all_reduce: every op on f32, bf16 and i64", "[nccl]") {
  if (skip_without_gpu()) return;
  ProcessGroupPtr w = world();
  CHECK(w->backend_name() == "nccl");
  const int n = w->size(), r = w->rank();
  for (DType dtype : {DType::F32, DType::BF16, DType::I64}) {
    for (RedOp op : {RedOp::Sum, RedOp::Avg, RedOp::Max, RedOp::Min}) {
      INFO("dtype " << dtype_name(dtype) << " op " << red_op_name(op));
      std::vector<double> mine(6);
      for (int i = 0; i < 6; ++i)
        mine[i] = (r + 1) * (i + 1);
      WorkPtr work = w->all_reduce(on_gpu(mine, Shape{2, 3}, dtype), {op, ""});
      work->wait();
      CHECK(work->result().device() == my_device());
      std::vector<double> got = values_of(work->result());
      for (int i = 0; i < 6; ++i) {
        double sum = n * (n + 1) / 2.0 * (i + 1);
        double expected = op == RedOp::Sum     ? sum
                          : op == RedOp::Max   ? n * (i + 1.0)
                          : op == RedOp::Min   ? i + 1.0
                          : is_floating(dtype) ? sum / n
                                               : std::trunc(sum / n);
        CHECK(got[i] == test::stored_value(dtype, expected));
      }
    }
  }
  test::check_all_ranks_passed();
}

TEST_CASE("nccl broadcast, all_gather, reduce_scatter, all_to_all and barrier", "[nccl]") {
  if (skip_without_gpu()) return;
  ProcessGroupPtr w = world();
  const int n = w->size(), r = w->rank();

  std::vector<double> mine{r * 10.0, r * 10.0 + 1};
  WorkPtr b = w->broadcast(on_gpu(mine, Shape{2}, DType::F32), {n - 1, ""});
  b->wait();
  CHECK(values_of(b->result()) == std::vector<double>{(n - 1) * 10.0, (n - 1) * 10.0 + 1});

  WorkPtr g = w->all_gather(on_gpu(mine, Shape{1, 2}, DType::F32), {1, ""});
  g->wait();
  std::vector<double> gathered;
  for (int s = 0; s < n; ++s) {
    gathered.push_back(s * 10.0);
    gathered.push_back(s * 10.0 + 1);
  }
  CHECK(g->result().shape() == Shape{1, 2 * n});
  CHECK(values_of(g->result()) == gathered);

  std::vector<double> rows(static_cast<size_t>(2 * n));
  for (size_t j = 0; j < rows.size(); ++j)
    rows[j] = (r + 1) * static_cast<double>(j);
  WorkPtr rs = w->reduce_scatter(on_gpu(rows, Shape{2 * n}, DType::BF16), {RedOp::Sum, 0, ""});
  rs->wait();
  std::vector<double> got = values_of(rs->result());
  for (int k = 0; k < 2; ++k) {
    CHECK(got[k] == test::stored_value(DType::BF16, n * (n + 1) / 2.0 * (2 * r + k)));
  }

  std::vector<double> send;
  for (int j = 0; j < n; ++j)
    send.push_back(r * 100 + j);
  WorkPtr a2a = w->all_to_all_single(on_gpu(send, Shape{n}, DType::I64));
  a2a->wait();
  std::vector<double> expected;
  for (int s = 0; s < n; ++s)
    expected.push_back(s * 100 + r);
  CHECK(values_of(a2a->result()) == expected);

  w->barrier()->synchronize();
  test::check_all_ranks_passed();
}

TEST_CASE("nccl: the comm stream waits for the caller's stream", "[nccl]") {
  if (skip_without_gpu()) return;
  ProcessGroupPtr w = world(/*checked=*/false);
  const int n = w->size();
  // A long chain of kernels on the caller's stream produces the input right
  // before the launch; the collective must see its final value.
  Tensor x = ops::zeros(Shape{1 << 20}, DType::F32, my_device());
  for (int i = 0; i < 50; ++i)
    x = ops::add(x, ops::ones_like(x));
  WorkPtr work = w->all_reduce(x);
  work->wait();
  std::vector<double> got = values_of(ops::slice(work->result(), 0, 0, 4));
  CHECK(got == std::vector<double>(4, 50.0 * n));
  test::check_all_ranks_passed();
}

TEST_CASE("nccl sub-groups and CPU tensors rejected", "[nccl]") {
  if (skip_without_gpu()) return;
  ProcessGroupPtr w = world();
  const int n = w->size(), r = w->rank();
  std::vector<int> reversed;
  for (int i = n - 1; i >= 0; --i)
    reversed.push_back(i);
  ProcessGroupPtr sub = w->split(reversed, "reversed");
  REQUIRE(sub != nullptr);
  CHECK(sub->rank() == n - 1 - r);
  CHECK(sub->backend_name() == "nccl");
  WorkPtr work = sub->all_reduce(on_gpu({1.0}, Shape{1}, DType::F32));
  work->wait();
  CHECK(values_of(work->result())[0] == n);
  CHECK_THROWS_WITH(w->all_reduce(ops::ones(Shape{1})), Contains("expected CUDA tensors"));
  test::check_all_ranks_passed();
}

}  // namespace tandem
