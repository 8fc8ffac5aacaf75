// The tape engine (Note [The tape], Note [Threading model]): gradient
// accumulation, released graphs and retain_graph, grad(), retain_grad, tensor
// hooks, grad mode, error messages, custom Functions, detach, integer outputs,
// diamonds, and a tape replayed on another thread while the recording thread
// records the next one.
#include <catch2/catch.hpp>

#include <any>
#include <atomic>
#include <chrono>
#include <cmath>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "tandem/autograd/engine.h"
#include "tandem/autograd/function.h"
#include "tandem/autograd/grad_ready.h"
#include "tandem/autograd/ops.h"
#include "tandem/runtime/error.h"
#include "tandem/runtime/stream.h"
#include "tests/support/autograd_util.h"
#include "tests/support/test_util.h"

using namespace tandem;
using namespace tandem::test;
using Catch::Matchers::Contains;

namespace {

constexpr DType F64 = DType::F64;

std::vector<double> scaled(const std::vector<double>& v, double s) {
  std::vector<double> out = v;
  for (double& x : out)
    x *= s;
  return out;
}

}  // namespace

TEST_CASE("engine: leaf gradients accumulate across backward calls", "[engine]") {
  Tensor x = leaf(Shape{2, 3}, 1);
  std::vector<double> xv = values_of(x);
  backward(sum(x * x * 3.0));  // d/dx = 6x
  TANDEM_REQUIRE_CLOSE(values_of(grad(x)), scaled(xv, 6.0), 1e-14, 0);
  backward(sum(x * 2.0));  // + 2
  std::vector<double> expect = scaled(xv, 6.0);
  for (double& v : expect)
    v += 2.0;
  TANDEM_CHECK_CLOSE(values_of(grad(x)), expect, 1e-14, 0);
  CHECK(is_leaf(x));
  zero_grad(x);
  CHECK_FALSE(grad(x).defined());
}

TEST_CASE("engine: a released graph cannot be replayed; retain_graph keeps it", "[engine]") {
  Tensor x = leaf(Shape{3}, 2);
  std::vector<double> xv = values_of(x);
  SECTION("without retain_graph the second backward names the released node") {
    Tensor loss = sum(tandem::exp(x));
    backward(loss);
    REQUIRE_THROWS_AS(backward(loss), Error);
    REQUIRE_THROWS_WITH(backward(loss), Contains("released") && Contains("SumBackward") &&
                                            Contains("retain_graph"));
  }
  SECTION("a released interior node is named too") {
    Tensor h = tandem::exp(x);
    backward(sum(h));
    // A fresh root on top of the released ExpBackward node.
    REQUIRE_THROWS_WITH(backward(sum(h * 2.0)), Contains("ExpBackward") && Contains("released"));
  }
  SECTION("with retain_graph the graph replays and gradients add up") {
    Tensor loss = sum(tandem::exp(x));
    backward(loss, BackwardOptions{true});
    backward(loss);
    std::vector<double> expect;
    for (double v : xv)
      expect.push_back(2.0 * std::exp(v));
    TANDEM_CHECK_CLOSE(values_of(grad(x)), expect, 1e-14, 0);
    // The last backward did not retain: a third one fails.
    CHECK_THROWS_WITH(backward(loss), Contains("released"));
  }
}

