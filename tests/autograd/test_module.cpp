// Module (autograd/module.h): parameter registry with dotted names, state
// dicts, dtype moves, train/eval, zero_grad, and the four kinds of hooks with
// their order, replacement semantics and removal. The modules are defined
// here from tandem ops so the suite does not depend on autograd/nn/.
#include <catch2/catch.hpp>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tandem/autograd/module.h"
#include "tandem/autograd/nn/attention.h"
#include "tandem/autograd/nn/dropout.h"
#include "tandem/autograd/nn/linear.h"
#include "tandem/autograd/nn/moe.h"
#include "tandem/autograd/nn/norm.h"
#include "tandem/autograd/ops.h"
#include "tandem/autograd/optim.h"
#include "tandem/runtime/error.h"
#include "tests/support/autograd_util.h"
#include "tests/support/test_util.h"

using namespace tandem;
using namespace tandem::test;
using Catch::Matchers::Contains;

namespace {

constexpr DType F64 = DType::F64;

// y = linear(tanh(linear(x, w1, b1)) * scale, w2); `scale` is an optional
// named argument. Appends "forward" to `log` when set.
struct TwoLinear final : Module {
  Tensor w1, b1, w2;
  std::vector<std::string>* log = nullptr;

  explicit TwoLinear(uint32_t seed, DType dtype = F64) : Module("TwoLinear") {
    w1 = random_tensor(Shape{4, 3}, dtype, seed);
    b1 = random_tensor(Shape{4}, dtype, seed + 1);
    w2 = random_tensor(Shape{2, 4}, dtype, seed + 2);
    register_parameter("w1", &w1);
    register_parameter("b1", &b1);
    register_parameter("w2", &w2);
  }

 protected:
  std::vector<Tensor> forward(Args& args) override {
    if (log) log->push_back("forward");
    Tensor h = tandem::tanh(linear(args.positional.at(0), w1, b1));
    if (Tensor* s = args.find("scale")) h = h * *s;
    return {linear(h, w2)};
  }
};

// gain * inner(x) + bias-free second child; buffers: a float and an integer.
struct Outer final : Module {
  Tensor gain, running, steps;
  std::shared_ptr<Module> block;  // a Block holding a TwoLinear
  std::shared_ptr<TwoLinear> head;

  struct Block final : Module {
    std::shared_ptr<TwoLinear> inner;
    Tensor shift;
    explicit Block(uint32_t seed) : Module("Block") {
      shift = random_tensor(Shape{2}, F64, seed);
      register_parameter("shift", &shift);
      inner = register_module("inner", std::make_shared<TwoLinear>(seed + 10));
    }

   protected:
    std::vector<Tensor> forward(Args& args) override {
      return {(*inner)(args.positional.at(0)) + shift};
    }
  };

  explicit Outer(uint32_t seed) : Module("Outer") {
    gain = random_tensor(Shape{2}, F64, seed);
    running = random_tensor(Shape{2}, F64, seed + 1);
    steps = ops::from_vector<int64_t>({3}, Shape{1});
    register_parameter("gain", &gain);
    register_buffer("running", &running);
    register_buffer("steps", &steps);
    block = register_module("block", std::make_shared<Block>(seed + 100));
    head = register_module("head", std::make_shared<TwoLinear>(seed + 200));
  }

 protected:
  std::vector<Tensor> forward(Args& args) override {
    Tensor y = block->call(Args{args.positional.at(0)})[0] * gain;
    // head maps 3 -> 2: feed it the input, add to y.
    return {y + (*head)(args.positional.at(0))};
  }
};

// The TwoLinear forward by hand on given parameter values (reference path).
Tensor two_linear_ref(const TwoLinear& m, const Tensor& x, const Tensor& scale = Tensor()) {
  Tensor h = tandem::tanh(linear(x, detach(m.w1), detach(m.b1)));
  if (scale.defined()) h = h * scale;
  return linear(h, detach(m.w2));
}

std::vector<std::string> names_of(const std::vector<std::pair<std::string, Tensor>>& named) {
  std::vector<std::string> out;
  for (const auto& [n, t] : named)
    out.push_back(n);
  return out;
}

std::map<std::string, Tensor> snapshot(const Module& m) {
  std::map<std::string, Tensor> out;
  for (const auto& [n, t] : m.state_dict())
    out[n] = ops::clone(t);
  return out;
}

bool same_state(const Module& m, const std::map<std::string, Tensor>& expect) {
  std::map<std::string, Tensor> now = m.state_dict();
  if (now.size() != expect.size()) return false;
  for (const auto& [n, t] : expect) {
    if (!now.count(n) || !ops::equal(now[n], t)) return false;
  }
  return true;
}

}  // namespace

