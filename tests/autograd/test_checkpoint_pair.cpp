// Activation checkpointing (autograd/checkpoint.h) against the plain graph,
// bit for bit, with the thread-local recomputing flag; and the forward/backward
// worker pair (runtime/worker_pair.h): micro-batch i+1's forward overlapping
// micro-batch i's backward gives the sequential gradients bit for bit, errors
// on either side reach the caller without a hang, on_failure releases a
// blocked partner, and the pair is reusable after a failure.
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "tandem/autograd/call_data.h"
#include "tandem/autograd/checkpoint.h"
#include "tandem/autograd/engine.h"
#include "tandem/autograd/module.h"
#include "tandem/autograd/ops.h"
#include "tandem/runtime/error.h"
#include "tandem/runtime/worker_pair.h"
#include "tests/support/autograd_util.h"
#include "tests/support/test_util.h"

using namespace tandem;
using namespace tandem::test;
using Catch::Matchers::Contains;
using namespace std::chrono_literals;

namespace {

constexpr DType F32 = DType::F32;

// ---------------------------------------------------------------- checkpoint

struct BlockParams {
  Tensor w1, b1, w2;
  explicit BlockParams(uint32_t seed) {
    w1 = leaf(Shape{5, 4}, seed, F32);
    b1 = leaf(Shape{5}, seed + 1, F32);
    w2 = leaf(Shape{3, 5}, seed + 2, F32);
  }
  std::vector<Tensor> all() const { return {w1, b1, w2}; }
};

// Two inputs, two outputs; w1 is used twice so its gradient accumulates
// inside the block.
std::vector<Tensor> block(const BlockParams& p, const std::vector<Tensor>& in) {
  Tensor h = tandem::tanh(linear(in[0], p.w1, p.b1));
  Tensor h2 = h * in[1] + sigmoid(linear(in[0], p.w1));
  return {linear(h2, p.w2), h};
}

Tensor loss_of(const std::vector<Tensor>& outs, const Tensor& c) {
  return sum(outs[0] * outs[0]) + sum(outs[1] * c);
}

// Records is_recomputing() from a module forward hook.
struct Scale final : Module {
  Tensor s;
  explicit Scale(uint32_t seed) : Module("Scale") {
    s = random_tensor(Shape{3}, F32, seed, 0.5, 1.5);
    register_parameter("s", &s);
  }

 protected:
  std::vector<Tensor> forward(Args& args) override { return {args.positional.at(0) * s}; }
};

}  // namespace

TEST_CASE("checkpoint: same outputs and gradients as the plain graph", "[checkpoint]") {
  BlockParams p(1);
  Tensor xv = random_tensor(Shape{6, 4}, F32, 10);
  Tensor zv = random_tensor(Shape{6, 5}, F32, 11);
  Tensor c = random_tensor(Shape{6, 5}, F32, 12);

  Tensor x = requires_grad_(ops::clone(xv));
  Tensor z = requires_grad_(ops::clone(zv));
  std::vector<Tensor> ref_out = block(p, {x, z});
  Tensor ref_loss = loss_of(ref_out, c);
  backward(ref_loss);
  std::vector<Tensor> ref_grads = grads_of({x, z, p.w1, p.b1, p.w2});
  for (const Tensor& t : p.all())
    zero_grad(t);

  std::vector<bool> recomputing_log, grad_mode_log;
  Tensor xc = requires_grad_(ops::clone(xv));
  Tensor zc = requires_grad_(ops::clone(zv));
  std::vector<Tensor> out = checkpoint(
      [&](const std::vector<Tensor>& in) {
        recomputing_log.push_back(is_recomputing());
        grad_mode_log.push_back(grad_mode_enabled());
        return block(p, in);
      },
      {xc, zc});
  REQUIRE(out.size() == 2);
  CHECK(recomputing_log == std::vector<bool>{false});
  CHECK(grad_mode_log == std::vector<bool>{false});  // the forward records nothing inside
  CHECK(ops::equal(out[0], ref_out[0]));
  CHECK(ops::equal(out[1], ref_out[1]));
  CHECK(requires_grad(out[0]));
  CHECK(std::string(grad_fn(out[0])->name()) == "CheckpointBackward");
  Tensor loss = loss_of(out, c);
  CHECK(ops::equal(loss, ref_loss));
  backward(loss);
  CHECK(recomputing_log == std::vector<bool>{false, true});
  CHECK(grad_mode_log == std::vector<bool>{false, true});
  CHECK_FALSE(is_recomputing());
  std::vector<Tensor> got = grads_of({xc, zc, p.w1, p.b1, p.w2});
  const char* names[] = {"x", "z", "w1", "b1", "w2"};
  for (size_t i = 0; i < got.size(); ++i) {
    INFO(names[i]);
    REQUIRE(got[i].defined());
    CHECK(ops::equal(got[i], ref_grads[i]));
  }
}

