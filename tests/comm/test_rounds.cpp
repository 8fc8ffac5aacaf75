// How the threads backend's collectives behave beyond their values (Note
// [Threads rounds]): Work (waits, completion, results, async streams),
// run_ranks' hand-off of tensors to and from the rank threads (Note [Thread
// hand-off]), groups dropped while a wait on them is queued on a stream,
// more collectives in flight than the ring holds, outputs that reuse their
// rank's block, reductions that give every rank the same bits, pieces copied
// in parts and all_reduces split across ranks. Rank functions record
// failures in a Failures list (collective_values.h).
#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "tandem/comm/threads/threads_backend.h"
#include "tandem/runtime/stream.h"
#include "tests/comm/collective_values.h"

namespace tandem {
namespace {

using namespace collective_test;

TEST_CASE("Work::wait orders later ops of an async CPU stream after the collective",
          "[collectives]") {
  const int world = 4;
  Failures failures;
  run_ranks(world, [&](ProcessGroupPtr pg) {
    const int rank = pg->rank();
    Stream stream = Stream::create(Device::cpu(), CpuStreamMode::Async);
    StreamGuard guard(stream);
    for (int round = 0; round < 3; ++round) {
      // Rank 0 comes late, so the others' collectives are still running when
      // their streams reach the op that reads the result.
      if (rank == 0) test::sleep_ms(30);
      Tensor x = ops::full({64}, rank + round);
      WorkPtr w = pg->all_reduce(x);
      w->wait();
      Tensor y = ops::add(w->result(), 1.0);  // enqueued on `stream` after the wait
      double expected = 1;
      for (int r = 0; r < world; ++r)
        expected += r + round;
      expect_tensor(failures, rank, fmt::format("round {}", round), y, {64},
                    std::vector<double>(64, expected));
    }
    stream.synchronize();
  });
  REQUIRE_NO_FAILURES(failures);
}

// Note [Thread hand-off]: the rank threads read what the caller's stream
// still had to write when run_ranks() was called. The write is held by a
// gate that a helper opens once the ranks have read, or after 200 ms when
// they are (rightly) held back: a bound that could only hide the bug.
TEST_CASE("run_ranks: ranks start after what the caller's stream had queued", "[collectives]") {
  const int world = 3;
  Stream caller = Stream::create(Device::cpu(), CpuStreamMode::Async, "caller");
  test::Gate gate;  // after the stream: opened before it is joined
  StreamGuard guard(caller);
  Tensor x = ops::full({16}, 1.0);
  caller.enqueue(gate.waiter());
  ops::fill_(x, 7.0);
  std::atomic<int> read{0};
  std::atomic<bool> early{false};
  std::thread opener([&] {
    for (int i = 0; i < 200 && read.load() < world; ++i)
      test::sleep_ms(1);
    early = read.load() > 0;
    gate.open();
  });
  Failures failures;
  std::string error;
  try {
    run_ranks(world, [&](ProcessGroupPtr pg) {
      std::vector<float> seen = ops::mul(x, 1.0).to_vector<float>();
      ++read;
      if (seen != std::vector<float>(16, 7.0f))
        failures.add(
            fmt::format("rank {}: read x before the caller's stream wrote it", pg->rank()));
    });
  } catch (const std::exception& e) {
    error = e.what();
  }
  opener.join();
  INFO(error);
  REQUIRE(error.empty());
  CHECK_FALSE(early);
  REQUIRE_NO_FAILURES(failures);
}

// Note [Thread hand-off], the join: a rank's stream is synchronised before
// the rank ends, so an error still queued there fails run_ranks() instead of
// vanishing with the rank's thread.
TEST_CASE("run_ranks: an error left on a rank's stream reaches the caller", "[collectives]") {
  const CpuStreamMode saved = default_cpu_stream_mode();
  set_default_cpu_stream_mode(CpuStreamMode::Async);  // the rank threads' default streams
  auto body = [](ProcessGroupPtr pg) {
    current_stream(Device::cpu()).enqueue([rank = pg->rank()] {
      if (rank == 1) throw Error("[test::rank] expected success, got a late failure");
    });
  };
  std::string error;
  try {
    run_ranks(2, body);
  } catch (const std::exception& e) {
    error = e.what();
  }
  set_default_cpu_stream_mode(saved);
  REQUIRE_THAT(error, Catch::Contains("a late failure"));
}

// Note [Threads group lifetime]: a rank drops a group while a wait on it
// still runs on an async stream, with a later launch on that group whose
// input waits behind that wait on the same stream. The group must not end
// on the stream's thread (it would wait for its comm thread, which waits for
// that stream). Rank 0 lets its wait start before it drops the group, and
// rank 1 posts only afterwards, so the wait is the last to let go if it
// owns the group; a deadlock shows as a timeout.
TEST_CASE("a group dropped while a wait on it runs on an async stream ends cleanly",
          "[collectives]") {
  test::ScopedWaitTimeout bound(std::chrono::seconds(10));
  for (int attempt = 0; attempt < 3; ++attempt) {
    std::atomic<bool> dropping{false};
    run_ranks(2, [&](ProcessGroupPtr pg) {
      ProcessGroupPtr sub = pg->split({0, 1}, "dropped");
      Tensor x = ops::full({4}, 1.0);
      if (pg->rank() == 1) {
        for (int i = 0; i < 10000 && !dropping; ++i)
          test::sleep_ms(1);
        test::sleep_ms(20);  // rank 0 drops its group meanwhile
        WorkPtr a = sub->all_reduce(x), b = sub->all_reduce(x);
        a->synchronize();
        b->synchronize();
        return;
      }
      Stream stream = Stream::create(Device::cpu(), CpuStreamMode::Async);
      StreamGuard guard(stream);
      x = ops::full({4}, 1.0);
      stream.synchronize();
      WorkPtr a = sub->all_reduce(x);
      std::atomic<bool> reached{false};
      stream.enqueue([&reached] { reached = true; });
      a->wait();                       // next on the stream: drives round 0
      WorkPtr b = sub->all_reduce(x);  // its input is ready behind that wait
      for (int i = 0; i < 10000 && !reached; ++i)
        test::sleep_ms(1);
      test::sleep_ms(5);  // the wait has started
      dropping = true;
      sub.reset();
      a.reset();
      b.reset();
      stream.synchronize();
    });
  }
}

TEST_CASE("Work: completion and result", "[collectives]") {
  const int world = 2;
  Failures failures;
  run_ranks(world, [&](ProcessGroupPtr pg) {
    const int rank = pg->rank();
    WorkPtr w = pg->all_gather(ops::full({2}, rank), gather_along(0));
    w->synchronize();
    if (!w->is_completed())
      failures.add(fmt::format("rank {}: not completed after synchronize", rank));
    expect_tensor(failures, rank, "result after synchronize", w->result(), {4}, {0, 0, 1, 1});
    if (w->description().find("all_gather") == std::string::npos) {
      failures.add(
          fmt::format("rank {}: description '{}' does not name the op", rank, w->description()));
    }
    WorkPtr b = pg->barrier();
    b->synchronize();
    if (b->result().defined()) failures.add(fmt::format("rank {}: a barrier has a result", rank));
  });
  REQUIRE_NO_FAILURES(failures);
}

// Note [Threads rounds]: whoever waits runs the collective, so every way of
// observing a Work must make it complete: a wait on the launching thread or
// on another, polling is_completed(), a completion callback alone (the comm
// thread drives), or nothing at all (a peer's wait, or the ring wrapping).
TEST_CASE("Work: waited anywhere, polled, observed by a callback, or dropped", "[collectives]") {
  const int world = 4;
  const auto give_up = std::chrono::seconds(20);
  Failures failures;
  run_ranks(world, [&](ProcessGroupPtr pg) {
    const int rank = pg->rank();
    for (int round = 0; round < 24; ++round) {
      WorkPtr w = pg->all_gather(ops::full({1000}, rank + round), gather_along(0));
      const auto deadline = std::chrono::steady_clock::now() + give_up;
      try {
        switch ((rank + round) % 5) {
          case 0:
            w->synchronize();
            break;
          case 1: {
            std::exception_ptr error;
            std::thread other([&] {
              try {
                w->synchronize();
              } catch (...) {
                error = std::current_exception();
              }
            });
            other.join();
            if (error) std::rethrow_exception(error);
            break;
          }
          case 2:
            while (!w->is_completed() && std::chrono::steady_clock::now() < deadline)
              std::this_thread::yield();
            break;
          case 3: {
            auto done = std::make_shared<std::atomic<bool>>(false);
            w->on_completion([done] { done->store(true); });
            while (!done->load() && std::chrono::steady_clock::now() < deadline)
              test::sleep_ms(1);
            break;
          }
          default:
            w.reset();  // dropped: the other ranks' waits run this rank's part
            continue;
        }
      } catch (const std::exception& e) {
        failures.add(fmt::format("rank {} round {}: {}", rank, round, e.what()));
        continue;
      }
      if (!w->is_completed()) {
        failures.add(fmt::format("rank {} round {}: not completed", rank, round));
        continue;
      }
      std::vector<double> expected;
      for (int r = 0; r < world; ++r)
        expected.insert(expected.end(), 1000, r + round);
      expect_tensor(failures, rank, fmt::format("round {}", round), w->result(), {1000 * world},
                    expected);
    }
  });
  REQUIRE_NO_FAILURES(failures);
}

// More collectives in flight than a group's ring of rounds holds: launches
// past it wait on the comm thread for their slot, in launch order, and every
// result is right whatever order the Works are waited in.
TEST_CASE("more collectives in flight than the ring holds", "[collectives]") {
  const int world = 3;
  const int count = 30;
  Failures failures;
  run_ranks(world, [&](ProcessGroupPtr pg) {
    const int rank = pg->rank();
    std::vector<WorkPtr> works;
    for (int i = 0; i < count; ++i) {
      works.push_back(i % 3 == 2 ? pg->all_gather(ops::full({4}, rank + i), gather_along(0))
                                 : pg->all_reduce(ops::full({4}, rank + i)));
    }
    for (int i = count - 1; i >= 0; --i) {
      works[i]->synchronize();
      std::vector<double> expected;
      if (i % 3 == 2) {
        for (int r = 0; r < world; ++r)
          expected.insert(expected.end(), 4, r + i);
      } else {
        expected.assign(4, world * i + world * (world - 1) / 2.0);
      }
      expect_tensor(failures, rank, fmt::format("collective {}", i), works[i]->result(),
                    {static_cast<int64_t>(expected.size())}, expected);
    }
  });
  REQUIRE_NO_FAILURES(failures);
}

// A rank that waits for each collective before the next gets its output in
// the block of its previous one: the retiring thread lets go of every Work
// before it releases the ranks, so a rank frees its own output before it
// allocates the next, and the allocator hands a thread back its own block
// (Note [Allocator thread affinity]). A cycle through more blocks than ranks
// would push a loop's working set out of the cache. The input is ready
// first: on an async stream (TANDEM_CPU_STREAMS=async) a launch whose input
// is still queued is posted by the comm thread, and a Work that its waiter
// does not drive may lose its last reference on another thread.
TEST_CASE("a rank's outputs in a synchronous loop reuse one block", "[collectives]") {
  for (int world : {2, 4}) {
    Failures failures;
    run_ranks(world, [&](ProcessGroupPtr pg) {
      const int rank = pg->rank();
      Tensor x = ops::full({262144}, rank);  // 1 MiB: outputs of `world` MiB
      current_stream().synchronize();
      std::vector<const void*> blocks;
      for (int i = 0; i < 40; ++i) {
        WorkPtr w = pg->all_gather(x);
        w->synchronize();
        const void* block = w->result().raw_data();
        if (std::find(blocks.begin(), blocks.end(), block) == blocks.end()) blocks.push_back(block);
      }
      if (blocks.size() != 1) {
        failures.add(fmt::format("world {} rank {}: 40 outputs in {} blocks, expected 1", world,
                                 rank, blocks.size()));
      }
    });
    REQUIRE_NO_FAILURES(failures);
  }
}

// Large buffers take the split path of the threads backend (each rank
// reduces a chunk; Note [Threads reductions]); small ones do not. Both must
// give every rank the same bits, and the bits of a plain rank-order loop.
TEST_CASE("reductions are bit-identical on every rank", "[collectives]") {
  for (int64_t numel : {int64_t{257}, int64_t{100003}}) {
    for (int world : {3, 5, 8}) {
      for (DType dtype : {DType::F32, DType::BF16}) {
        DYNAMIC_SECTION(numel << " elements, " << case_name(world, dtype)) {
          // Random non-integer data: the result depends on the summation order.
          auto data = [&](int rank) {
            return test::random_stored(static_cast<size_t>(numel),
                                       1000u + static_cast<uint32_t>(rank), dtype);
          };
          std::vector<Tensor> sums(static_cast<size_t>(world)), avgs(static_cast<size_t>(world));
          run_ranks(world, [&](ProcessGroupPtr pg) {
            const int rank = pg->rank();
            Tensor x = tensor_of(data(rank), {numel}, dtype);
            WorkPtr sum = pg->all_reduce(x);
            WorkPtr avg = pg->all_reduce(x, reduce_with(RedOp::Avg));
            sum->synchronize();
            avg->synchronize();
            sums[rank] = sum->result();
            avgs[rank] = avg->result();
          });
          for (int r = 1; r < world; ++r) {
            INFO("rank " << r);
            REQUIRE(ops::equal(sums[0], sums[r]));
            REQUIRE(ops::equal(avgs[0], avgs[r]));
          }
          // ((x_0 + x_1) + x_2) + ..., rounded to the dtype after each step.
          std::vector<double> expected = data(0);
          for (int r = 1; r < world; ++r) {
            std::vector<double> x = data(r);
            for (size_t i = 0; i < x.size(); ++i)
              expected[i] = stored_value(dtype, expected[i] + x[i]);
          }
          std::vector<double> got = values_of(sums[0]);
          REQUIRE(got == expected);
        }
      }
    }
  }
}

// Pieces of 4 MiB and more are copied in parts (Note [Threads job order]):
// every element lands once, in its place, also where part boundaries fall
// mid-row and next to empty pieces. Values are unique per rank and element.
TEST_CASE("all_gather and all_to_all of pieces copied in parts", "[collectives]") {
  const int world = 3;
  auto v = [](int rank, int64_t i) { return static_cast<double>(int64_t{rank} * 1000000000 + i); };
  auto tensor_for = [&](int rank, int64_t rows, int64_t width) {
    std::vector<double> values(static_cast<size_t>(rows * width));
    for (int64_t i = 0; i < rows * width; ++i)
      values[static_cast<size_t>(i)] = v(rank, i);
    return tensor_of(values, Shape{rows, width}, DType::I64);
  };
  Failures failures;
  run_ranks(world, [&](ProcessGroupPtr pg) {
    const int rank = pg->rank();
    // all_gather: 1,100,001 i64 per rank (8.8 MB pieces, 4 parts).
    const int64_t n = 1100001;
    WorkPtr g = pg->all_gather(tensor_for(rank, n, 1));
    g->synchronize();
    std::vector<double> gathered;
    for (int r = 0; r < world; ++r) {
      for (int64_t i = 0; i < n; ++i)
        gathered.push_back(v(r, i));
    }
    expect_tensor(failures, rank, "all_gather in parts", g->result(), {world * n, 1}, gathered);

    // all_to_all: rows of 3 i64; rank r sends 200,003 rows (4.8 MB, 2 parts),
    // none or 5 to its peers.
    auto rows = [](int from, int to) -> int64_t {
      const int k = (from + to) % 3;
      return k == 0 ? 200003 : k == 1 ? 0 : 5;
    };
    AllToAllOptions o;
    int64_t in_rows = 0, out_rows = 0;
    for (int p = 0; p < world; ++p) {
      o.input_split_sizes.push_back(rows(rank, p));
      o.output_split_sizes.push_back(rows(p, rank));
      in_rows += rows(rank, p);
      out_rows += rows(p, rank);
    }
    WorkPtr a = pg->all_to_all_single(tensor_for(rank, in_rows, 3), o);
    a->synchronize();
    std::vector<double> expected;
    for (int p = 0; p < world; ++p) {
      int64_t offset = 0;  // where rank p's rows for us start in its input
      for (int q = 0; q < rank; ++q)
        offset += rows(p, q);
      for (int64_t i = offset * 3; i < (offset + rows(p, rank)) * 3; ++i)
        expected.push_back(v(p, i));
    }
    expect_tensor(failures, rank, "all_to_all in parts", a->result(), {out_rows, 3}, expected);
  });
  REQUIRE_NO_FAILURES(failures);
}

TEST_CASE("all_reduce of large buffers, split across ranks", "[collectives]") {
  for (int world : {2, 3, 5, 8}) {
    for (DType dtype : kDtypes) {
      DYNAMIC_SECTION(case_name(world, dtype)) {
        // Past the split threshold (256 KiB), with a count no world divides.
        const int64_t numel = 300007 / static_cast<int64_t>(dtype_size(dtype)) + 1;
        Failures failures;
        run_ranks(world, [&](ProcessGroupPtr pg) {
          const int rank = pg->rank();
          Tensor x = rank_tensor(rank, {numel}, dtype);
          for (RedOp op : ops_for(dtype)) {
            WorkPtr w = pg->all_reduce(x, reduce_with(op));
            w->synchronize();
            std::vector<double> expected(static_cast<size_t>(numel));
            for (int64_t i = 0; i < numel; ++i) {
              expected[i] = reduce_value(op, world, dtype, [&](int r) { return value(r, i); });
            }
            expect_tensor(failures, rank, fmt::format("all_reduce {}", red_op_name(op)),
                          w->result(), {numel}, expected);
          }
        });
        REQUIRE_NO_FAILURES(failures);
      }
    }
  }
}

}  // namespace
}  // namespace tandem
