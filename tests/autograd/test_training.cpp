// End-to-end training: the layers, autograd and optimizers together learn
// small synthetic tasks to a loss no untrained model reaches, and the whole
// run is a deterministic function of the seed (two runs, identical losses).
#include <catch2/catch.hpp>
#include <cmath>
#include <iostream>

#include "tandem/autograd/nn/linear.h"
#include "tandem/autograd/nn/transformer.h"
#include "tandem/autograd/ops.h"
#include "tandem/autograd/optim.h"
#include "tandem/runtime/device.h"
#include "tests/support/skip_cuda.h"

using namespace tandem;

namespace {

// Two-layer perceptron: Linear → tanh → Linear.
class MLP final : public Module {
 public:
  MLP(int64_t in, int64_t hidden, int64_t out, Generator& gen) : Module("MLP") {
    fc1_ = register_module("fc1",
                           nn::make<nn::Linear>({.in_features = in, .out_features = hidden}, gen));
    fc2_ = register_module("fc2",
                           nn::make<nn::Linear>({.in_features = hidden, .out_features = out}, gen));
  }

 protected:
  std::vector<Tensor> forward(Args& args) override {
    return {(*fc2_)(tanh((*fc1_)(args.positional[0])))};
  }

 private:
  std::shared_ptr<nn::Linear> fc1_, fc2_;
};

// XOR of the signs: class 1 when x0 * x1 > 0. Not linearly separable.
std::vector<double> train_xor(uint64_t seed, int steps) {
  Generator gen(seed);
  const int64_t n = 64;
  Tensor x = ops::uniform(Shape{n, 2}, -1.0, 1.0, gen);
  std::vector<float> xv = x.to_vector<float>();
  std::vector<int64_t> labels;
  for (int64_t i = 0; i < n; ++i)
    labels.push_back(xv[2 * i] * xv[2 * i + 1] > 0 ? 1 : 0);
  Tensor y = ops::from_vector(labels, Shape{n});

  auto model = std::make_shared<MLP>(2, 16, 2, gen);
  optim::AdamW opt(model->named_parameters(),
                   {.lr = 0.05, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.0});
  std::vector<double> losses;
  for (int s = 0; s < steps; ++s) {
    Tensor loss = cross_entropy((*model)(x), y);
    opt.zero_grad();
    backward(loss);
    opt.step();
    losses.push_back(loss.item_double());
  }
  return losses;
}

// Next-token prediction on sequences that repeat a random pattern of
// `period` tokens: after the first period every token is a copy of the one
// `period` positions back. Targets inside the first period are unpredictable
// and ignored. Returns the loss of every step.
std::vector<double> train_copy_lm(uint64_t seed, int steps, nn::TransformerLMConfig config) {
  const int64_t B = 8, S = 12, period = 4;
  Generator gen(seed);
  auto model = std::make_shared<nn::TransformerLM>(config, gen);
  optim::AdamW opt(model->named_parameters(),
                   {.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.99, .eps = 1e-8, .weight_decay = 0.0});
  optim::CosineSchedule schedule(
      {.base_lr = 1e-2, .warmup_steps = 20, .total_steps = steps, .min_lr = 1e-3});
  std::vector<double> losses;
  for (int s = 0; s < steps; ++s) {
    Tensor pattern = ops::to(
        ops::mul(ops::rand(Shape{B, period}, gen), static_cast<double>(config.vocab) - 1e-3),
        DType::I64);
    std::vector<int64_t> p = pattern.to_vector<int64_t>(), seq, target;
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t i = 0; i <= S; ++i) {
        const int64_t tok = p[b * period + i % period];
        if (i < S) seq.push_back(tok);
        if (i > 0) target.push_back(i < period ? -100 : tok);
      }
    }
    Tensor tokens = ops::from_vector(seq, Shape{B, S});
    Tensor targets = ops::from_vector(target, Shape{B, S});
    opt.set_lr(schedule.lr(s));
    std::vector<Tensor> out = model->call(Args{tokens});
    Tensor loss = nn::lm_loss(out[0], targets);
    if (out.size() > 1) loss = add(loss, mul(out[1], 0.01));
    opt.zero_grad();
    backward(loss);
    optim::clip_grad_norm(model->parameters(), 1.0);
    opt.step();
    losses.push_back(loss.item_double());
  }
  return losses;
}

double tail_mean(const std::vector<double>& v, size_t n) {
  double s = 0;
  for (size_t i = v.size() - n; i < v.size(); ++i)
    s += v[i];
  return s / static_cast<double>(n);
}

}  // namespace