TEST_CASE("engine: gradients(outputs, inputs) returns gradients without touching .grad",
          "[engine]") {
  Tensor x = leaf(Shape{3}, 3);
  Tensor y = leaf(Shape{3}, 4);
  Tensor unused = leaf(Shape{2}, 5);
  std::vector<double> xv = values_of(x), yv = values_of(y);
  Tensor h = x * y;  // non-leaf input
  Tensor loss = sum(h * h);
  std::vector<Tensor> g = gradients({loss}, {x, y, h, unused});
  REQUIRE(g.size() == 4);
  std::vector<double> gx, gy, gh;
  for (size_t i = 0; i < 3; ++i) {
    double hv = xv[i] * yv[i];
    gh.push_back(2 * hv);
    gx.push_back(2 * hv * yv[i]);
    gy.push_back(2 * hv * xv[i]);
  }
  TANDEM_CHECK_CLOSE(values_of(g[0]), gx, 1e-14, 0);
  TANDEM_CHECK_CLOSE(values_of(g[1]), gy, 1e-14, 0);
  TANDEM_CHECK_CLOSE(values_of(g[2]), gh, 1e-14, 0);
  CHECK_FALSE(g[3].defined());  // unreachable
  CHECK_FALSE(grad(x).defined());
  CHECK_FALSE(grad(y).defined());
  CHECK_FALSE(grad(h).defined());
  // Explicit output gradients seed a non-scalar output.
  Tensor z = x * 3.0;
  std::vector<Tensor> gz = gradients({z}, {x}, {tensor_of({1, 2, 3}, Shape{3}, F64)});
  CHECK(values_of(gz[0]) == std::vector<double>{3, 6, 9});
  CHECK_FALSE(grad(x).defined());
  // An input that does not require grad is an error.
  Tensor plain = tensor_of({1, 2, 3}, Shape{3}, F64);
  CHECK_THROWS_WITH(gradients({sum(x * 2.0)}, {plain}), Contains("require grad"));
}

TEST_CASE("engine: retain_grad keeps a non-leaf gradient", "[engine]") {
  Tensor x = leaf(Shape{4}, 6);
  std::vector<double> xv = values_of(x);
  Tensor h = x * 2.0;
  Tensor other = x + 1.0;  // no retain_grad
  retain_grad(h);
  CHECK_FALSE(is_leaf(h));
  backward(sum(h * h + other));
  // d/dh sum(h^2) = 2h = 4x
  TANDEM_CHECK_CLOSE(values_of(grad(h)), scaled(xv, 4.0), 1e-14, 0);
  CHECK_FALSE(grad(other).defined());
  std::vector<double> gx = scaled(xv, 8.0);
  for (double& v : gx)
    v += 1.0;
  TANDEM_CHECK_CLOSE(values_of(grad(x)), gx, 1e-14, 0);
}

TEST_CASE("engine: tensor hooks on leaves and non-leaves", "[engine]") {
  Tensor x = leaf(Shape{3}, 7);
  std::vector<double> xv = values_of(x);
  Tensor seen;
  int calls = 0;
  SECTION("leaf hook sees the gradient and can replace it") {
    int h = register_hook(x, [&](const Tensor& g) {
      ++calls;
      seen = ops::clone(g);
      return ops::mul(g, 10.0);
    });
    backward(sum(x * x));  // gradient 2x
    REQUIRE(calls == 1);
    TANDEM_CHECK_CLOSE(values_of(seen), scaled(xv, 2.0), 1e-14, 0);
    TANDEM_CHECK_CLOSE(values_of(grad(x)), scaled(xv, 20.0), 1e-14, 0);
    remove_hook(x, h);
    zero_grad(x);
    backward(sum(x * x));
    CHECK(calls == 1);
    TANDEM_CHECK_CLOSE(values_of(grad(x)), scaled(xv, 2.0), 1e-14, 0);
  }
  SECTION("leaf hook returning nothing observes only") {
    register_hook(x, [&](const Tensor& g) {
      ++calls;
      seen = ops::clone(g);
      return Tensor();
    });
    backward(sum(x * 5.0));
    CHECK(calls == 1);
    CHECK(values_of(seen) == std::vector<double>(3, 5.0));
    CHECK(values_of(grad(x)) == std::vector<double>(3, 5.0));
  }
  SECTION("non-leaf hook sees the gradient and its replacement flows on") {
    Tensor h = x * 3.0;
    int handle = register_hook(h, [&](const Tensor& g) {
      ++calls;
      seen = ops::clone(g);
      return ops::full_like(g, 1.0);
    });
    backward(sum(h * h));  // d/dh = 2h = 6x, replaced by 1 -> dx = 3
    REQUIRE(calls == 1);
    TANDEM_CHECK_CLOSE(values_of(seen), scaled(xv, 6.0), 1e-14, 0);
    CHECK(values_of(grad(x)) == std::vector<double>(3, 3.0));
    // remove_hook stops it (on a new graph through the same node type).
    Tensor h2 = x * 3.0;
    int handle2 = register_hook(h2, [&](const Tensor& g) {
      ++calls;
      return ops::full_like(g, 1.0);
    });
    remove_hook(h2, handle2);
    remove_hook(h, handle);
    zero_grad(x);
    backward(sum(h2 * h2));
    CHECK(calls == 1);
    TANDEM_CHECK_CLOSE(values_of(grad(x)), scaled(xv, 18.0), 1e-14, 0);
  }
  SECTION("a replacement of the wrong shape is an error") {
    Tensor h = x * 3.0;
    register_hook(h, [](const Tensor&) { return ops::zeros(Shape{2}, F64); });
    CHECK_THROWS_WITH(backward(sum(h)), Contains("replacement gradient"));
  }
}