TEST_CASE("module: parameters and named_parameters with nested children", "[module]") {
  auto m = std::make_shared<Outer>(1);
  std::vector<std::string> expect = {"gain",           "block.shift",    "block.inner.w1",
                                     "block.inner.b1", "block.inner.w2", "head.w1",
                                     "head.b1",        "head.w2"};
  CHECK(names_of(m->named_parameters()) == expect);
  std::vector<Tensor> params = m->parameters();
  REQUIRE(params.size() == expect.size());
  CHECK(params[0].is_alias_of(m->gain));
  CHECK(params[3].is_alias_of(m->block->named_parameters()[2].second));
  for (const Tensor& p : params) {
    CHECK(requires_grad(p));
    CHECK(is_leaf(p));
  }
  CHECK(names_of(m->named_buffers()) == std::vector<std::string>{"running", "steps"});
  CHECK(m->num_parameters() == 2 + 2 + (12 + 4 + 8) * 2);
  std::vector<std::string> modules;
  for (auto& [n, mod] : m->named_modules())
    modules.push_back(n + ":" + mod->type_name());
  CHECK(modules == std::vector<std::string>{":Outer", "block:Block", "block.inner:TwoLinear",
                                            "head:TwoLinear"});
  std::vector<std::string> children;
  for (auto& [n, mod] : m->named_children())
    children.push_back(n);
  CHECK(children == std::vector<std::string>{"block", "head"});
}

TEST_CASE("module: state_dict and load_state_dict", "[module]") {
  auto src = std::make_shared<Outer>(1);
  auto dst = std::make_shared<Outer>(2);
  std::map<std::string, Tensor> sd = src->state_dict();
  REQUIRE(sd.size() == 10);  // 8 parameters + 2 buffers
  for (const auto& [n, t] : sd)
    CHECK_FALSE(requires_grad(t));

  SECTION("round trip copies values in place") {
    void* w1_data = dst->head->w1.raw_data();
    dst->load_state_dict(sd);
    CHECK(same_state(*dst, snapshot(*src)));
    CHECK(dst->head->w1.raw_data() == w1_data);  // the member itself was updated
    CHECK_FALSE(dst->head->w1.is_alias_of(src->head->w1));
    CHECK(requires_grad(dst->head->w1));
    CHECK(is_leaf(dst->head->w1));
    // Same parameters, same output.
    Tensor x = random_tensor(Shape{5, 3}, F64, 9);
    CHECK(ops::equal((*dst)(x), (*src)(x)));
  }
  SECTION("strict: a missing key is an error and changes nothing") {
    auto before = snapshot(*dst);
    std::map<std::string, Tensor> missing = sd;
    missing.erase("block.inner.b1");
    CHECK_THROWS_AS(dst->load_state_dict(missing), Error);
    CHECK_THROWS_WITH(dst->load_state_dict(missing), Contains("block.inner.b1"));
    CHECK(same_state(*dst, before));
    // Non-strict loads what is there.
    dst->load_state_dict(missing, false);
    CHECK(ops::equal(dst->head->w1, src->head->w1));
    CHECK(ops::equal(dst->block->named_parameters()[2].second, before["block.inner.b1"]));
  }
  SECTION("strict: an unexpected key is an error and changes nothing") {
    auto before = snapshot(*dst);
    std::map<std::string, Tensor> extra = sd;
    extra["block.bogus"] = ops::zeros(Shape{2}, F64);
    CHECK_THROWS_WITH(dst->load_state_dict(extra),
                      Contains("unexpected key") && Contains("block.bogus"));
    CHECK(same_state(*dst, before));
    dst->load_state_dict(extra, false);
    CHECK(same_state(*dst, snapshot(*src)));
  }
  SECTION("a shape mismatch is an error and changes nothing, even for earlier keys") {
    auto before = snapshot(*dst);
    std::map<std::string, Tensor> bad = sd;
    // "head.w2" sorts after most keys: the valid ones before it must not be copied.
    bad["head.w2"] = ops::zeros(Shape{4, 2}, F64);
    CHECK_THROWS_WITH(dst->load_state_dict(bad),
                      Contains("head.w2") && Contains("[2,4]") && Contains("[4,2]"));
    CHECK(same_state(*dst, before));
    CHECK_THROWS(dst->load_state_dict(bad, false));
    CHECK(same_state(*dst, before));
  }
}

