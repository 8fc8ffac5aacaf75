// Every collective of the threads backend against expected values computed
// from the rank with plain loops (DESIGN §9, nccl-tests style), for world
// sizes 1 to 8 and the dtypes where the collective means something.
//
// Rank functions run on the rank threads of run_ranks, where Catch2's
// assertions must not be used (they are not thread-safe): each rank records
// what it found in a Failures list, and the test thread asserts that it is
// empty. Test values are small integers, exact in f32, bf16 and i64, so that
// sums in any order are exact and results can be compared exactly.
#include <catch2/catch.hpp>

#include <atomic>
#include <random>
#include <string>
#include <vector>

#include "tandem/comm/threads/threads_backend.h"
#include "tandem/runtime/stream.h"
#include "tests/comm/collective_values.h"

namespace tandem {
namespace {

using namespace collective_test;

TEST_CASE("all_reduce: sum, avg, max, min", "[collectives]") {
  for (int world : kWorldSizes) {
    for (DType dtype : kDtypes) {
      DYNAMIC_SECTION(case_name(world, dtype)) {
        Failures failures;
        run_ranks(world, [&](ProcessGroupPtr pg) {
          const int rank = pg->rank();
          const Shape shape{3, 5};
          Tensor x = rank_tensor(rank, shape, dtype);
          for (RedOp op : ops_for(dtype)) {
            WorkPtr w = pg->all_reduce(x, reduce_with(op));
            w->synchronize();
            std::vector<double> expected(15);
            for (int64_t i = 0; i < 15; ++i) {
              expected[i] = reduce_value(op, world, dtype, [&](int r) { return value(r, i); });
            }
            expect_tensor(failures, rank, fmt::format("all_reduce {}", red_op_name(op)),
                          w->result(), {3, 5}, expected);
          }
          expect_tensor(failures, rank, "all_reduce input untouched", x, {3, 5},
                        rank_values(rank, 15));
        });
        REQUIRE_NO_FAILURES(failures);
      }
    }
  }
}

TEST_CASE("broadcast from every root", "[collectives]") {
  for (int world : kWorldSizes) {
    for (DType dtype : kDtypes) {
      DYNAMIC_SECTION(case_name(world, dtype)) {
        Failures failures;
        run_ranks(world, [&](ProcessGroupPtr pg) {
          const int rank = pg->rank();
          Tensor x = rank_tensor(rank, {2, 4}, dtype);
          for (int root = 0; root < world; ++root) {
            WorkPtr w = pg->broadcast(x, from_root(root));
            w->synchronize();
            expect_tensor(failures, rank, fmt::format("broadcast root {}", root), w->result(),
                          {2, 4}, rank_values(root, 8));
          }
        });
        REQUIRE_NO_FAILURES(failures);
      }
    }
  }
}

TEST_CASE("all_gather along dim 0 and dim 1", "[collectives]") {
  for (int world : kWorldSizes) {
    for (DType dtype : kDtypes) {
      DYNAMIC_SECTION(case_name(world, dtype)) {
        Failures failures;
        run_ranks(world, [&](ProcessGroupPtr pg) {
          const int rank = pg->rank();
          Tensor x = rank_tensor(rank, {2, 3}, dtype);  // x[i, j] = value(rank, 3 i + j)
          WorkPtr w0 = pg->all_gather(x, gather_along(0));
          WorkPtr w1 = pg->all_gather(x, gather_along(1));
          w0->synchronize();
          w1->synchronize();
          std::vector<double> e0, e1;
          for (int r = 0; r < world; ++r) {
            for (int i = 0; i < 2; ++i) {
              for (int j = 0; j < 3; ++j)
                e0.push_back(value(r, 3 * i + j));
            }
          }
          for (int i = 0; i < 2; ++i) {
            for (int r = 0; r < world; ++r) {
              for (int j = 0; j < 3; ++j)
                e1.push_back(value(r, 3 * i + j));
            }
          }
          expect_tensor(failures, rank, "all_gather dim 0", w0->result(), {2 * world, 3}, e0);
          expect_tensor(failures, rank, "all_gather dim 1", w1->result(), {2, 3 * world}, e1);
        });
        REQUIRE_NO_FAILURES(failures);
      }
    }
  }
}

TEST_CASE("reduce_scatter along dim 0 and dim 1", "[collectives]") {
  for (int world : kWorldSizes) {
    for (DType dtype : kDtypes) {
      DYNAMIC_SECTION(case_name(world, dtype)) {
        Failures failures;
        run_ranks(world, [&](ProcessGroupPtr pg) {
          const int rank = pg->rank();
          const int64_t w = world;
          for (RedOp op : ops_for(dtype)) {
            // dim 0: x (2 world, 3); rank keeps rows [2 rank, 2 rank + 2).
            Tensor x0 = rank_tensor(rank, {2 * w, 3}, dtype);
            WorkPtr w0 = pg->reduce_scatter(x0, scatter_along(0, op));
            // dim 1: x (2, 3 world); rank keeps columns [3 rank, 3 rank + 3).
            Tensor x1 = rank_tensor(rank, {2, 3 * w}, dtype);
            WorkPtr w1 = pg->reduce_scatter(x1, scatter_along(1, op));
            w0->synchronize();
            w1->synchronize();
            std::vector<double> e0, e1;
            for (int64_t i = 0; i < 2; ++i) {
              for (int64_t j = 0; j < 3; ++j) {
                e0.push_back(reduce_value(op, world, dtype,
                                          [&](int r) { return value(r, (2 * rank + i) * 3 + j); }));
                e1.push_back(reduce_value(
                    op, world, dtype, [&](int r) { return value(r, i * 3 * w + 3 * rank + j); }));
              }
            }
            expect_tensor(failures, rank, fmt::format("reduce_scatter dim 0 {}", red_op_name(op)),
                          w0->result(), {2, 3}, e0);
            expect_tensor(failures, rank, fmt::format("reduce_scatter dim 1 {}", red_op_name(op)),
                          w1->result(), {2, 3}, e1);
          }
        });
        REQUIRE_NO_FAILURES(failures);
      }
    }
  }
}

TEST_CASE("all_to_all_single with even splits", "[collectives]") {
  for (int world : kWorldSizes) {
    for (DType dtype : kDtypes) {
      DYNAMIC_SECTION(case_name(world, dtype)) {
        Failures failures;
        run_ranks(world, [&](ProcessGroupPtr pg) {
          const int rank = pg->rank();
          // Rows [2 p, 2 p + 2) go to rank p; rows from rank p land at [2 p, 2 p + 2).
          Tensor x = rank_tensor(rank, {2 * world, 3}, dtype);
          WorkPtr w = pg->all_to_all_single(x);
          w->synchronize();
          std::vector<double> expected;
          for (int p = 0; p < world; ++p) {
            for (int i = 0; i < 2; ++i) {
              for (int j = 0; j < 3; ++j)
                expected.push_back(value(p, (2 * rank + i) * 3 + j));
            }
          }
          expect_tensor(failures, rank, "all_to_all even", w->result(), {2 * world, 3}, expected);
        });
        REQUIRE_NO_FAILURES(failures);
      }
    }
  }
}

// rows[src][dst]: the rows rank src sends to rank dst, in [0, 3] (zeros
// included), drawn from `seed` in a fixed order, so every rank computes the
// same matrix without communicating.
std::vector<std::vector<int64_t>> split_matrix(int world, uint32_t seed) {
  std::mt19937 gen(seed);
  std::vector<std::vector<int64_t>> rows(static_cast<size_t>(world),
                                         std::vector<int64_t>(static_cast<size_t>(world)));
  for (auto& row : rows) {
    for (int64_t& n : row)
      n = static_cast<int64_t>(gen() % 4);
  }
  return rows;
}

TEST_CASE("all_to_all_single with uneven splits", "[collectives]") {
  for (int world : kWorldSizes) {
    for (DType dtype : kDtypes) {
      DYNAMIC_SECTION(case_name(world, dtype)) {
        Failures failures;
        run_ranks(world, [&](ProcessGroupPtr pg) {
          const int rank = pg->rank();
          for (uint32_t seed : {1u, 2u, 3u, 4u}) {
            auto rows = split_matrix(world, seed * 100 + static_cast<uint32_t>(world));
            AllToAllOptions o;
            int64_t in_rows = 0, out_rows = 0;
            for (int p = 0; p < world; ++p) {
              o.input_split_sizes.push_back(rows[rank][p]);
              o.output_split_sizes.push_back(rows[p][rank]);
              in_rows += rows[rank][p];
              out_rows += rows[p][rank];
            }
            Tensor x = rank_tensor(rank, {in_rows, 2}, dtype);
            WorkPtr w = pg->all_to_all_single(x, o);
            w->synchronize();
            std::vector<double> expected;
            for (int p = 0; p < world; ++p) {
              int64_t offset = 0;  // where rank p's rows for us start in its input
              for (int q = 0; q < rank; ++q)
                offset += rows[p][q];
              for (int64_t i = 0; i < rows[p][rank]; ++i) {
                for (int64_t j = 0; j < 2; ++j)
                  expected.push_back(value(p, (offset + i) * 2 + j));
              }
            }
            expect_tensor(failures, rank, fmt::format("all_to_all uneven seed {}", seed),
                          w->result(), {out_rows, 2}, expected);
          }
        });
        REQUIRE_NO_FAILURES(failures);
      }
    }
  }
}

TEST_CASE("send and recv around a ring", "[collectives]") {
  for (int world : kWorldSizes) {
    if (world == 1) continue;  // no peer
    for (DType dtype : kDtypes) {
      DYNAMIC_SECTION(case_name(world, dtype)) {
        Failures failures;
        run_ranks(world, [&](ProcessGroupPtr pg) {
          const int rank = pg->rank();
          const int next = (rank + 1) % world, prev = (rank + world - 1) % world;
          Tensor x = rank_tensor(rank, {4}, dtype);
          Tensor like = ops::zeros({4}, dtype);
          // A send completes when received and a group runs its calls in
          // order, so blocking sends all issued first would wait on each
          // other around the ring: even ranks send first, odd ranks receive
          // first (the usual ordering for blocking rings).
          WorkPtr sent, received;
          if (rank % 2 == 0) {
            sent = pg->send(x, with_peer(next));
            received = pg->recv(like, with_peer(prev));
          } else {
            received = pg->recv(like, with_peer(prev));
            sent = pg->send(x, with_peer(next));
          }
          received->synchronize();
          sent->synchronize();
          expect_tensor(failures, rank, "recv from prev", received->result(), {4},
                        rank_values(prev, 4));
        });
        REQUIRE_NO_FAILURES(failures);
      }
    }
  }
}

TEST_CASE("batch_isend_irecv in both ring directions", "[collectives]") {
  for (int world : kWorldSizes) {
    if (world == 1) continue;
    for (DType dtype : kDtypes) {
      DYNAMIC_SECTION(case_name(world, dtype)) {
        Failures failures;
        run_ranks(world, [&](ProcessGroupPtr pg) {
          const int rank = pg->rank();
          const int next = (rank + 1) % world, prev = (rank + world - 1) % world;
          // Tags keep the directions apart when next == prev (world 2).
          constexpr int kForward = 1, kBackward = 2;
          Tensor forward = rank_tensor(rank, {2, 3}, dtype);
          Tensor backward = rank_tensor(rank + 20, {5}, dtype);
          WorkPtr w = pg->batch_isend_irecv({
              P2POp::recv(ops::zeros({2, 3}, dtype), prev, kForward),
              P2POp::send(forward, next, kForward),
              P2POp::send(backward, prev, kBackward),
              P2POp::recv(ops::zeros({5}, dtype), next, kBackward),
          });
          w->synchronize();
          if (w->results().size() != 2) {
            failures.add(
                fmt::format("rank {}: expected 2 results, got {}", rank, w->results().size()));
            return;
          }
          expect_tensor(failures, rank, "batch recv from prev", w->results()[0], {2, 3},
                        rank_values(prev, 6));
          expect_tensor(failures, rank, "batch recv from next", w->results()[1], {5},
                        rank_values(next + 20, 5));
        });
        REQUIRE_NO_FAILURES(failures);
      }
    }
  }
}

TEST_CASE("barrier: nobody leaves before everyone arrived", "[collectives]") {
  for (int world : kWorldSizes) {
    DYNAMIC_SECTION("world " << world) {
      Failures failures;
      std::atomic<int> arrived{0};
      run_ranks(world, [&](ProcessGroupPtr pg) {
        test::sleep_ms(3 * pg->rank());  // late arrivals
        arrived.fetch_add(1);
        pg->barrier()->synchronize();
        int seen = arrived.load();
        if (seen != world) {
          failures.add(fmt::format("rank {}: left the barrier with {} of {} arrived", pg->rank(),
                                   seen, world));
        }
      });
      REQUIRE_NO_FAILURES(failures);
    }
  }
}

// A (rows x cols) layout of the world, rank = row * cols + col: row groups and
// column groups, split in the same order on every rank.
TEST_CASE("sub-groups of a 2-D layout", "[collectives]") {
  for (auto [rows, cols] : {std::pair{2, 3}, std::pair{3, 2}, std::pair{2, 2}}) {
    DYNAMIC_SECTION(rows << "x" << cols) {
      Failures failures;
      run_ranks(rows * cols, [&](ProcessGroupPtr pg) {
        const int rank = pg->rank();
        ProcessGroupPtr my_row, my_col;
        std::vector<int> row_members, col_members;
        for (int r = 0; r < rows; ++r) {
          std::vector<int> members;
          for (int c = 0; c < cols; ++c)
            members.push_back(r * cols + c);
          ProcessGroupPtr g = pg->split(members, fmt::format("row{}", r));
          if (g) {
            my_row = g;
            row_members = members;
          }
        }
        for (int c = 0; c < cols; ++c) {
          std::vector<int> members;
          for (int r = 0; r < rows; ++r)
            members.push_back(r * cols + c);
          ProcessGroupPtr g = pg->split(members, fmt::format("col{}", c));
          if (g) {
            my_col = g;
            col_members = members;
          }
        }
        if (!my_row || !my_col) {
          failures.add(fmt::format("rank {}: not a member of its row or column group", rank));
          return;
        }
        if (my_row->size() != cols || my_row->rank() != rank % cols ||
            my_row->world_ranks() != row_members || my_col->size() != rows ||
            my_col->rank() != rank / cols || my_col->world_ranks() != col_members) {
          failures.add(fmt::format("rank {}: wrong sub-group rank/size/members", rank));
          return;
        }
        // Interleave the groups: each keeps its own order.
        Tensor x = ops::full({3}, rank + 1);
        WorkPtr row_sum = my_row->all_reduce(x);
        WorkPtr col_max = my_col->all_reduce(x, reduce_with(RedOp::Max));
        WorkPtr world_sum = pg->all_reduce(x);
        for (const WorkPtr& w : {row_sum, col_max, world_sum})
          w->synchronize();
        double expected_row = 0, expected_col = 0;
        for (int m : row_members)
          expected_row += m + 1;
        for (int m : col_members)
          expected_col = std::max(expected_col, m + 1.0);
        double expected_world = (rows * cols) * (rows * cols + 1) / 2.0;
        expect_tensor(failures, rank, "row all_reduce", row_sum->result(), {3},
                      std::vector<double>(3, expected_row));
        expect_tensor(failures, rank, "column all_reduce max", col_max->result(), {3},
                      std::vector<double>(3, expected_col));
        expect_tensor(failures, rank, "world all_reduce", world_sum->result(), {3},
                      std::vector<double>(3, expected_world));
      });
      REQUIRE_NO_FAILURES(failures);
    }
  }
}

TEST_CASE("non-contiguous inputs", "[collectives]") {
  const int world = 3;
  Failures failures;
  run_ranks(world, [&](ProcessGroupPtr pg) {
    const int rank = pg->rank();
    Tensor x = rank_tensor(rank, {3, 4}, DType::F32);  // x[i, j] = value(rank, 4 i + j)
    Tensor t = ops::transpose(x, 0, 1);                // t[j, i] = x[i, j], (4, 3)
    if (t.is_contiguous()) failures.add("the transposed input is contiguous");
    WorkPtr reduced = pg->all_reduce(t);
    WorkPtr gathered = pg->all_gather(t, gather_along(0));
    Tensor rows = ops::transpose(rank_tensor(rank, {2, 3 * world}, DType::F32), 0, 1);
    WorkPtr exchanged = pg->all_to_all_single(rows);  // (3 world, 2), 3 rows per rank
    for (const WorkPtr& w : {reduced, gathered, exchanged})
      w->synchronize();
    std::vector<double> e_reduced, e_gathered, e_exchanged;
    for (int j = 0; j < 4; ++j) {
      for (int i = 0; i < 3; ++i) {
        e_reduced.push_back(reduce_value(RedOp::Sum, world, DType::F32,
                                         [&](int r) { return value(r, 4 * i + j); }));
      }
    }
    for (int r = 0; r < world; ++r) {
      for (int j = 0; j < 4; ++j) {
        for (int i = 0; i < 3; ++i)
          e_gathered.push_back(value(r, 4 * i + j));
      }
    }
    // rows[k, i] = value(rank, i * 3 world + k); rank p sends rows [3 q, 3 q + 3) to q.
    for (int p = 0; p < world; ++p) {
      for (int k = 3 * rank; k < 3 * rank + 3; ++k) {
        for (int i = 0; i < 2; ++i)
          e_exchanged.push_back(value(p, i * 3 * world + k));
      }
    }
    expect_tensor(failures, rank, "all_reduce of a transpose", reduced->result(), {4, 3},
                  e_reduced);
    expect_tensor(failures, rank, "all_gather of a transpose", gathered->result(), {4 * world, 3},
                  e_gathered);
    expect_tensor(failures, rank, "all_to_all of a transpose", exchanged->result(), {3 * world, 2},
                  e_exchanged);
  });
  REQUIRE_NO_FAILURES(failures);
}

}  // namespace
}  // namespace tandem