TEST_CASE("engine: NoGradGuard records nothing and restores grad mode", "[engine]") {
  Tensor x = leaf(Shape{3}, 8);
  REQUIRE(grad_mode_enabled());
  Tensor y;
  {
    NoGradGuard guard;
    CHECK_FALSE(grad_mode_enabled());
    y = tandem::exp(x) * x;
    {
      EnableGradGuard enable;
      CHECK(grad_mode_enabled());
      CHECK(requires_grad(x * 2.0));
    }
    CHECK_FALSE(grad_mode_enabled());
  }
  CHECK(grad_mode_enabled());
  CHECK_FALSE(requires_grad(y));
  CHECK(grad_fn(y) == nullptr);
  CHECK(is_leaf(y));
  CHECK_THROWS_WITH(backward(sum(y)), Contains("require grad"));
  // Grad mode is per thread: another thread still records.
  bool other_records = false;
  {
    NoGradGuard guard;
    std::thread t([&] { other_records = grad_mode_enabled(); });
    t.join();
  }
  CHECK(other_records);
}

TEST_CASE("engine: error messages", "[engine]") {
  SECTION("set_requires_grad on an integer tensor") {
    Tensor i = ops::arange(0, 4);
    CHECK_THROWS_AS(set_requires_grad(i, true), Error);
    CHECK_THROWS_WITH(set_requires_grad(i, true), Contains("floating") && Contains("i64"));
    CHECK_FALSE(requires_grad(i));
  }
  SECTION("backward on a tensor that does not require grad") {
    Tensor plain = tensor_of({1, 2}, Shape{2}, F64);
    CHECK_THROWS_AS(backward(sum(plain)), Error);
    CHECK_THROWS_WITH(backward(sum(plain)), Contains("require grad"));
  }
  SECTION("backward on a non-scalar without gradients") {
    Tensor x = leaf(Shape{3}, 9);
    CHECK_THROWS_WITH(backward(x * 2.0), Contains("one element"));
  }
  SECTION("set_requires_grad(false) on a non-leaf") {
    Tensor x = leaf(Shape{3}, 10);
    Tensor y = x * 2.0;
    CHECK_THROWS_WITH(set_requires_grad(y, false),
                      Contains("leaf") && Contains("MulScalarBackward"));
  }
}

namespace {

// out = x * y * scale with saved tensors and a ctx value; y gets no gradient.
struct ScaledProduct final : Function {
  std::atomic<int>* backward_calls = nullptr;
  std::vector<bool> seen_needs;
  double scale = 1.0;
  const char* name() const override { return "ScaledProductBackward"; }
  std::vector<Tensor> forward(FunctionCtx& ctx, const std::vector<Tensor>& in) override {
    ctx.save_for_backward({in[0], in[1]});
    seen_needs = ctx.needs_input_grad;
    return {ops::mul(ops::mul(in[0], in[1]), scale)};
  }
  std::vector<Tensor> backward(FunctionCtx& ctx, const std::vector<Tensor>& g) override {
    if (backward_calls) ++*backward_calls;
    const double s = scale;  // state of the Function itself
    const Tensor& y = ctx.saved_tensors()[1];
    CHECK_FALSE(requires_grad(ctx.saved_tensors()[0]));  // saved detached
    return {ops::mul(ops::mul(g[0], y), s), Tensor()};
  }
};

// Records the node even when no input requires grad; backward flips a flag.
struct Marker final : Function {
  bool* fired = nullptr;
  bool always = true;
  const char* name() const override { return "MarkerBackward"; }
  bool always_record() const override { return always; }
  std::vector<Tensor> forward(FunctionCtx&, const std::vector<Tensor>& in) override {
    return {ops::mul(in[0], 2.0)};
  }
  std::vector<Tensor> backward(FunctionCtx&, const std::vector<Tensor>& g) override {
    *fired = true;
    return {ops::mul(g[0], 2.0)};
  }
};

}  // namespace