TEST_CASE("module: to(dtype) keeps requires_grad and converts floating tensors only", "[module]") {
  auto m = std::make_shared<Outer>(3);
  std::vector<double> before = values_of(m->head->w1);
  m->to(DType::F32);
  for (const auto& [n, p] : m->named_parameters()) {
    INFO(n);
    CHECK(p.dtype() == DType::F32);
    CHECK(requires_grad(p));
    CHECK(is_leaf(p));
  }
  CHECK(m->running.dtype() == DType::F32);
  CHECK_FALSE(requires_grad(m->running));
  CHECK(m->steps.dtype() == DType::I64);
  m->to(F64);
  CHECK(m->head->w1.dtype() == F64);
  CHECK(requires_grad(m->head->w1));
  // f64 -> f32 -> f64 rounds each value to f32.
  std::vector<double> expect;
  for (double v : before)
    expect.push_back(stored_value(DType::F32, v));
  CHECK(values_of(m->head->w1) == expect);
  // The converted parameters train: gradients arrive in the module's dtype.
  Tensor x = random_tensor(Shape{2, 3}, F64, 4);
  backward(sum((*m)(x)));
  for (const auto& [n, p] : m->named_parameters()) {
    INFO(n);
    REQUIRE(grad(p).defined());
    CHECK(grad(p).dtype() == F64);
  }
}

TEST_CASE("module: train/eval propagate and zero_grad clears every parameter", "[module]") {
  auto m = std::make_shared<Outer>(5);
  CHECK(m->is_training());
  m->eval();
  for (auto& [n, mod] : m->named_modules()) {
    INFO(n);
    CHECK_FALSE(mod->is_training());
  }
  m->block->train();
  CHECK(m->block->is_training());
  CHECK(m->block->named_modules()[1].second->is_training());
  CHECK_FALSE(m->head->is_training());
  CHECK_FALSE(m->is_training());
  m->train(true);
  for (auto& [n, mod] : m->named_modules())
    CHECK(mod->is_training());

  backward(sum((*m)(random_tensor(Shape{2, 3}, F64, 6))));
  for (const Tensor& p : m->parameters())
    REQUIRE(grad(p).defined());
  m->zero_grad();
  for (const auto& [n, p] : m->named_parameters()) {
    INFO(n);
    CHECK_FALSE(grad(p).defined());
  }
}

