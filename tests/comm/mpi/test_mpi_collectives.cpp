// The MPI backend under `mpirun -n 4` (tests/comm/mpi/mpi_main.cpp runs it).
//
// Every process runs these cases in order and every collective pairs up
// across processes, so the cases use CHECK, not REQUIRE, after a collective:
// a rank that left a case early would leave its peers waiting. Each case ends
// with check_all_ranks_passed(), so rank 0's report counts every rank's
// failures. Expected values are computed from the rank (nccl-tests style). The watchdog case makes
// its communicator unusable on purpose and runs on a split of its own world.
#include <catch2/catch.hpp>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <iterator>
#include <numeric>
#include <string>
#include <thread>

#include "tandem/comm/backend.h"
#include "tandem/comm/mpi/mpi_backend.h"
#include "tandem/comm/mpi/mpi_group.h"
#include "tests/comm/mpi/mpi_test_util.h"
#include "tests/support/test_util.h"

namespace tandem {
namespace {

using Catch::Matchers::Contains;
using test::tensor_of;
using test::values_of;

ProcessGroupPtr world(bool checked = true,
                      std::chrono::milliseconds timeout = std::chrono::seconds(30),
                      const std::string& name = "world") {
  ProcessGroupOptions options;
  options.checked = checked;
  options.timeout = timeout;
  options.name = name;
  return mpi_world(options);
}

// What the backend produces once a value is stored in `dtype`.
double stored(DType dtype, double v) {
  return test::stored_value(dtype, v);
}

std::string what_of(const WorkPtr& work) {
  try {
    work->synchronize();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

const DType kAllDtypes[] = {DType::F32, DType::F64, DType::BF16, DType::F16,
                            DType::I32, DType::I64, DType::Bool};
static_assert(std::size(kAllDtypes) == kDTypeCount, "every DType");

}  // namespace

TEST_CASE("mpi world: ranks, sizes and backend selection", "[mpi]") {
  ProcessGroupPtr w = world();
  REQUIRE(w->size() >= 2);
  CHECK(w->backend_name() == "mpi");
  CHECK(w->rank() >= 0);
  CHECK(w->rank() < w->size());
  std::vector<int> expected(static_cast<size_t>(w->size()));
  std::iota(expected.begin(), expected.end(), 0);
  CHECK(w->world_ranks() == expected);

  CHECK(backend_available("threads"));
  CHECK(backend_available("mpi"));
  ProcessGroupPtr chosen = create_world("mpi");
  CHECK(chosen->rank() == w->rank());
  CHECK_THROWS_WITH(create_world("gloo"), Contains("expected a backend among"));
  if (!backend_available("nccl")) {
    CHECK_THROWS_WITH(create_world("nccl"), Contains("[comm::nccl]"));
  }
  test::check_all_ranks_passed();
}

TEST_CASE("mpi all_reduce: every op, every dtype", "[mpi]") {
  ProcessGroupPtr w = world();
  const int n = w->size(), r = w->rank();
  const Shape shape{2, 3};
  for (DType dtype : kAllDtypes) {
    for (RedOp op : {RedOp::Sum, RedOp::Avg, RedOp::Max, RedOp::Min}) {
      if (dtype == DType::Bool && op == RedOp::Avg) continue;  // no meaning for bool
      INFO("dtype " << dtype_name(dtype) << " op " << red_op_name(op));
      // rank r holds (r + 1) * (i + 1); on bool, element i is set on ranks r <= i.
      std::vector<double> mine(6);
      for (int i = 0; i < 6; ++i)
        mine[i] = dtype == DType::Bool ? (r <= i) : (r + 1) * (i + 1);
      WorkPtr work = w->all_reduce(tensor_of(mine, shape, dtype), {op, ""});
      work->wait();
      std::vector<double> got = values_of(work->result());
      for (int i = 0; i < 6; ++i) {
        double expected = 0;
        if (dtype == DType::Bool) {
          expected = op == RedOp::Min ? (n - 1 <= i) : 1.0;  // and / or
        } else {
          double sum = n * (n + 1) / 2.0 * (i + 1);
          switch (op) {
            case RedOp::Sum:
              expected = sum;
              break;
            case RedOp::Avg:
              expected = is_floating(dtype) ? sum / n : std::trunc(sum / n);
              break;
            case RedOp::Max:
              expected = n * (i + 1.0);
              break;
            case RedOp::Min:
              expected = i + 1.0;
              break;
          }
        }
        CHECK(got[i] == stored(dtype, expected));
      }
    }
  }
  test::check_all_ranks_passed();
}

TEST_CASE("mpi all_reduce: bf16 sums are accumulated in f32 and rounded once", "[mpi]") {
  ProcessGroupPtr w = world();
  const int n = w->size();
  // 256 + 1 per rank: a bf16 running sum would round every partial sum back
  // to 256; accumulating in f32 keeps them.
  std::vector<double> mine{w->rank() == 0 ? 256.0 : 1.0};
  WorkPtr work = w->all_reduce(tensor_of(mine, Shape{1}, DType::BF16));
  work->synchronize();
  CHECK(values_of(work->result())[0] == stored(DType::BF16, 256.0 + (n - 1)));
  test::check_all_ranks_passed();
}

TEST_CASE("mpi broadcast from a non-zero root", "[mpi]") {
  ProcessGroupPtr w = world();
  const int n = w->size(), r = w->rank();
  const int root = n - 1;
  for (DType dtype : {DType::F32, DType::BF16, DType::I64}) {
    std::vector<double> mine(5);
    for (int i = 0; i < 5; ++i)
      mine[i] = r * 10 + i;
    WorkPtr work = w->broadcast(tensor_of(mine, Shape{5}, dtype), {root, ""});
    work->wait();
    std::vector<double> got = values_of(work->result());
    for (int i = 0; i < 5; ++i)
      CHECK(got[i] == stored(dtype, root * 10 + i));
  }
  test::check_all_ranks_passed();
}

TEST_CASE("mpi all_gather on dim 0 and dim 1", "[mpi]") {
  ProcessGroupPtr w = world();
  const int n = w->size(), r = w->rank();
  for (DType dtype : kAllDtypes) {
    INFO("dtype " << dtype_name(dtype));
    auto value = [&](int rank, int a, int b) {
      return dtype == DType::Bool ? (rank + a + b) % 2 : rank * 100 + a * 3 + b;
    };
    std::vector<double> mine;
    for (int a = 0; a < 2; ++a) {
      for (int b = 0; b < 3; ++b)
        mine.push_back(value(r, a, b));
    }
    Tensor t = tensor_of(mine, Shape{2, 3}, dtype);

    WorkPtr rows = w->all_gather(t, {0, ""});
    rows->wait();
    CHECK(rows->result().shape() == Shape{2 * n, 3});
    std::vector<double> got = values_of(rows->result());
    for (int s = 0; s < n; ++s) {
      for (int a = 0; a < 2; ++a) {
        for (int b = 0; b < 3; ++b)
          CHECK(got[(s * 2 + a) * 3 + b] == stored(dtype, value(s, a, b)));
      }
    }

    WorkPtr cols = w->all_gather(t, {1, ""});
    cols->wait();
    CHECK(cols->result().shape() == Shape{2, 3 * n});
    got = values_of(cols->result());
    for (int a = 0; a < 2; ++a) {
      for (int s = 0; s < n; ++s) {
        for (int b = 0; b < 3; ++b) {
          CHECK(got[a * 3 * n + s * 3 + b] == stored(dtype, value(s, a, b)));
        }
      }
    }
  }
  test::check_all_ranks_passed();
}

TEST_CASE("mpi reduce_scatter", "[mpi]") {
  ProcessGroupPtr w = world();
  const int n = w->size(), r = w->rank();
  const double ranks_sum = n * (n + 1) / 2.0;
  for (DType dtype : {DType::F32, DType::BF16, DType::I64}) {
    for (RedOp op : {RedOp::Sum, RedOp::Avg, RedOp::Max}) {
      INFO("dtype " << dtype_name(dtype) << " op " << red_op_name(op));
      // (2n, 3): element j of rank r is (r + 1) * j; rank r keeps rows 2r, 2r + 1.
      std::vector<double> mine(static_cast<size_t>(6 * n));
      for (size_t j = 0; j < mine.size(); ++j)
        mine[j] = (r + 1) * static_cast<double>(j);
      WorkPtr work = w->reduce_scatter(tensor_of(mine, Shape{2 * n, 3}, dtype), {op, 0, ""});
      work->wait();
      CHECK(work->result().shape() == Shape{2, 3});
      std::vector<double> got = values_of(work->result());
      for (int k = 0; k < 6; ++k) {
        double j = r * 6 + k;
        double expected = op == RedOp::Sum     ? ranks_sum * j
                          : op == RedOp::Max   ? n * j
                          : is_floating(dtype) ? ranks_sum * j / n
                                               : std::trunc(ranks_sum * j / n);
        CHECK(got[k] == stored(dtype, expected));
      }
    }
  }
  test::check_all_ranks_passed();
}

TEST_CASE("mpi reduce_scatter along dim 1", "[mpi]") {
  ProcessGroupPtr w = world();
  const int n = w->size(), r = w->rank();
  // (2, n): element (a, c) of rank r is r + 10 a + 100 c; rank r keeps column r.
  std::vector<double> mine;
  for (int a = 0; a < 2; ++a) {
    for (int c = 0; c < n; ++c)
      mine.push_back(r + 10 * a + 100 * c);
  }
  WorkPtr work = w->reduce_scatter(tensor_of(mine, Shape{2, n}), {RedOp::Sum, 1, ""});
  work->wait();
  CHECK(work->result().shape() == Shape{2, 1});
  std::vector<double> got = values_of(work->result());
  for (int a = 0; a < 2; ++a)
    CHECK(got[a] == n * (n - 1) / 2.0 + n * (10 * a + 100 * r));
  test::check_all_ranks_passed();
}

TEST_CASE("mpi all_to_all with even and uneven splits", "[mpi]") {
  ProcessGroupPtr w = world();
  const int n = w->size(), r = w->rank();

  SECTION("even") {
    // Row k of rank s is s * 1000 + k * 10 + c; rows 2j, 2j + 1 go to rank j.
    std::vector<double> mine;
    for (int k = 0; k < 2 * n; ++k) {
      for (int c = 0; c < 2; ++c)
        mine.push_back(r * 1000 + k * 10 + c);
    }
    WorkPtr work = w->all_to_all_single(tensor_of(mine, Shape{2 * n, 2}, DType::I64));
    work->wait();
    std::vector<double> got = values_of(work->result());
    REQUIRE(got.size() == static_cast<size_t>(4 * n));
    for (int s = 0; s < n; ++s) {
      for (int a = 0; a < 2; ++a) {
        for (int c = 0; c < 2; ++c)
          CHECK(got[(s * 2 + a) * 2 + c] == s * 1000 + (2 * r + a) * 10 + c);
      }
    }
  }

  SECTION("uneven, including empty chunks") {
    // Rank s sends (s + j) % 3 rows to rank j; row q of that chunk is s * 1000 + j * 100 + q * 10 +
    // c.
    auto rows = [](int s, int j) { return static_cast<int64_t>((s + j) % 3); };
    AllToAllOptions options;
    std::vector<double> mine;
    for (int j = 0; j < n; ++j) {
      options.input_split_sizes.push_back(rows(r, j));
      options.output_split_sizes.push_back(rows(j, r));
      for (int q = 0; q < rows(r, j); ++q) {
        for (int c = 0; c < 2; ++c)
          mine.push_back(r * 1000 + j * 100 + q * 10 + c);
      }
    }
    int64_t in_rows = static_cast<int64_t>(mine.size() / 2);
    WorkPtr work = w->all_to_all_single(tensor_of(mine, Shape{in_rows, 2}), options);
    work->wait();
    std::vector<double> expected;
    for (int s = 0; s < n; ++s) {
      for (int q = 0; q < rows(s, r); ++q) {
        for (int c = 0; c < 2; ++c)
          expected.push_back(s * 1000 + r * 100 + q * 10 + c);
      }
    }
    CHECK(values_of(work->result()) == expected);
  }
  test::check_all_ranks_passed();
}

TEST_CASE("mpi all_to_all: checked mode names the rank whose split sizes disagree", "[mpi]") {
  ProcessGroupPtr w = world();
  const int n = w->size(), r = w->rank();
  // Every rank sends one row to every rank, but rank 1 expects two from rank 0.
  AllToAllOptions options;
  options.input_split_sizes.assign(static_cast<size_t>(n), 1);
  options.output_split_sizes.assign(static_cast<size_t>(n), 1);
  if (r == 1) options.output_split_sizes[0] = 2;
  WorkPtr work = w->all_to_all_single(ops::zeros(Shape{n, 2}), options);
  std::string message = what_of(work);
  CHECK_THAT(message, Contains("split sizes disagree"));
  if (r != 1) CHECK_THAT(message, Contains("failed on rank 1"));

  // Every rank skipped the collective, so the group is still in step.
  WorkPtr after = w->all_reduce(ops::ones(Shape{1}));
  after->synchronize();
  CHECK(values_of(after->result())[0] == n);
  test::check_all_ranks_passed();
}

TEST_CASE("mpi send/recv and batch_isend_irecv around a ring", "[mpi]") {
  ProcessGroupPtr w = world();
  const int n = w->size(), r = w->rank();
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  auto payload = [](int rank) {
    std::vector<double> v(4);
    for (int i = 0; i < 4; ++i)
      v[i] = rank * 10 + i;
    return v;
  };

  SECTION("batch_isend_irecv") {
    for (DType dtype : {DType::F32, DType::BF16, DType::I64}) {
      WorkPtr work =
          w->batch_isend_irecv({P2POp::send(tensor_of(payload(r), Shape{4}, dtype), next, 3),
                                P2POp::recv(ops::zeros(Shape{4}, dtype), prev, 3)});
      work->wait();
      REQUIRE(work->results().size() == 1);
      std::vector<double> expected;
      for (double v : payload(prev))
        expected.push_back(stored(dtype, v));
      CHECK(values_of(work->results()[0]) == expected);
    }
  }

  SECTION("send and recv, even ranks sending first") {
    Tensor data = tensor_of(payload(r), Shape{4});
    WorkPtr sent, received;
    if (r % 2 == 0) {
      sent = w->send(data, {next, 0, ""});
      received = w->recv(ops::zeros(Shape{4}), {prev, 0, ""});
    } else {
      received = w->recv(ops::zeros(Shape{4}), {prev, 0, ""});
      sent = w->send(data, {next, 0, ""});
    }
    sent->wait();
    received->wait();
    CHECK(values_of(received->result()) == payload(prev));
  }

  SECTION("a receive of the wrong size names the sender") {
    // Rank 0 sends 4 elements to rank 1, which expects 8.
    if (r == 0) {
      WorkPtr work = w->send(tensor_of(payload(r), Shape{4}), {1, 5, ""});
      work->synchronize();
    } else if (r == 1) {
      WorkPtr work = w->recv(ops::zeros(Shape{8}), {0, 5, ""});
      CHECK_THAT(what_of(work), Contains("from rank 0") && Contains("expected 8 elements"));
    }
  }
  test::check_all_ranks_passed();
}

TEST_CASE("mpi sub-groups of a 2x2 layout", "[mpi]") {
  ProcessGroupPtr w = world();
  if (w->size() != 4) {
    WARN("SKIP: the 2x2 layout needs 4 ranks, got " << w->size());
    test::check_all_ranks_passed();
    return;
  }
  const int r = w->rank();
  // Every rank calls every split, in the same order; each gets one of each pair.
  ProcessGroupPtr row0 = w->split({0, 1}, "row0");
  ProcessGroupPtr row1 = w->split({2, 3}, "row1");
  ProcessGroupPtr col0 = w->split({0, 2}, "col0");
  ProcessGroupPtr col1 = w->split({3, 1}, "col1");  // order renumbers: world 3 is rank 0
  ProcessGroupPtr row = r < 2 ? row0 : row1;
  ProcessGroupPtr col = r % 2 == 0 ? col0 : col1;
  REQUIRE(row != nullptr);
  REQUIRE(col != nullptr);
  CHECK((r < 2 ? row1 : row0) == nullptr);
  CHECK((r % 2 == 0 ? col1 : col0) == nullptr);
  CHECK(row->size() == 2);
  CHECK(row->rank() == r % 2);
  CHECK(row->world_ranks() == (r < 2 ? std::vector<int>{0, 1} : std::vector<int>{2, 3}));
  CHECK(col->world_ranks() == (r % 2 == 0 ? std::vector<int>{0, 2} : std::vector<int>{3, 1}));
  CHECK(col->rank() == (r == 3 ? 0 : r == 1 ? 1 : r / 2));
  CHECK(col->options().name == (r % 2 == 0 ? "col0" : "col1"));

  // Row sums, then column sums of those: every rank ends with the total.
  WorkPtr in_row = row->all_reduce(tensor_of({static_cast<double>(r)}, Shape{1}));
  in_row->wait();
  CHECK(values_of(in_row->result())[0] == (r < 2 ? 1 : 5));
  WorkPtr in_col = col->all_reduce(in_row->result());
  in_col->wait();
  CHECK(values_of(in_col->result())[0] == 6);

  // A broadcast from group rank 0 of the column reaches the other member.
  WorkPtr from_root = col->broadcast(tensor_of({static_cast<double>(r)}, Shape{1}), {0, ""});
  from_root->wait();
  CHECK(values_of(from_root->result())[0] == (r % 2 == 0 ? 0 : 3));

  // Nested: a split of a split, p2p inside it by group rank.
  ProcessGroupPtr solo = row->split({1}, "solo");
  if (row->rank() == 1) {
    REQUIRE(solo != nullptr);
    CHECK(solo->size() == 1);
    CHECK(solo->world_ranks() == std::vector<int>{r});
    WorkPtr alone = solo->all_reduce(ops::full(Shape{2}, 7.0));
    alone->wait();
    CHECK(values_of(alone->result()) == std::vector<double>{7, 7});
  } else {
    CHECK(solo == nullptr);
  }
  WorkPtr pair = row->batch_isend_irecv(
      {P2POp::send(tensor_of({static_cast<double>(r)}, Shape{1}), 1 - row->rank()),
       P2POp::recv(ops::zeros(Shape{1}), 1 - row->rank())});
  pair->wait();
  CHECK(values_of(pair->results()[0])[0] == (r % 2 == 0 ? r + 1 : r - 1));
  test::check_all_ranks_passed();
}

TEST_CASE("mpi barrier and launches from several threads", "[mpi]") {
  ProcessGroupPtr w = world();
  const int n = w->size();
  w->barrier()->synchronize();
  // Two threads launch on two groups; each group's order is the same on every
  // rank, the interleaving between the groups is not.
  ProcessGroupPtr a = world(true, std::chrono::seconds(30), "a");
  ProcessGroupPtr b = world(true, std::chrono::seconds(30), "b");
  std::vector<WorkPtr> works_a, works_b;
  std::thread other([&] {
    for (int i = 0; i < 20; ++i)
      works_b.push_back(b->all_reduce(ops::full(Shape{3}, i)));
  });
  for (int i = 0; i < 20; ++i)
    works_a.push_back(a->all_reduce(ops::full(Shape{3}, 2 * i)));
  other.join();
  for (int i = 0; i < 20; ++i) {
    works_a[i]->wait();
    works_b[i]->wait();
    CHECK(values_of(works_a[i]->result())[0] == 2.0 * i * n);
    CHECK(values_of(works_b[i]->result())[0] == 1.0 * i * n);
  }
  CHECK(a->ledger().size() == 20);
  test::check_all_ranks_passed();
}

TEST_CASE("mpi checked mode: a launch-order mismatch names both calls", "[mpi]") {
  ProcessGroupPtr w = world(/*checked=*/true);
  const int r = w->rank(), n = w->size();
  Tensor t = ops::ones(Shape{4});
  // Even ranks all_reduce first, odd ranks broadcast first.
  WorkPtr first = r % 2 == 0 ? w->all_reduce(t) : w->broadcast(t, {0, ""});
  WorkPtr second = r % 2 == 0 ? w->broadcast(t, {0, ""}) : w->all_reduce(t);
  std::string message = what_of(first);
  CHECK_THAT(message, Contains("[comm::checked]") && Contains("collectives diverge"));
  CHECK_THAT(message, Contains("all_reduce") && Contains("broadcast"));
  CHECK_THAT(message, Contains(fmt::format("rank {} launched", r)));
  CHECK_THAT(what_of(second), Contains("collectives diverge"));

  // Every rank failed the same calls, so the group is still in step.
  WorkPtr agreed = w->all_reduce(t);
  agreed->synchronize();
  CHECK(values_of(agreed->result())[0] == n);
  test::check_all_ranks_passed();
}

TEST_CASE("mpi checked mode: mismatched shapes and split lists", "[mpi]") {
  ProcessGroupPtr w = world(/*checked=*/true);
  const int r = w->rank();
  WorkPtr work = w->all_reduce(ops::ones(Shape{r == 0 ? 3 : 4}));
  std::string message = what_of(work);
  CHECK_THAT(message, Contains("[3,0]") || Contains("[4,0]"));
  CHECK_THAT(message, Contains("collectives diverge"));
  // Disagreeing split lists fail on every rank instead of hanging.
  CHECK_THROWS_WITH(w->split(r == 0 ? std::vector<int>{0, 1} : std::vector<int>{1, 0}),
                    Contains("split"));
  WorkPtr agreed = w->all_reduce(ops::ones(Shape{1}));
  agreed->synchronize();
  CHECK(values_of(agreed->result())[0] == w->size());
  test::check_all_ranks_passed();
}

// Note [MPI progress]: a waiting thread runs the executor's passes itself.
// Any thread may wait; polling drives too; a Work that nobody drives (here
// Work::wait_finished, which only blocks) is progressed by the executor
// thread, which launches waited right away do not wake (Note [Lazy executor
// wake-ups]); and two threads may drive at once.
TEST_CASE("mpi Work: waited on another thread, polled, or left to the executor", "[mpi]") {
  ProcessGroupPtr w = world();
  const int n = w->size(), r = w->rank();
  for (int round = 0; round < 16; ++round) {
    WorkPtr work = w->all_reduce(ops::full(Shape{64}, r + round));
    std::string error;
    switch (round % 4) {
      case 0:
        work->synchronize();
        break;
      case 1: {
        std::thread other([&] { error = what_of(work); });
        other.join();
        CHECK(error == "(no error)");
        break;
      }
      case 2: {
        const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(20);
        while (!work->is_completed() && std::chrono::steady_clock::now() < give_up)
          std::this_thread::yield();
        break;
      }
      default:
        CHECK(work->wait_finished(std::chrono::seconds(20)));
        break;
    }
    REQUIRE(work->is_completed());
    CHECK(values_of(work->result())[0] == 1.0 * n * round + n * (n - 1) / 2);
  }
  ProcessGroupPtr a = world(true, std::chrono::seconds(30), "drivers.a");
  ProcessGroupPtr b = world(true, std::chrono::seconds(30), "drivers.b");
  WorkPtr wa = a->all_gather(ops::full(Shape{2}, r));
  WorkPtr wb = b->all_gather(ops::full(Shape{3}, 10 + r));
  std::string error_b;
  std::thread other([&] { error_b = what_of(wb); });
  wa->synchronize();
  other.join();
  CHECK(error_b == "(no error)");
  std::vector<double> expected_a, expected_b;
  for (int q = 0; q < n; ++q) {
    expected_a.insert(expected_a.end(), 2, q);
    expected_b.insert(expected_b.end(), 3, 10 + q);
  }
  CHECK(values_of(wa->result()) == expected_a);
  CHECK(values_of(wb->result()) == expected_b);
  test::check_all_ranks_passed();
}

// Note [MPI fingerprint board]: on one node, checked mode compares
// fingerprints through shared memory (unless TANDEM_MPI_BOARD=0, as in the
// mpi-no-board run of this suite); the ring of slots is reused many times
// over, also with launches far ahead of their waits, and a missing peer is
// reported within the deadline like any other wait.
TEST_CASE("mpi checked mode: the fingerprint board", "[mpi]") {
  using namespace std::chrono;
  const char* env = std::getenv("TANDEM_MPI_BOARD");
  const bool board_expected = env == nullptr || std::string(env) != "0";
  ProcessGroupPtr w = world();
  const int r = w->rank(), n = w->size();
  const int rounds = 3 * static_cast<int>(mpi::Board::kSlots);
  for (int i = 0; i < rounds; ++i) {
    WorkPtr sum = w->all_reduce(ops::full(Shape{2}, static_cast<double>(i + r)));
    sum->synchronize();
    CHECK(values_of(sum->result())[0] == static_cast<double>(n * i + n * (n - 1) / 2));
  }
  auto* mpi_group = dynamic_cast<mpi::MpiProcessGroup*>(w.get());
  REQUIRE(mpi_group != nullptr);
  CHECK(mpi_group->uses_board() == board_expected);
  ProcessGroupPtr unchecked = world(/*checked=*/false, seconds(30), "unchecked");
  unchecked->barrier()->synchronize();
  CHECK_FALSE(dynamic_cast<mpi::MpiProcessGroup*>(unchecked.get())->uses_board());

  // Launched far ahead of the waits: handshake h waits for slot h - kSlots
  // to be read by every rank.
  std::vector<WorkPtr> gathers;
  for (int i = 0; i < rounds; ++i)
    gathers.push_back(w->all_gather(ops::full(Shape{1}, static_cast<double>(100 * i + r))));
  for (int i = 0; i < rounds; ++i) {
    gathers[i]->synchronize();
    std::vector<double> expected;
    for (int q = 0; q < n; ++q)
      expected.push_back(100.0 * i + q);
    CHECK(values_of(gathers[i]->result()) == expected);
  }

  // A peer that never joins: the wait on the board is bounded and names it.
  ProcessGroupPtr timed = world(/*checked=*/true, milliseconds(500), "board-watchdog");
  ProcessGroupPtr pair = timed->split({0, 1});
  if (r == 0) {
    auto start = steady_clock::now();
    std::string message = what_of(pair->all_reduce(ops::ones(Shape{4})));
    auto waited = duration_cast<milliseconds>(steady_clock::now() - start).count();
    CHECK(waited >= 450);
    CHECK(waited < 5000);
    CHECK_THAT(message, Contains("[comm::watchdog]") && Contains("#0 all_reduce"));
    if (board_expected) {
      CHECK_THAT(message, Contains("fingerprints of ranks [1]") && Contains("shared-memory board"));
    } else {
      CHECK_THAT(message, Contains("checked-mode fingerprint exchange"));
    }
  }
  w->barrier()->synchronize();
  test::check_all_ranks_passed();
}

// Last: it leaves a communicator unusable (on a split of its own world).
TEST_CASE("mpi watchdog: a missing peer becomes an error within the deadline", "[mpi]") {
  using namespace std::chrono;
  ProcessGroupPtr w = world();
  ProcessGroupPtr fast = world(/*checked=*/false, milliseconds(500), "watchdog");
  ProcessGroupPtr pair = fast->split({0, 1});
  const int r = w->rank();
  if (r == 0) {
    Tensor x = ops::full(Shape{4}, 1.0);
    auto start = steady_clock::now();
    WorkPtr work = pair->all_reduce(x);  // rank 1 does not join (yet)
    std::string message;
    try {
      work->synchronize();
    } catch (const TimeoutError& e) {
      message = e.what();
    }
    auto waited = duration_cast<milliseconds>(steady_clock::now() - start).count();
    CHECK(waited >= 450);
    CHECK(waited < 5000);
    CHECK_THAT(message, Contains("[comm::watchdog]") && Contains("rank=0/2"));
    CHECK_THAT(message, Contains("group=watchdog.split0") && Contains("#0 all_reduce"));
    CHECK_THAT(message, Contains("world ranks are [0,1]") && Contains("unusable"));

    // Later launches on that communicator fail at once, naming the timeout.
    start = steady_clock::now();
    WorkPtr later = pair->barrier();
    CHECK_THAT(what_of(later), Contains("unusable") && Contains("timed out"));
    CHECK(duration_cast<milliseconds>(steady_clock::now() - start).count() < 400);
  }
  // The other groups are unaffected. Rank 1 then joins the abandoned
  // all_reduce, which completes against rank 0's orphaned request.
  w->barrier()->synchronize();
  if (r == 1) {
    WorkPtr late = pair->all_reduce(ops::full(Shape{4}, 2.0));
    late->synchronize();
    CHECK(values_of(late->result()) == std::vector<double>{3, 3, 3, 3});
  }
  w->barrier()->synchronize();
  test::check_all_ranks_passed();
}

}  // namespace tandem