TEST_CASE("engine: custom Function with saved tensors, its own state and a missing gradient",
          "[engine]") {
  Tensor x = leaf(Shape{3}, 11);
  Tensor y = leaf(Shape{3}, 12);
  std::vector<double> yv = values_of(y);
  std::atomic<int> calls{0};
  auto fn = std::make_shared<ScaledProduct>();
  fn->backward_calls = &calls;
  fn->scale = 0.5;
  Tensor out = Function::apply(fn, {x, y})[0];
  CHECK(fn->seen_needs == std::vector<bool>{true, true});
  REQUIRE(requires_grad(out));
  REQUIRE(grad_fn(out) != nullptr);
  CHECK(std::string(grad_fn(out)->name()) == "ScaledProductBackward");
  backward(sum(out));
  CHECK(calls == 1);
  TANDEM_CHECK_CLOSE(values_of(grad(x)), scaled(yv, 0.5), 1e-15, 0);
  CHECK_FALSE(grad(y).defined());
  // The node's saved state was released: a second backward names it.
  CHECK_THROWS_WITH(backward(sum(out)), Contains("ScaledProductBackward"));
  SECTION("needs_input_grad reflects which inputs require grad") {
    auto fn2 = std::make_shared<ScaledProduct>();
    Tensor plain = tensor_of({1, 2, 3}, Shape{3}, F64);
    Function::apply(fn2, {plain, y});
    CHECK(fn2->seen_needs == std::vector<bool>{false, true});
  }
}

TEST_CASE("engine: Function::apply with always_record", "[engine]") {
  Tensor plain = tensor_of({1, 2, 3}, Shape{3}, F64);
  bool fired = false;
  auto fn = std::make_shared<Marker>();
  fn->fired = &fired;
  Tensor out = Function::apply(fn, {plain})[0];
  REQUIRE(requires_grad(out));
  backward(sum(out));
  CHECK(fired);
  CHECK_FALSE(grad(plain).defined());
  SECTION("without always_record nothing is recorded") {
    auto f2 = std::make_shared<Marker>();
    f2->always = false;
    f2->fired = &fired;
    CHECK_FALSE(requires_grad(Function::apply(f2, {plain})[0]));
  }
  SECTION("under no_grad even always_record records nothing") {
    NoGradGuard guard;
    CHECK_FALSE(requires_grad(Function::apply(fn, {plain})[0]));
  }
}

TEST_CASE("engine: detach cuts the graph but shares storage", "[engine]") {
  Tensor x = leaf(Shape{3}, 13);
  std::vector<double> xv = values_of(x);
  Tensor d = detach(x);
  CHECK(d.is_alias_of(x));
  CHECK_FALSE(requires_grad(d));
  // sum(x^2 + detach(x) * x): gradient 2x + x = 3x.
  backward(sum(x * x + detach(x) * x));
  TANDEM_CHECK_CLOSE(values_of(grad(x)), scaled(xv, 3.0), 1e-14, 0);
}

TEST_CASE("engine: integer outputs do not require grad", "[engine]") {
  Tensor x = leaf(Shape{2, 3}, 14);
  CHECK_FALSE(requires_grad(argmax(x, 1)));
  CHECK_FALSE(requires_grad(argmin(x, 0)));
  CHECK_FALSE(requires_grad(topk(x, 2).second));
  CHECK_FALSE(requires_grad(tandem::max(x, 1).second));
  CHECK_FALSE(requires_grad(gt(x, x)));
  CHECK(requires_grad(tandem::max(x, 1).first));
}