TEST_CASE("module: forward pre-hooks and forward hooks", "[module]") {
  auto m = std::make_shared<TwoLinear>(10);
  Tensor x = random_tensor(Shape{2, 3}, F64, 11);
  Tensor scale = random_tensor(Shape{4}, F64, 12);
  SECTION("a pre-hook replaces a positional argument") {
    std::vector<size_t> seen_sizes;
    m->register_forward_pre_hook([&](Module&, const Args& args) -> std::optional<Args> {
      seen_sizes.push_back(args.positional.size());
      Args replaced = args;
      replaced.positional[0] = args.positional[0] * 2.0;
      return replaced;
    });
    Tensor out = (*m)(x);
    CHECK(seen_sizes == std::vector<size_t>{1});
    CHECK(ops::equal(out, two_linear_ref(*m, x * 2.0)));
  }
  SECTION("a pre-hook finds and replaces a named argument") {
    Tensor replacement = random_tensor(Shape{4}, F64, 13);
    m->register_forward_pre_hook([&](Module&, const Args& args) -> std::optional<Args> {
      Args replaced = args;
      Tensor* s = replaced.find("scale");
      REQUIRE(s != nullptr);
      CHECK(ops::equal(*s, scale));
      *s = replacement;
      return replaced;
    });
    Args args{x};
    args.named["scale"] = scale;
    Tensor out = m->call(args)[0];
    CHECK(ops::equal(out, two_linear_ref(*m, x, replacement)));
    CHECK_FALSE(ops::equal(out, two_linear_ref(*m, x, scale)));
  }
  SECTION("a pre-hook returning nullopt leaves the arguments alone") {
    int calls = 0;
    m->register_forward_pre_hook([&](Module&, const Args&) -> std::optional<Args> {
      ++calls;
      return std::nullopt;
    });
    CHECK(ops::equal((*m)(x), two_linear_ref(*m, x)));
    CHECK(calls == 1);
  }
  SECTION("a forward hook sees args and outputs and replaces the output") {
    m->register_forward_hook(
        [&](Module& mod, const Args& args,
            const std::vector<Tensor>& out) -> std::optional<std::vector<Tensor>> {
          CHECK(&mod == m.get());
          CHECK(ops::equal(args.positional[0], x));
          CHECK(ops::equal(out[0], two_linear_ref(*m, x)));
          return std::vector<Tensor>{out[0] * 3.0};
        });
    CHECK(ops::equal((*m)(x), two_linear_ref(*m, x) * 3.0));
  }
  SECTION("several hooks run in registration order, each seeing the last one's result") {
    std::vector<std::string> log;
    m->log = &log;
    auto pre = [&](const char* name, double add) {
      return [&log, name, add](Module&, const Args& args) -> std::optional<Args> {
        log.push_back(name);
        Args r = args;
        r.positional[0] = args.positional[0] + add;
        return r;
      };
    };
    auto post = [&](const char* name, double mul) {
      return
          [&log, name, mul](Module&, const Args&,
                            const std::vector<Tensor>& out) -> std::optional<std::vector<Tensor>> {
            log.push_back(name);
            return std::vector<Tensor>{out[0] * mul + 1.0};
          };
    };
    m->register_forward_pre_hook(pre("pre1", 1.0));
    HookHandle pre2 = m->register_forward_pre_hook(pre("pre2", 10.0));
    m->register_forward_hook(post("post1", 2.0));
    HookHandle post2 = m->register_forward_hook(post("post2", 3.0));
    Tensor out = (*m)(x);
    CHECK(log == std::vector<std::string>{"pre1", "pre2", "forward", "post1", "post2"});
    // ((f(x + 1 + 10) * 2 + 1) * 3 + 1)
    Tensor expect = (two_linear_ref(*m, (x + 1.0) + 10.0) * 2.0 + 1.0) * 3.0 + 1.0;
    CHECK(ops::equal(out, expect));
    // Removing the second of each kind leaves the first.
    CHECK(pre2.active());
    pre2.remove();
    post2.remove();
    CHECK_FALSE(pre2.active());
    log.clear();
    out = (*m)(x);
    CHECK(log == std::vector<std::string>{"pre1", "forward", "post1"});
    CHECK(ops::equal(out, two_linear_ref(*m, x + 1.0) * 2.0 + 1.0));
  }
}

