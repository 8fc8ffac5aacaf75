// Checked launch order, the watchdog and failure propagation of the threads
// backend (Note [Checked launch order], Note [Bounded waits]): every mistake a
// rank can make fails every rank that depends on it, quickly, with a message
// naming the ranks and the calls, instead of hanging or returning garbage.
//
// Rank functions record what happened to them (Catch2's assertions are not
// thread-safe); the test thread asserts on those records.
#include <catch2/catch.hpp>

#include <chrono>
#include <exception>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "tandem/comm/threads/threads_backend.h"
#include "tests/support/test_util.h"

namespace tandem {
namespace {

using Catch::Contains;
using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

// What happened on each rank: the error its collective raised, if any, and
// how long the failing call took.
struct Outcomes {
  explicit Outcomes(int world)
      : errors(static_cast<size_t>(world)), elapsed_ms(static_cast<size_t>(world), 0.0) {}
  std::vector<std::exception_ptr> errors;
  std::vector<double> elapsed_ms;

  // Runs fn, recording its error and duration for `rank`.
  template <class F>
  void record(int rank, F&& fn) {
    Clock::time_point start = Clock::now();
    try {
      fn();
    } catch (...) {
      errors[rank] = std::current_exception();
    }
    elapsed_ms[rank] = ms_since(start);
  }
};

ProcessGroupOptions with_timeout(std::chrono::milliseconds timeout, bool checked = true) {
  ProcessGroupOptions o;
  o.timeout = timeout;
  o.checked = checked;
  return o;
}

TEST_CASE("checked mode: an order mismatch fails every rank, naming both calls", "[checked]") {
  const int world = 3;
  Outcomes out(world);
  run_ranks(world, [&](ProcessGroupPtr pg) {
    out.record(pg->rank(), [&] {
      // Ranks 0 and 1 all_reduce a (2, 3) tensor; rank 2 all_gathers a (6).
      WorkPtr w =
          pg->rank() < 2 ? pg->all_reduce(ops::ones({2, 3})) : pg->all_gather(ops::ones({6}));
      w->synchronize();
    });
  });
  for (int r = 0; r < world; ++r) {
    INFO("rank " << r);
    REQUIRE(out.errors[r]);
    REQUIRE_THROWS_WITH(std::rethrow_exception(out.errors[r]),
                        Contains("[comm::checked]") && Contains("all_reduce(f32, [2,3") &&
                            Contains("all_gather(f32, [6") && Contains("rank 2"));
  }
}

TEST_CASE("checked mode: a size mismatch fails every rank, naming both shapes", "[checked]") {
  const int world = 2;
  Outcomes out(world);
  run_ranks(world, [&](ProcessGroupPtr pg) {
    out.record(pg->rank(), [&] { pg->all_reduce(ops::ones({4 + pg->rank()}))->synchronize(); });
  });
  for (int r = 0; r < world; ++r) {
    INFO("rank " << r);
    REQUIRE(out.errors[r]);
    REQUIRE_THROWS_WITH(std::rethrow_exception(out.errors[r]),
                        Contains("all_reduce(f32, [4,") && Contains("all_reduce(f32, [5,"));
  }
}

TEST_CASE("uneven all_to_all with disagreeing split sizes names both ranks", "[checked]") {
  const int world = 2;
  Outcomes out(world);
  run_ranks(world, [&](ProcessGroupPtr pg) {
    // Rank 1 sends 3 rows to rank 0, which expects 1 row from it.
    AllToAllOptions o;
    o.input_split_sizes = pg->rank() == 0 ? std::vector<int64_t>{1, 2} : std::vector<int64_t>{3, 1};
    o.output_split_sizes =
        pg->rank() == 0 ? std::vector<int64_t>{1, 1} : std::vector<int64_t>{2, 1};
    int64_t rows = o.input_split_sizes[0] + o.input_split_sizes[1];
    out.record(pg->rank(), [&] { pg->all_to_all_single(ops::ones({rows, 2}), o)->synchronize(); });
  });
  REQUIRE(out.errors[0]);
  REQUIRE_THROWS_WITH(std::rethrow_exception(out.errors[0]),
                      Contains("rank 1 sends 3 rows to rank 0, which expects 1 rows"));
}

TEST_CASE("recv with a mismatched shape fails naming both shapes", "[checked]") {
  const int world = 2;
  Outcomes out(world);
  run_ranks(world, [&](ProcessGroupPtr pg) {
    P2POptions o;
    o.peer = 1 - pg->rank();
    out.record(pg->rank(), [&] {
      WorkPtr w = pg->rank() == 0 ? pg->send(ops::ones({4}), o) : pg->recv(ops::zeros({5}), o);
      w->synchronize();
    });
  });
  REQUIRE(out.errors[1]);
  REQUIRE_THROWS_WITH(std::rethrow_exception(out.errors[1]),
                      Contains("[comm::recv]") && Contains("rank 0 sent f32 [4]") &&
                          Contains("rank 1 expected f32 [5]"));
}

TEST_CASE("the watchdog turns a missing peer into a TimeoutError", "[checked]") {
  const int world = 2;
  const auto timeout = std::chrono::milliseconds(300);
  Outcomes out(world);
  run_ranks(
      world,
      [&](ProcessGroupPtr pg) {
        if (pg->rank() == 1) test::sleep_ms(900);  // late: past the group's timeout
        out.record(pg->rank(), [&] { pg->all_reduce(ops::ones({8}))->synchronize(); });
      },
      with_timeout(timeout));
  REQUIRE(out.errors[0]);
  REQUIRE_THROWS_AS(std::rethrow_exception(out.errors[0]), TimeoutError);
  REQUIRE_THROWS_WITH(std::rethrow_exception(out.errors[0]),
                      Contains("[comm::watchdog]") && Contains("missing: [1]") &&
                          Contains("Last collectives of this rank") &&
                          Contains("#0 all_reduce(f32, [8,"));
  CHECK(out.elapsed_ms[0] >= 0.9 * timeout.count());
  CHECK(out.elapsed_ms[0] < 5.0 * timeout.count());
  // The late rank finds the group aborted, with the reason.
  REQUIRE(out.errors[1]);
  REQUIRE_THROWS_AS(std::rethrow_exception(out.errors[1]), CommAbortedError);
  REQUIRE_THROWS_WITH(std::rethrow_exception(out.errors[1]),
                      Contains("rank 0 timed out") && Contains("waiting for ranks [1]"));
}

TEST_CASE("an exception in one rank's code fails its peers quickly; the root cause is rethrown",
          "[checked]") {
  const int world = 3;
  Outcomes out(world);
  auto rank_fn = [&](ProcessGroupPtr pg) {
    if (pg->rank() == 1) {
      test::sleep_ms(100);  // the others are blocked in the collective by now
      throw std::runtime_error("user error on rank 1");
    }
    out.record(pg->rank(), [&] { pg->all_reduce(ops::ones({8}))->synchronize(); });
    if (out.errors[pg->rank()]) std::rethrow_exception(out.errors[pg->rank()]);
  };
  std::string report;
  try {
    run_ranks(world, rank_fn, with_timeout(std::chrono::seconds(20)));
  } catch (const Error& e) {  // a foreign root cause is reported as a tandem::Error
    report = e.what();
  }
  INFO(report);
  // The root cause first, then the ranks it aborted (Note [Rank failure report]).
  const size_t root = report.find("rank 1: user error on rank 1");
  const size_t r0 = report.find("rank 0 (aborted): "), r2 = report.find("rank 2 (aborted): ");
  REQUIRE(root != std::string::npos);
  REQUIRE(r0 != std::string::npos);
  REQUIRE(r2 != std::string::npos);
  CHECK(root < r0);
  CHECK(r0 < r2);
  for (int r : {0, 2}) {
    INFO("rank " << r);
    REQUIRE(out.errors[r]);
    REQUIRE_THROWS_AS(std::rethrow_exception(out.errors[r]), CommAbortedError);
    REQUIRE_THROWS_WITH(std::rethrow_exception(out.errors[r]),
                        Contains("rank 1 failed") && Contains("user error on rank 1"));
    CHECK(out.elapsed_ms[r] < 5000.0);  // far below the 20 s timeout
  }
}

TEST_CASE("ranks failing for different reasons are all reported, in rank order", "[checked]") {
  // Rank 2 fails first and aborts the world; rank 1 fails later with an error
  // of its own; rank 0 is aborted in its collective. Whatever the timing, the
  // report lists both root causes in rank order, then the aborted rank.
  const int world = 3;
  auto rank_fn = [&](ProcessGroupPtr pg) {
    if (pg->rank() == 2) throw TimeoutError("rank 2 gave up");
    if (pg->rank() == 1) {
      test::sleep_ms(150);  // well after rank 2's failure
      throw Error("rank 1 found bad input");
    }
    pg->all_reduce(ops::ones({8}))->synchronize();
  };
  std::string report;
  bool timeout_type = false;
  try {
    run_ranks(world, rank_fn, with_timeout(std::chrono::seconds(20)));
  } catch (const TimeoutError& e) {
    report = e.what();
    timeout_type = true;
  } catch (const Error& e) {
    report = e.what();
  }
  INFO(report);
  const size_t r1 = report.find("rank 1: rank 1 found bad input");
  const size_t r2 = report.find("rank 2: rank 2 gave up");
  const size_t r0 = report.find("rank 0 (aborted): ");
  REQUIRE(r1 != std::string::npos);
  REQUIRE(r2 != std::string::npos);
  REQUIRE(r0 != std::string::npos);
  CHECK(r1 < r2);
  CHECK(r2 < r0);
  CHECK(report.find("3 of 3 failing") != std::string::npos);
  // The first root cause in rank order (rank 1's Error) sets the type, not
  // the first in time (rank 2's TimeoutError).
  CHECK_FALSE(timeout_type);
}

TEST_CASE("a rank that returns early fails its peers with a clear message", "[checked]") {
  const int world = 2;
  Outcomes out(world);
  run_ranks(
      world,
      [&](ProcessGroupPtr pg) {
        if (pg->rank() == 1) return;
        out.record(0, [&] { pg->all_reduce(ops::ones({8}))->synchronize(); });
      },
      with_timeout(std::chrono::seconds(20)));
  REQUIRE(out.errors[0]);
  REQUIRE_THROWS_AS(std::rethrow_exception(out.errors[0]), CommAbortedError);
  REQUIRE_THROWS_WITH(std::rethrow_exception(out.errors[0]),
                      Contains("rank 1 returned from its rank function") && Contains("all_reduce"));
  CHECK(out.elapsed_ms[0] < 5000.0);
}

TEST_CASE("the ledger records op, dtype, counts, peer and tag", "[checked]") {
  const int world = 2;
  std::vector<std::vector<LedgerEntry>> entries(world);
  run_ranks(world, [&](ProcessGroupPtr pg) {
    AllReduceOptions reduce;
    reduce.op = RedOp::Max;
    reduce.tag = "grad-sync";
    AllGatherOptions gather;
    gather.dim = 1;
    BroadcastOptions bcast;
    bcast.root = 1;
    pg->all_reduce(ops::ones({2, 3}), reduce)->synchronize();
    pg->all_gather(ops::ones({2, 3}, DType::BF16), gather)->synchronize();
    pg->broadcast(ops::ones({5}, DType::I64), bcast)->synchronize();
    entries[pg->rank()] = pg->ledger().tail(8);
  });
  for (int r = 0; r < world; ++r) {
    INFO("rank " << r);
    const std::vector<LedgerEntry>& e = entries[r];
    REQUIRE(e.size() == 3);
    CHECK(e[0].seq == 0);
    CHECK(e[0].op == "all_reduce");
    CHECK(e[0].dtype == "f32");
    CHECK(e[0].counts == std::vector<int64_t>{2, 3, static_cast<int64_t>(RedOp::Max)});
    CHECK(e[0].tag == "grad-sync");
    CHECK(e[0].thread == fmt::format("rank {}", r));
    CHECK(e[1].seq == 1);
    CHECK(e[1].op == "all_gather");
    CHECK(e[1].dtype == "bf16");
    CHECK(e[1].counts == std::vector<int64_t>{2, 3, 1});
    CHECK(e[2].op == "broadcast");
    CHECK(e[2].dtype == "i64");
    CHECK(e[2].peer == 1);
    CHECK_THAT(e[0].str(), Contains("all_reduce") && Contains("tag=grad-sync"));
  }
}

TEST_CASE("the ledger keeps its last entries in launch order once it wraps", "[checked]") {
  Ledger ledger(3);
  CHECK(ledger.tail(5).empty());
  CHECK_THAT(ledger.tail_str(5), Contains("no collectives launched"));
  for (int i = 0; i < 7; ++i) {
    LedgerEntry e;
    e.op = i % 2 == 0 ? "all_reduce" : "a_collective_with_a_long_name";
    e.counts.assign(static_cast<size_t>(i + 1), i);
    e.tag = fmt::format("step {}", i);
    CHECK(ledger.append(e).seq == static_cast<uint64_t>(i));
  }
  CHECK(ledger.size() == 7);
  std::vector<LedgerEntry> all = ledger.tail(10);  // only the last 3 are kept
  REQUIRE(all.size() == 3);
  for (int k = 0; k < 3; ++k) {
    const int i = 4 + k;
    CHECK(all[k].seq == static_cast<uint64_t>(i));
    CHECK(all[k].op == (i % 2 == 0 ? "all_reduce" : "a_collective_with_a_long_name"));
    CHECK(all[k].counts == std::vector<int64_t>(static_cast<size_t>(i + 1), i));
    CHECK(all[k].tag == fmt::format("step {}", i));
  }
  std::vector<LedgerEntry> last = ledger.tail(2);
  REQUIRE(last.size() == 2);
  CHECK(last[0].seq == 5);
  CHECK(last[1].seq == 6);

  Ledger none(0);  // keeps no entries, still counts and hashes them
  none.append(LedgerEntry{});
  CHECK(none.size() == 1);
  CHECK(none.tail(4).empty());
}

// History fingerprints of every rank after running `sequence` on `world` ranks.
std::vector<uint64_t> history_after(int world, const std::function<void(ProcessGroup&)>& sequence) {
  std::vector<uint64_t> fingerprints(static_cast<size_t>(world));
  run_ranks(world, [&](ProcessGroupPtr pg) {
    sequence(*pg);
    fingerprints[pg->rank()] = pg->ledger().history_fingerprint();
  });
  return fingerprints;
}

TEST_CASE("history fingerprints agree after the same sequence, differ after another", "[checked]") {
  const int world = 3;
  auto sequence_a = [](ProcessGroup& pg) {
    pg.all_reduce(ops::ones({4}))->synchronize();
    pg.all_gather(ops::ones({2, 2}))->synchronize();
  };
  auto sequence_b = [](ProcessGroup& pg) {  // same calls, one shape differs
    pg.all_reduce(ops::ones({4}))->synchronize();
    pg.all_gather(ops::ones({2, 3}))->synchronize();
  };
  auto sequence_c = [](ProcessGroup& pg) {  // another op
    pg.all_reduce(ops::ones({4}))->synchronize();
    BroadcastOptions o;
    o.root = 2;
    pg.broadcast(ops::ones({2, 2}), o)->synchronize();
  };
  std::vector<uint64_t> a = history_after(world, sequence_a);
  std::vector<uint64_t> a_again = history_after(world, sequence_a);
  std::vector<uint64_t> b = history_after(world, sequence_b);
  std::vector<uint64_t> c = history_after(world, sequence_c);
  for (int r = 1; r < world; ++r) {
    INFO("rank " << r);
    CHECK(a[r] == a[0]);
    CHECK(b[r] == b[0]);
    CHECK(c[r] == c[0]);
  }
  CHECK(a_again[0] == a[0]);
  CHECK(b[0] != a[0]);
  CHECK(c[0] != a[0]);
  CHECK(c[0] != b[0]);
}

// Rank 0 all_reduces while rank 1 broadcasts from rank 0: same shapes, so
// only the fingerprint comparison can tell; unchecked mode skips it and both
// calls run to completion (their results are meaningless and not checked).
TEST_CASE("unchecked mode skips the fingerprint comparison", "[checked]") {
  for (bool checked : {true, false}) {
    DYNAMIC_SECTION((checked ? "checked" : "unchecked")) {
      const int world = 2;
      Outcomes out(world);
      std::vector<uint64_t> fingerprints(world);
      run_ranks(
          world,
          [&](ProcessGroupPtr pg) {
            out.record(pg->rank(), [&] {
              Tensor x = ops::ones({4});
              WorkPtr w = pg->rank() == 0 ? pg->all_reduce(x) : pg->broadcast(x);
              w->synchronize();
            });
            fingerprints[pg->rank()] = pg->ledger().history_fingerprint();
          },
          with_timeout(std::chrono::seconds(20), checked));
      CHECK(fingerprints[0] != fingerprints[1]);  // the ledgers do differ
      for (int r = 0; r < world; ++r) {
        INFO("rank " << r);
        if (checked) {
          REQUIRE(out.errors[r]);
          REQUIRE_THROWS_WITH(std::rethrow_exception(out.errors[r]),
                              Contains("all_reduce") && Contains("broadcast"));
        } else {
          CHECK_FALSE(out.errors[r]);
        }
      }
    }
  }
}

// Note [Threads rounds]: a job's error fails its own rank's Work, and the
// rank whose job failed aborts the group, so the next collective of every
// rank fails naming it (the other rank's Work of the round itself succeeds:
// its own output was computed).
TEST_CASE("a failed job aborts the group; the next collectives name the failure", "[checked]") {
  const int world = 2;
  Outcomes out(world), next(world);
  run_ranks(world, [&](ProcessGroupPtr pg) {
    const int r = pg->rank();
    AllToAllOptions o;  // rank 0 expects 1 row from rank 1, which sends it 3
    o.input_split_sizes = r == 0 ? std::vector<int64_t>{1, 2} : std::vector<int64_t>{3, 1};
    o.output_split_sizes = r == 0 ? std::vector<int64_t>{1, 1} : std::vector<int64_t>{2, 1};
    out.record(r, [&] { pg->all_to_all_single(ops::ones({r == 0 ? 3 : 4, 2}), o)->synchronize(); });
    next.record(r, [&] { pg->barrier()->synchronize(); });
  });
  REQUIRE(out.errors[0]);
  CHECK_FALSE(out.errors[1]);
  for (int r = 0; r < world; ++r) {
    INFO("rank " << r);
    REQUIRE(next.errors[r]);
    REQUIRE_THROWS_AS(std::rethrow_exception(next.errors[r]), CommAbortedError);
    REQUIRE_THROWS_WITH(
        std::rethrow_exception(next.errors[r]),
        Contains("rank 0 failed in #0 all_to_all") && Contains("split sizes disagree"));
  }
}

// A rank that only polls is_completed() gets the watchdog too (polling
// drives the round without waiting; the deadline is the post's), and a Work
// waited on another thread than its launcher fails there with its error.
TEST_CASE("the watchdog fires for a poller; errors reach a waiter on another thread", "[checked]") {
  const int world = 2;
  const auto timeout = std::chrono::milliseconds(300);
  Outcomes out(world);
  run_ranks(
      world,
      [&](ProcessGroupPtr pg) {
        const int r = pg->rank();
        if (r == 1) {
          test::sleep_ms(900);  // late: past the group's timeout
          std::thread waiter(
              [&] { out.record(r, [&] { pg->all_reduce(ops::ones({8}))->synchronize(); }); });
          waiter.join();
          return;
        }
        out.record(r, [&] {
          WorkPtr w = pg->all_reduce(ops::ones({8}));
          const Clock::time_point give_up = Clock::now() + std::chrono::seconds(20);
          while (!w->is_completed() && Clock::now() < give_up)
            test::sleep_ms(1);
          w->synchronize();
        });
      },
      with_timeout(timeout));
  REQUIRE(out.errors[0]);
  REQUIRE_THROWS_AS(std::rethrow_exception(out.errors[0]), TimeoutError);
  REQUIRE_THROWS_WITH(std::rethrow_exception(out.errors[0]),
                      Contains("[comm::watchdog]") && Contains("missing: [1]"));
  CHECK(out.elapsed_ms[0] >= 0.9 * timeout.count());
  CHECK(out.elapsed_ms[0] < 5000.0);
  REQUIRE(out.errors[1]);
  REQUIRE_THROWS_AS(std::rethrow_exception(out.errors[1]), CommAbortedError);
  REQUIRE_THROWS_WITH(std::rethrow_exception(out.errors[1]), Contains("rank 0 timed out"));
}

// A rank may launch and return without waiting: its group's destructor runs
// what is left of the round (or a waiting peer does), so the peer completes
// normally; only the peer's next collective fails, naming the exit.
TEST_CASE("a rank that launches and returns without waiting holds nobody up", "[checked]") {
  const int world = 2;
  Outcomes out(world), next(world);
  std::vector<double> sums(world, 0.0);
  run_ranks(
      world,
      [&](ProcessGroupPtr pg) {
        const int r = pg->rank();
        WorkPtr w = pg->all_reduce(ops::full({1000}, r + 1.0));
        if (r == 1) return;  // never waits
        test::sleep_ms(50);  // rank 1 has likely returned by now
        out.record(r, [&] {
          w->synchronize();
          sums[r] = w->result().to_vector<float>()[999];
        });
        next.record(r, [&] { pg->all_reduce(ops::ones({8}))->synchronize(); });
      },
      with_timeout(std::chrono::seconds(20)));
  CHECK_FALSE(out.errors[0]);
  CHECK(sums[0] == 3.0);
  REQUIRE(next.errors[0]);
  REQUIRE_THROWS_WITH(std::rethrow_exception(next.errors[0]),
                      Contains("rank 1 returned from its rank function"));
  CHECK(next.elapsed_ms[0] < 5000.0);
}

}  // namespace
}  // namespace tandem