TEST_CASE("engine: diamond graphs accumulate both paths", "[engine]") {
  Tensor x = leaf(Shape{4}, 15);
  std::vector<double> xv = values_of(x);
  // a = exp(x), b = x^2, loss = sum(a * b): d/dx = e^x x^2 + e^x 2x.
  Tensor a = tandem::exp(x);
  Tensor b = x * x;
  backward(sum(a * b));
  std::vector<double> expect;
  for (double v : xv)
    expect.push_back(std::exp(v) * v * v + std::exp(v) * 2 * v);
  TANDEM_CHECK_CLOSE(values_of(grad(x)), expect, 1e-13, 0);
  // A non-leaf used twice: h = 2x, loss = sum(h * tanh(h)).
  Tensor y = leaf(Shape{4}, 16);
  std::vector<double> yv = values_of(y);
  Tensor h = y * 2.0;
  backward(sum(h * tandem::tanh(h)));
  std::vector<double> gy;
  for (double v : yv) {
    double hv = 2 * v, t = std::tanh(hv);
    gy.push_back(2 * (t + hv * (1 - t * t)));
  }
  TANDEM_CHECK_CLOSE(values_of(grad(y)), gy, 1e-13, 0);
}

namespace {

// A small two-layer graph over shared parameters: a micro-batch's loss.
Tensor mlp_loss(const Tensor& w1, const Tensor& w2, const Tensor& x) {
  return sum(tandem::tanh(matmul(tandem::tanh(matmul(x, w1)), w2)));
}

}  // namespace

TEST_CASE("engine: a tape replayed on another thread while the first records the next",
          "[engine]") {
  using namespace std::chrono_literals;
  const int rounds = 8;
  Tensor w1 = leaf(Shape{6, 16}, 17, DType::F32);
  Tensor w2 = leaf(Shape{16, 3}, 18, DType::F32);
  std::vector<Tensor> xs;
  for (int i = 0; i < 2 * rounds; ++i) {
    xs.push_back(random_tensor(Shape{8, 6}, DType::F32, 100 + i));
  }

  // Reference: record and replay everything on this thread, in the same order.
  for (int i = 0; i < 2 * rounds; ++i)
    backward(mlp_loss(w1, w2, xs[i]));
  std::vector<Tensor> expect = grads_of({w1, w2});
  zero_grad(w1);
  zero_grad(w2);

  // Thread A records tape 2r and hands it to thread B, which replays it. A
  // hook in the middle of B's replay holds the replay until A has recorded
  // part of tape 2r+1, so recording and replay interleave for certain. A
  // replays its tape once B is done (same accumulation order as above).
  // Each thread has its own current stream (async under
  // TANDEM_CPU_STREAMS=async): hand-offs are ordered by events, as the worker
  // pair does (Note [Stream ordering]).
  std::mutex errors_mu;
  std::vector<std::string> errors;
  auto report = [&](const std::exception& e) {
    std::lock_guard<std::mutex> lock(errors_mu);
    errors.push_back(e.what());
  };
  std::atomic<int> met_a{0}, met_b{0};
  std::thread::id a_id, b_id;
  Event main_ready, a_done;
  main_ready.record(current_stream());
  std::thread a([&] {
    try {
      a_id = std::this_thread::get_id();
      main_ready.wait(current_stream());
      for (int r = 0; r < rounds; ++r) {
        auto b_replaying = std::make_shared<std::promise<void>>();
        auto a_recorded = std::make_shared<std::promise<void>>();
        std::shared_future<void> a_recorded_f = a_recorded->get_future().share();
        std::future<void> b_replaying_f = b_replaying->get_future();
        Tensor h1 = tandem::tanh(matmul(xs[2 * r], w1));
        register_hook(h1, [&met_b, b_replaying, a_recorded_f](const Tensor&) {
          b_replaying->set_value();
          if (a_recorded_f.wait_for(10s) == std::future_status::ready) ++met_b;
          return Tensor();
        });
        Tensor first = sum(tandem::tanh(matmul(h1, w2)));
        Event first_recorded, first_replayed;
        first_recorded.record(current_stream());
        std::thread b([&] {
          try {
            b_id = std::this_thread::get_id();
            first_recorded.wait(current_stream());
            backward(first);
            first_replayed.record(current_stream());
          } catch (const std::exception& e) {
            report(e);
          }
        });
        Tensor h2 = tandem::tanh(matmul(xs[2 * r + 1], w1));
        if (b_replaying_f.wait_for(10s) == std::future_status::ready) ++met_a;
        Tensor second = sum(tandem::tanh(matmul(h2, w2)));  // recorded mid-replay
        a_recorded->set_value();
        b.join();
        first_replayed.wait(current_stream());
        backward(second);
      }
      a_done.record(current_stream());
    } catch (const std::exception& e) {
      report(e);
    }
  });
  a.join();
  a_done.wait(current_stream());
  INFO((errors.empty() ? std::string() : errors.front()));
  REQUIRE(errors.empty());
  CHECK(met_a == rounds);
  CHECK(met_b == rounds);
  CHECK(a_id != b_id);
  CHECK(a_id != std::this_thread::get_id());
  std::vector<Tensor> got = grads_of({w1, w2});
  REQUIRE(got[0].defined());
  REQUIRE(got[1].defined());
  CHECK(ops::equal(got[0], expect[0]));
  CHECK(ops::equal(got[1], expect[1]));
}