TEST_CASE("module: backward pre-hooks and backward hooks", "[module]") {
  auto m = std::make_shared<TwoLinear>(20);
  Tensor xv = random_tensor(Shape{3, 3}, F64, 21);
  Tensor up = random_tensor(Shape{3, 2}, F64, 22);  // d loss / d output
  // Reference gradients without hooks.
  Tensor x_ref = requires_grad_(ops::clone(xv));
  backward(sum((*m)(x_ref)*up));
  std::vector<Tensor> ref_params = grads_of(m->parameters());
  Tensor ref_x = ops::clone(grad(x_ref));
  m->zero_grad();

  SECTION("a full backward pre-hook sees the output gradient and can replace it") {
    std::vector<Tensor> seen;
    HookHandle h = m->register_full_backward_pre_hook(
        [&](Module&, const std::vector<Tensor>& g) -> std::optional<std::vector<Tensor>> {
          seen = g;
          return std::vector<Tensor>{g[0] * 2.0};
        });
    Tensor x = requires_grad_(ops::clone(xv));
    backward(sum((*m)(x)*up));
    REQUIRE(seen.size() == 1);
    CHECK(ops::equal(seen[0], up));
    // Doubling is exact: every gradient is exactly twice the reference.
    std::vector<Tensor> got = grads_of(m->parameters());
    for (size_t i = 0; i < got.size(); ++i)
      CHECK(ops::equal(got[i], ref_params[i] * 2.0));
    CHECK(ops::equal(grad(x), ref_x * 2.0));
    // Removed: gradients as without hooks.
    h.remove();
    CHECK_FALSE(h.active());
    m->zero_grad();
    seen.clear();
    backward(sum((*m)(ops::clone(xv)) * up));
    CHECK(seen.empty());
    CHECK(all_equal(grads_of(m->parameters()), ref_params));
  }
  SECTION("a backward hook sees the input gradients and can replace them") {
    std::vector<Tensor> seen;
    HookHandle h = m->register_full_backward_hook(
        [&](Module&, const std::vector<Tensor>& g) -> std::optional<std::vector<Tensor>> {
          seen = g;
          return std::vector<Tensor>{ops::zeros_like(g[0])};
        });
    Tensor x = requires_grad_(ops::clone(xv));
    backward(sum((*m)(x)*up));
    REQUIRE(seen.size() == 1);
    CHECK(ops::equal(seen[0], ref_x));
    CHECK(values_of(grad(x)) == std::vector<double>(9, 0.0));
    // Parameter gradients do not pass through the input hook.
    CHECK(all_equal(grads_of(m->parameters()), ref_params));
    h.remove();
    m->zero_grad();
    seen.clear();
    Tensor x2 = requires_grad_(ops::clone(xv));
    backward(sum((*m)(x2)*up));
    CHECK(seen.empty());
    CHECK(ops::equal(grad(x2), ref_x));
  }
  SECTION("hooks of every kind fire in order; removal detaches each") {
    std::vector<std::string> log;
    m->log = &log;
    HookHandle pre = m->register_forward_pre_hook([&](Module&, const Args&) -> std::optional<Args> {
      log.push_back("forward_pre");
      return std::nullopt;
    });
    HookHandle fwd = m->register_forward_hook(
        [&](Module&, const Args&,
            const std::vector<Tensor>&) -> std::optional<std::vector<Tensor>> {
          log.push_back("forward_hook");
          return std::nullopt;
        });
    HookHandle bpre = m->register_full_backward_pre_hook(
        [&](Module&, const std::vector<Tensor>&) -> std::optional<std::vector<Tensor>> {
          log.push_back("backward_pre");
          return std::nullopt;
        });
    HookHandle bwd = m->register_full_backward_hook(
        [&](Module&, const std::vector<Tensor>&) -> std::optional<std::vector<Tensor>> {
          log.push_back("backward_hook");
          return std::nullopt;
        });
    Tensor x = requires_grad_(ops::clone(xv));
    Tensor out = (*m)(x);
    // A tensor hook on the output runs before the module's backward pre-hook.
    register_hook(out, [&](const Tensor&) {
      log.push_back("output_tensor_hook");
      return Tensor();
    });
    register_hook(x, [&](const Tensor&) {
      log.push_back("input_tensor_hook");
      return Tensor();
    });
    log.push_back("backward()");
    backward(sum(out * up));
    CHECK(log == std::vector<std::string>{"forward_pre", "forward", "forward_hook", "backward()",
                                          "output_tensor_hook", "backward_pre", "backward_hook",
                                          "input_tensor_hook"});
    CHECK(all_equal(grads_of(m->parameters()), ref_params));
    CHECK(ops::equal(grad(x), ref_x));
    for (HookHandle* h : {&pre, &fwd, &bpre, &bwd}) {
      CHECK(h->active());
      h->remove();
      CHECK_FALSE(h->active());
    }
    log.clear();
    backward(sum((*m)(requires_grad_(ops::clone(xv))) * up));
    CHECK(log == std::vector<std::string>{"forward"});
  }
}