TEST_CASE("checkpoint: is_recomputing is visible to module hooks in the re-run", "[checkpoint]") {
  auto m = std::make_shared<Scale>(20);
  std::vector<bool> hook_log;
  m->register_forward_hook(
      [&](Module&, const Args&, const std::vector<Tensor>&) -> std::optional<std::vector<Tensor>> {
        hook_log.push_back(is_recomputing());
        return std::nullopt;
      });
  Tensor x = leaf(Shape{2, 3}, 21, F32);
  // Outside a checkpoint the flag is off.
  (*m)(x);
  CHECK(hook_log == std::vector<bool>{false});
  hook_log.clear();
  std::vector<Tensor> out = checkpoint(
      [&](const std::vector<Tensor>& in) { return std::vector<Tensor>{(*m)(in[0])}; }, {x});
  CHECK(hook_log == std::vector<bool>{false});
  backward(sum(out[0]));
  CHECK(hook_log == std::vector<bool>{false, true});
  CHECK_FALSE(is_recomputing());
  // d sum(x * s) / ds = column sums of x; / dx = s.
  std::vector<double> xv = values_of(x), sv = values_of(m->s);
  std::vector<double> gs = {xv[0] + xv[3], xv[1] + xv[4], xv[2] + xv[5]};
  TANDEM_CHECK_CLOSE(values_of(grad(m->s)), gs, 1e-6, 1e-7);
  TANDEM_CHECK_CLOSE(values_of(grad(x)),
                     (std::vector<double>{sv[0], sv[1], sv[2], sv[0], sv[1], sv[2]}), 0, 0);
  // RecomputeGuard nests and restores.
  {
    RecomputeGuard outer;
    CHECK(is_recomputing());
    {
      RecomputeGuard inner;
      CHECK(is_recomputing());
    }
    CHECK(is_recomputing());
  }
  CHECK_FALSE(is_recomputing());
}

TEST_CASE("checkpoint: the re-run sees the per-call data its forward saw", "[checkpoint]") {
  // Note [Per-call data]: the backward runs outside the caller's scope, yet
  // the re-run must find what the forward found; scopes nest and unwind.
  static const int key = 0;
  auto value_in_scope = [] {
    auto v = find_call_data(&key);
    return v ? *std::static_pointer_cast<const int>(v) : -1;
  };
  std::vector<int> seen;
  Tensor x = leaf(Shape{2, 3}, 22, F32);
  std::vector<Tensor> out;
  {
    CallDataScope outer(&key, std::make_shared<const int>(1));
    CallDataScope inner(&key, std::make_shared<const int>(7));
    out = checkpoint(
        [&](const std::vector<Tensor>& in) {
          seen.push_back(value_in_scope());
          return std::vector<Tensor>{mul(in[0], in[0])};
        },
        {x});
  }
  CHECK(value_in_scope() == -1);
  {
    CallDataScope other(&key, std::make_shared<const int>(3));
    backward(sum(out[0]));
    CHECK(value_in_scope() == 3);  // the re-run's scopes are gone again
  }
  CHECK(seen == std::vector<int>{7, 7});
  CHECK(value_in_scope() == -1);
}

TEST_CASE("checkpoint: inputs without grad still give parameter gradients", "[checkpoint]") {
  BlockParams p(30);
  Tensor x = random_tensor(Shape{4, 4}, F32, 31);
  Tensor z = random_tensor(Shape{4, 5}, F32, 32);
  Tensor c = random_tensor(Shape{4, 5}, F32, 33);
  backward(loss_of(block(p, {x, z}), c));
  std::vector<Tensor> ref = grads_of(p.all());
  for (const Tensor& t : p.all())
    zero_grad(t);

  std::vector<Tensor> out =
      checkpoint([&](const std::vector<Tensor>& in) { return block(p, in); }, {x, z});
  REQUIRE(requires_grad(out[0]));  // recorded although no input requires grad
  backward(loss_of(out, c));
  CHECK(all_equal(grads_of(p.all()), ref));
  CHECK_FALSE(grad(x).defined());
  CHECK_FALSE(grad(z).defined());
}

// ---------------------------------------------------------------- worker pair