TEST_CASE("engine: gradient-ready hooks fire as each leaf's gradient completes", "[engine]") {
  // y = tanh(x * w1) * w2; loss = sum(y * w1): w1 is used first and last.
  Tensor x = leaf(Shape{4}, 21), w1 = leaf(Shape{4}, 22), w2 = leaf(Shape{4}, 23);
  Tensor unused = leaf(Shape{2}, 24);
  std::vector<std::string> order;
  std::vector<bool> w1_done_at_w2;  // had w1 its gradient when w2's hook ran?
  Tensor w1_at_hook;
  int h1 = register_grad_ready_hook(w1, [&](const Tensor& p) {
    order.push_back("w1");
    w1_at_hook = ops::clone(grad(p));
  });
  int h2 = register_grad_ready_hook(w2, [&](const Tensor&) {
    order.push_back("w2");
    w1_done_at_w2.push_back(grad(w1).defined());
  });
  int hu = register_grad_ready_hook(unused, [&](const Tensor&) { order.push_back("unused"); });
  backward(sum(mul(mul(tanh(mul(x, w1)), w2), w1)));
  // w2 is complete once the last product's backward ran; w1 only once the
  // first op's did: w2 first, and while w2's hook ran w1 had no gradient.
  REQUIRE(order == std::vector<std::string>{"w2", "w1"});
  CHECK(w1_done_at_w2 == std::vector<bool>{false});
  // The hook saw w1's whole gradient (both uses), as the backward left it.
  CHECK(ops::equal(w1_at_hook, grad(w1)));
  Tensor w1_ref = detach(w1), x_ref = detach(x), w2_ref = detach(w2);
  set_requires_grad(w1_ref);
  backward(sum(mul(mul(tanh(mul(x_ref, w1_ref)), w2_ref), w1_ref)));
  CHECK(ops::equal(grad(w1), grad(w1_ref)));
  // gradients() leaves grad() alone and calls no ready hook; removed hooks
  // are not called.
  order.clear();
  gradients({sum(mul(w1, w2))}, {w1, w2});
  CHECK(order.empty());
  remove_grad_ready_hook(h1);
  remove_grad_ready_hook(h2);
  remove_grad_ready_hook(hu);
  backward(sum(mul(w1, w2)));
  CHECK(order.empty());
  CHECK_THROWS_WITH(register_grad_ready_hook(mul(w1, 2.0), [](const Tensor&) {}),
                    Contains("expected a leaf that requires grad (a parameter), got a tensor "
                             "computed by an op"));
}