TEST_CASE("a two-layer MLP learns XOR, deterministically", "[training]") {
  const std::vector<double> a = train_xor(3, 300);
  CHECK(a.front() > 0.6);  // chance level is ln 2 = 0.69
  CHECK(a.back() < 0.05);
  const std::vector<double> b = train_xor(3, 300);
  CHECK(a == b);
}

TEST_CASE("a tiny TransformerLM learns to continue a repeating pattern", "[training]") {
  nn::TransformerLMConfig config;
  config.vocab = 8;
  config.d_model = 32;
  config.layers = 2;
  config.heads = 4;
  config.kv_heads = 2;
  config.hidden = 64;
  config.max_seq = 12;
  const int steps = 120;
  SECTION("dense") {
    const std::vector<double> a = train_copy_lm(5, steps, config);
    // Untrained: about ln 8 = 2.08. Trained: the copies are predicted.
    CHECK(a.front() > 1.8);
    CHECK(tail_mean(a, 10) < 0.01);
    const std::vector<double> b = train_copy_lm(5, steps, config);
    CHECK(a == b);
  }
  SECTION("mixture of experts") {
    config.experts = 4;
    config.top_k = 2;
    config.hidden = 32;
    const std::vector<double> a = train_copy_lm(6, steps, config);
    // The loss includes 0.01 * aux (>= 0.01 * 2 layers * ~1).
    CHECK(a.front() > 1.8);
    CHECK(tail_mean(a, 10) < 0.05);
    const std::vector<double> b = train_copy_lm(6, steps, config);
    CHECK(a == b);
  }
}

// STYLE: the CPU is the reference. One MoE language-model training step on
// cuda:0 against the same step on the CPU: logits, loss, every parameter
// gradient and the parameters after AdamW.
TEST_CASE("a TransformerLM training step on CUDA matches the CPU", "[training]") {
  TANDEM_SKIP_WITHOUT_CUDA();
  nn::TransformerLMConfig config;
  config.vocab = 16;
  config.d_model = 32;
  config.layers = 2;
  config.heads = 4;
  config.kv_heads = 2;
  config.hidden = 32;
  config.max_seq = 8;
  config.experts = 4;
  config.top_k = 2;
  Generator g_cpu(21), g_gpu(21);
  auto cpu = std::make_shared<nn::TransformerLM>(config, g_cpu);
  auto gpu = std::make_shared<nn::TransformerLM>(config, g_gpu);
  const Device dev = Device::cuda(0);
  gpu->to(dev);
  optim::AdamW opt_cpu(cpu->named_parameters(), {.lr = 1e-2});
  optim::AdamW opt_gpu(gpu->named_parameters(), {.lr = 1e-2});

  Generator data(22);
  Tensor tokens = ops::to(ops::mul(ops::rand(Shape{2, 8}, data), 15.999), DType::I64);
  Tensor targets = ops::to(ops::mul(ops::rand(Shape{2, 8}, data), 15.999), DType::I64);
  auto step = [](nn::TransformerLM& m, optim::AdamW& opt, const Tensor& x, const Tensor& y) {
    std::vector<Tensor> out = m.call(Args{x});
    Tensor loss = add(nn::lm_loss(out[0], y), mul(out[1], 0.01));
    backward(loss);
    opt.step();
    return std::make_pair(out[0], loss);
  };
  auto [logits_cpu, loss_cpu] = step(*cpu, opt_cpu, tokens, targets);
  auto [logits_gpu, loss_gpu] = step(*gpu, opt_gpu, ops::to(tokens, dev), ops::to(targets, dev));
  CHECK(ops::allclose(ops::to(logits_gpu, Device::cpu()), logits_cpu, 1e-4, 1e-5));
  CHECK(loss_gpu.item_double() == Approx(loss_cpu.item_double()).epsilon(1e-5));
  auto pc = cpu->named_parameters(), pg = gpu->named_parameters();
  REQUIRE(pc.size() == pg.size());
  for (size_t i = 0; i < pc.size(); ++i) {
    INFO(pc[i].first);
    CHECK(pg[i].second.device() == dev);
    const Tensor gc = grad(pc[i].second), gg = grad(pg[i].second);
    REQUIRE(gc.defined() == gg.defined());
    if (gc.defined()) CHECK(ops::allclose(ops::to(gg, Device::cpu()), gc, 1e-3, 1e-5));
    CHECK(ops::allclose(ops::to(pg[i].second, Device::cpu()), pc[i].second, 1e-4, 1e-5));
  }
}