namespace {

// A small MLP with explicit parameter tensors; loss of micro-batch i.
struct Mlp {
  Tensor w1, b1, w2;
  std::vector<Tensor> xs, targets;
  explicit Mlp(int micro_batches) {
    w1 = leaf(Shape{16, 4}, 40, F32);
    b1 = leaf(Shape{16}, 41, F32);
    w2 = leaf(Shape{3, 16}, 42, F32);
    for (int i = 0; i < micro_batches; ++i) {
      xs.push_back(random_tensor(Shape{6, 4}, F32, 50 + i));
      std::vector<int64_t> t;
      for (int j = 0; j < 6; ++j)
        t.push_back((i + 2 * j) % 3);
      targets.push_back(long_tensor(t, Shape{6}));
    }
  }
  std::vector<Tensor> params() const { return {w1, b1, w2}; }
  Tensor loss(int i) const {
    return cross_entropy(linear(relu(linear(xs[i], w1, b1)), w2), targets[i]);
  }
  void zero() const {
    for (const Tensor& p : params())
      zero_grad(p);
  }
};

struct Sequential {
  std::vector<Tensor> grads;
  std::vector<double> losses;
};

Sequential run_sequential(const Mlp& mlp) {
  Sequential s;
  for (size_t i = 0; i < mlp.xs.size(); ++i) {
    Tensor loss = mlp.loss(static_cast<int>(i));
    s.losses.push_back(loss.item_double());
    backward(loss);
  }
  s.grads = grads_of(mlp.params());
  mlp.zero();
  return s;
}

struct PairRun {
  std::vector<Tensor> grads;
  std::vector<double> losses;
  std::vector<std::thread::id> fwd_threads, bwd_threads;
};

// Run k: forward of micro-batch k on the forward worker while the backward of
// micro-batch k-1 (its tape handed over as the loss tensor) runs on the
// backward worker.
PairRun run_overlapped(WorkerPair& pair, const Mlp& mlp) {
  const int n = static_cast<int>(mlp.xs.size());
  PairRun r;
  std::vector<Tensor> losses(static_cast<size_t>(n));  // sized up front: no reallocation
  std::mutex ids_mu;
  for (int k = 0; k <= n; ++k) {
    std::function<void()> fwd, bwd;
    if (k < n) {
      fwd = [&, k] {
        losses[k] = mlp.loss(k);
        std::lock_guard<std::mutex> lock(ids_mu);
        r.fwd_threads.push_back(std::this_thread::get_id());
      };
    }
    if (k > 0) {
      bwd = [&, k] {
        backward(losses[k - 1]);
        std::lock_guard<std::mutex> lock(ids_mu);
        r.bwd_threads.push_back(std::this_thread::get_id());
      };
    }
    pair.run(fwd, bwd);
  }
  for (const Tensor& l : losses)
    r.losses.push_back(l.item_double());
  r.grads = grads_of(mlp.params());
  mlp.zero();
  return r;
}

void check_matches(const PairRun& got, const Sequential& expect) {
  CHECK(got.losses == expect.losses);
  REQUIRE(got.grads.size() == expect.grads.size());
  for (size_t i = 0; i < got.grads.size(); ++i) {
    INFO("parameter " << i);
    REQUIRE(got.grads[i].defined());
    CHECK(ops::equal(got.grads[i], expect.grads[i]));
  }
}

struct Boom : std::runtime_error {
  using std::runtime_error::runtime_error;
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

TEST_CASE("pair: overlapped forward/backward gives the sequential gradients bit for bit",
          "[pair]") {
  Mlp mlp(4);
  Sequential expect = run_sequential(mlp);
  WorkerPair pair;
  PairRun got = run_overlapped(pair, mlp);
  check_matches(got, expect);
  // Each side on its own thread, never the caller's, the same one every run.
  REQUIRE(got.fwd_threads.size() == 4);
  REQUIRE(got.bwd_threads.size() == 4);
  const auto caller = std::this_thread::get_id();
  for (auto id : got.fwd_threads) {
    CHECK(id != caller);
    CHECK(id == got.fwd_threads[0]);
  }
  for (auto id : got.bwd_threads) {
    CHECK(id != caller);
    CHECK(id == got.bwd_threads[0]);
  }
  CHECK(got.fwd_threads[0] != got.bwd_threads[0]);
  // Running the schedule again on the same pair gives the same result.
  check_matches(run_overlapped(pair, mlp), expect);
}

TEST_CASE("pair: both sides run concurrently", "[pair]") {
  // A two-way rendezvous: it completes only if fwd and bwd are live together.
  std::mutex mu;
  std::condition_variable cv;
  bool fwd_here = false, bwd_here = false;
  bool fwd_saw = false, bwd_saw = false;
  auto t0 = std::chrono::steady_clock::now();
  run_pair(
      [&] {
        std::unique_lock<std::mutex> lock(mu);
        fwd_here = true;
        cv.notify_all();
        fwd_saw = cv.wait_for(lock, 10s, [&] { return bwd_here; });
      },
      [&] {
        std::unique_lock<std::mutex> lock(mu);
        bwd_here = true;
        cv.notify_all();
        bwd_saw = cv.wait_for(lock, 10s, [&] { return fwd_here; });
      });
  CHECK(fwd_saw);
  CHECK(bwd_saw);
  CHECK(seconds_since(t0) < 5.0);
}

TEST_CASE("pair: run_pair one-shot overlaps a recorded tape with the next forward", "[pair]") {
  Mlp mlp(2);
  Sequential expect = run_sequential(mlp);
  Tensor first = mlp.loss(0);  // recorded on this thread
  double first_value = first.item_double();
  Tensor second;
  std::thread::id fwd_id, bwd_id;
  run_pair(
      [&] {
        fwd_id = std::this_thread::get_id();
        second = mlp.loss(1);
      },
      [&] {
        bwd_id = std::this_thread::get_id();
        backward(first);
      });
  backward(second);
  CHECK(fwd_id != std::this_thread::get_id());
  CHECK(bwd_id != std::this_thread::get_id());
  CHECK(fwd_id != bwd_id);
  PairRun got;
  got.losses = {first_value, second.item_double()};
  got.grads = grads_of(mlp.params());
  check_matches(got, expect);
}

TEST_CASE("pair: an exception on either side reaches the caller without a hang", "[pair]") {
  WorkerPair pair;
  std::atomic<int> failures{0};
  auto on_failure = [&] { ++failures; };
  auto t0 = std::chrono::steady_clock::now();
  SECTION("from fwd") {
    std::atomic<bool> bwd_ran{false};
    REQUIRE_THROWS_AS(pair.run([] { throw Boom("fwd boom"); }, [&] { bwd_ran = true; }, on_failure),
                      Boom);
    CHECK(bwd_ran);
    CHECK(failures == 1);
  }
  SECTION("from bwd: an autograd error keeps its type and message") {
    Tensor x = leaf(Shape{3}, 60, F32);
    Tensor loss = sum(x * x);
    backward(loss);  // releases the tape: replaying it again throws
    std::atomic<bool> fwd_ran{false};
    try {
      pair.run([&] { fwd_ran = true; }, [&] { backward(loss); }, on_failure);
      FAIL("expected the backward worker's error on the caller");
    } catch (const Error& e) {
      CHECK_THAT(std::string(e.what()), Contains("released"));
    }
    CHECK(fwd_ran);
    CHECK(failures == 1);
  }
  SECTION("from both: one of them, on_failure once") {
    try {
      pair.run([] { throw Boom("fwd boom"); }, [] { throw Boom("bwd boom"); }, on_failure);
      FAIL("expected an exception");
    } catch (const Boom& e) {
      std::string what = e.what();
      CHECK((what == "fwd boom" || what == "bwd boom"));
    }
    CHECK(failures == 1);
  }
  SECTION("without on_failure") {
    REQUIRE_THROWS_WITH(pair.run({}, [] { throw Boom("lonely bwd"); }), Contains("lonely bwd"));
  }
  CHECK(seconds_since(t0) < 5.0);
  // The pair is reusable after a failure.
  Mlp mlp(4);
  Sequential expect = run_sequential(mlp);
  check_matches(run_overlapped(pair, mlp), expect);
  int before = failures;
  pair.run([] {}, [] {}, on_failure);
  CHECK(failures == before);  // not called without a failure
}

TEST_CASE("pair: on_failure releases a partner blocked on the failing side", "[pair]") {
  WorkerPair pair;
  std::mutex mu;
  std::condition_variable cv;
  bool released = false;
  std::atomic<int> failures{0};
  auto on_failure = [&] {
    ++failures;
    {
      std::lock_guard<std::mutex> lock(mu);
      released = true;
    }
    cv.notify_all();
  };
  // The partner waits for a signal only the failure path sends (bounded, so
  // a broken implementation fails the time check instead of hanging).
  bool partner_released = false;
  auto partner = [&] {
    std::unique_lock<std::mutex> lock(mu);
    partner_released = cv.wait_for(lock, 20s, [&] { return released; });
  };
  auto failing = [] {
    std::this_thread::sleep_for(20ms);  // let the partner block first
    throw Boom("side failed");
  };
  auto t0 = std::chrono::steady_clock::now();
  SECTION("fwd fails, bwd is blocked") {
    REQUIRE_THROWS_WITH(pair.run(failing, partner, on_failure), Contains("side failed"));
  }
  SECTION("bwd fails, fwd is blocked") {
    REQUIRE_THROWS_WITH(pair.run(partner, failing, on_failure), Contains("side failed"));
  }
  CHECK(seconds_since(t0) < 5.0);
  CHECK(partner_released);
  CHECK(failures == 1);
  // Reusable afterwards, with both sides live again.
  released = false;
  partner_released = false;
  std::atomic<bool> other{false};
  pair.run([&] { other = true; }, [&] {}, on_failure);
  CHECK(other);
  CHECK(failures == 1);
  Mlp mlp(4);
  Sequential expect = run_sequential(mlp);
  check_matches(run_overlapped(pair, mlp), expect);
}