TEST_CASE("module: hooks on a child module fire inside the parent's call", "[module]") {
  auto m = std::make_shared<Outer>(30);
  std::vector<std::string> log;
  m->head->log = &log;
  m->register_forward_pre_hook([&](Module&, const Args&) -> std::optional<Args> {
    log.push_back("outer_pre");
    return std::nullopt;
  });
  m->head->register_forward_pre_hook([&](Module&, const Args&) -> std::optional<Args> {
    log.push_back("head_pre");
    return std::nullopt;
  });
  m->head->register_full_backward_pre_hook(
      [&](Module&, const std::vector<Tensor>&) -> std::optional<std::vector<Tensor>> {
        log.push_back("head_backward_pre");
        return std::nullopt;
      });
  m->register_full_backward_pre_hook(
      [&](Module&, const std::vector<Tensor>&) -> std::optional<std::vector<Tensor>> {
        log.push_back("outer_backward_pre");
        return std::nullopt;
      });
  backward(sum((*m)(random_tensor(Shape{2, 3}, F64, 31))));
  CHECK(log == std::vector<std::string>{"outer_pre", "head_pre", "forward", "outer_backward_pre",
                                        "head_backward_pre"});
}

TEST_CASE("options structs: named fields, PyTorch's defaults, nn::make", "[module]") {
  Generator gen(3);
  auto with_bias = nn::make<nn::Linear>({.in_features = 4, .out_features = 3}, gen);
  auto without = nn::make<nn::Linear>({.in_features = 4, .out_features = 3, .bias = false}, gen);
  CHECK(with_bias->bias().defined());
  CHECK(!without->bias().defined());
  CHECK(with_bias->named_parameters().size() == 2);
  CHECK(without->named_parameters().size() == 1);

  // n_kv_heads 0 means one KV head per query head, as in TransformerBlockConfig.
  auto attn = nn::make<nn::SelfAttention>({.d_model = 32, .n_heads = 4}, gen);
  CHECK(attn->n_kv_heads() == 4);
  CHECK(attn->core()->options().causal);
  auto grouped = nn::make<nn::SelfAttention>({.d_model = 32, .n_heads = 4, .n_kv_heads = 2}, gen);
  CHECK(grouped->k_proj()->out_features() == 16);
  CHECK_THROWS_WITH(nn::SelfAttention({.d_model = 32, .n_heads = 4, .n_kv_heads = 3}, gen),
                    Catch::Contains("n_heads divisible by n_kv_heads"));

  CHECK(nn::make<nn::RMSNorm>({.dim = 8})->eps() == 1e-6);
  CHECK(nn::make<nn::LayerNorm>({.dim = 8})->eps() == 1e-5);
  CHECK(nn::make<nn::Dropout>({}, gen)->p() == 0.5);

  // AdamW's defaults are torch.optim.AdamW's: one step from a zero state with
  // gradient g moves p by lr * g / (|g| + eps) after the decay p *= 1 - lr * wd.
  Tensor p = ops::full({1}, 2.0);
  set_requires_grad(p, true);
  optim::AdamW adam(std::vector<Tensor>{p}, {});
  CHECK(adam.lr() == 1e-3);
  set_grad(p, ops::full({1}, 0.5));
  adam.step();
  const double expected = 2.0 * (1 - 1e-3 * 0.01) - 1e-3 * 0.5 / (0.5 + 1e-8);
  CHECK(p.item_double() == Approx(expected).epsilon(1e-6));
}

namespace {

// y = x * w, through the differentiable op or (raw) the tensor layer's.
struct Scale final : Module {
  Tensor w;
  bool raw;
  explicit Scale(bool raw) : Module("Scale"), raw(raw) {
    w = ops::full({3}, 2.0);
    register_parameter("w", &w);
  }
  std::vector<Tensor> forward(Args& args) override {
    const Tensor& x = args.positional[0];
    return {raw ? ops::mul(x, w) : mul(x, w)};
  }
};

// Calls a correct child, then drops the gradient with a raw op.
struct DropsAfterChild final : Module {
  std::shared_ptr<Scale> child;
  DropsAfterChild() : Module("DropsAfterChild") {
    child = register_module("child", std::make_shared<Scale>(false));
  }
  std::vector<Tensor> forward(Args& args) override {
    return {ops::relu((*child)(args.positional[0]))};
  }
};

}  // namespace

TEST_CASE("Note [Dropped gradients]: a raw ops:: call in a forward is caught", "[module]") {
  const bool before = check_dropped_gradients();
  set_check_dropped_gradients(true);
  const Tensor x = ops::ones({3});  // requires no grad: the parameter does
  Scale raw(true), good(false);
  CHECK_THROWS_WITH(raw(x), Catch::Contains("[nn::Scale] expected forward to return a tensor "
                                            "that requires grad") &&
                                Catch::Contains("ops::"));
  CHECK(requires_grad(good(x)));
  {
    NoGradGuard no_grad;  // a deliberate stop is not checked
    CHECK_NOTHROW(raw(x));
  }
  // The parent's own input and parameters need no grad: its child's output does.
  DropsAfterChild parent;
  CHECK_THROWS_WITH(parent(x), Catch::Contains("[nn::DropsAfterChild]"));
  set_check_dropped_gradients(false);
  CHECK_NOTHROW(raw(x));
  set_check_dropped_gradients(before);
}

namespace {

// Returns its input `count` times.
struct Repeats final : Module {
  int count;
  explicit Repeats(int count) : Module("Repeats"), count(count) {}
  std::vector<Tensor> forward(Args& args) override {
    return std::vector<Tensor>(static_cast<size_t>(count), args.positional[0]);
  }
};

}  // namespace

TEST_CASE("Note [Module outputs]: one output by (*m)(x), several by name", "[module]") {
  Generator gen(4);
  auto moe = nn::make<nn::MoE>({.d_model = 4, .hidden = 8, .num_experts = 2, .top_k = 1}, gen);
  const Tensor x = ops::randn({3, 4}, gen);
  // (*m)(x) would drop the aux loss: an error that names the way out.
  CHECK_THROWS_WITH((*moe)(x), Catch::Contains("[nn::MoE] expected one output") &&
                                   Catch::Contains("nn::call_with_aux"));
  const nn::AuxOutput named = nn::call_with_aux(*moe, Args{x});
  CHECK(named.out.shape() == x.shape());
  REQUIRE(named.aux_loss.defined());
  CHECK(named.aux_loss.dim() == 0);
  // The same tensors as call()'s vector.
  const std::vector<Tensor> all = moe->call(Args{x});
  CHECK(ops::equal(all[0], named.out));
  CHECK(ops::equal(all[1], named.aux_loss));
  // A single-output module: no aux loss; three outputs fit neither form.
  auto linear = nn::make<nn::Linear>({.in_features = 4, .out_features = 2}, gen);
  CHECK(ops::equal(nn::call_with_aux(*linear, Args{x}).out, (*linear)(x)));
  CHECK_FALSE(nn::call_with_aux(*linear, Args{x}).aux_loss.defined());
  Repeats three(3);
  CHECK_THROWS_WITH(nn::call_with_aux(three, Args{x}),
                    Catch::Contains("[nn::Repeats] expected outputs {out} or {out, aux_loss}, "
                                    "got 3 tensors"));
  CHECK_THROWS_WITH(three(x), Catch::Contains("expected one output from (*module)(x), got 3"));
}
