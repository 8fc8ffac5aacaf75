// The workloads of `tandem-bench autograd` (bench_autograd_workload.h): the
// op chain, the transformer block and the trial protocol that times them.
#include "tools/bench/bench_autograd_workload.h"

#include <time.h>

#include <algorithm>
#include <cmath>

#include "tandem/runtime/device.h"
#include "tandem/runtime/stream.h"

namespace tandem::bench::autograd_workload {

std::vector<float> workload_values(uint64_t salt, int64_t n, float scale, float offset) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    uint64_t z = (salt << 32) + static_cast<uint64_t>(i) + 0x9e3779b97f4a7c15ull;  // splitmix64
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    float u = static_cast<float>(z >> 40) * 0x1p-23f - 1.0f;
    v[static_cast<size_t>(i)] = u * scale + offset;
  }
  return v;
}

Tensor workload_tensor(uint64_t salt, const Shape& shape, float scale, float offset,
                       Device device) {
  Tensor t = ops::from_vector<float>(workload_values(salt, shape.numel(), scale, offset), shape);
  return device.is_cpu() ? t : ops::to(t, device);
}

namespace {

Tensor leaf(Tensor t) {
  set_requires_grad(t);
  return t;
}

double process_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// ---- the workloads ----

// The op chain through either API; `Api` is DifferentiableApi or RawApi.
template <class Api>
Tensor run_chain(const Tensor& x, const Tensor& c) {
  Tensor y = x;
  for (int i = 0; i < kChainOps; ++i)
    y = i % 3 == 0 ? Api::mul(y, 0.9) : i % 3 == 1 ? Api::add(y, c) : Api::tanh(y);
  return Api::sum(y);
}

struct DifferentiableApi {
  static Tensor mul(const Tensor& a, double s) { return tandem::mul(a, s); }
  static Tensor add(const Tensor& a, const Tensor& b) { return tandem::add(a, b); }
  static Tensor tanh(const Tensor& a) { return tandem::tanh(a); }
  static Tensor sum(const Tensor& a) { return tandem::sum(a); }
};

struct RawApi {
  static Tensor mul(const Tensor& a, double s) { return ops::mul(a, s); }
  static Tensor add(const Tensor& a, const Tensor& b) { return ops::add(a, b); }
  static Tensor tanh(const Tensor& a) { return ops::tanh(a); }
  static Tensor sum(const Tensor& a) { return ops::sum(a); }
};

}  // namespace

double seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

void synchronize_cpu() {
  current_stream(Device::cpu()).synchronize();
}

void synchronize(Device device) {
  current_stream(device).synchronize();
}

// ---- the op chain ----

ChainWorkload::ChainWorkload()
    : x(leaf(workload_tensor(11, {kChainNumel}, 1.0f))),
      c(workload_tensor(12, {kChainNumel}, 0.125f)) {}

void ChainWorkload::step(double& forward_s, double& backward_s) {
  auto t0 = Clock::now();
  Tensor loss = run_chain<DifferentiableApi>(x, c);
  synchronize_cpu();
  auto t1 = Clock::now();
  backward(loss);
  synchronize_cpu();
  auto t2 = Clock::now();
  zero_grad(x);
  forward_s += seconds(t0, t1);
  backward_s += seconds(t1, t2);
}

std::vector<float> ChainWorkload::check() {
  Tensor loss = run_chain<DifferentiableApi>(x, c);
  backward(loss);
  float g = ops::sum(grad(x)).item<float>();
  zero_grad(x);
  return {loss.item<float>(), g};
}

Tensor ChainWorkload::raw_forward() const {
  return run_chain<RawApi>(x, c);
}

// ---- the transformer block ----

BlockParams::BlockParams(Device device)
    : ln1_w(leaf(workload_tensor(1, {kModel}, 0.125f, 1.0f, device))),
      ln1_b(leaf(workload_tensor(2, {kModel}, 0.125f, 0.0f, device))),
      w_qkv(leaf(workload_tensor(3, {3 * kModel, kModel}, 1.0f / 16, 0.0f, device))),
      w_o(leaf(workload_tensor(4, {kModel, kModel}, 1.0f / 16, 0.0f, device))),
      ln2_w(leaf(workload_tensor(5, {kModel}, 0.125f, 1.0f, device))),
      ln2_b(leaf(workload_tensor(6, {kModel}, 0.125f, 0.0f, device))),
      w_gate(leaf(workload_tensor(7, {kHidden, kModel}, 1.0f / 16, 0.0f, device))),
      w_up(leaf(workload_tensor(8, {kHidden, kModel}, 1.0f / 16, 0.0f, device))),
      w_down(leaf(workload_tensor(9, {kModel, kHidden}, 1.0f / 32, 0.0f, device))) {}

std::vector<Tensor*> BlockParams::all() {
  return {&ln1_w, &ln1_b, &w_qkv, &w_o, &ln2_w, &ln2_b, &w_gate, &w_up, &w_down};
}

namespace {
// x (B, S, d) -> mean of the block's output. Pre-norm causal self-attention
// (fused qkv projection split nanoGPT-style, tandem's fused attention kernel)
// and a SwiGLU MLP (its silu(g) * u as one fused op), each with a residual;
// bias-free linears. The same math as LibTorch's block, which composes
// matmuls, a mask and softmax, and silu then mul.
Tensor block_loss(const BlockParams& p, const Tensor& x) {
  constexpr int64_t B = kBatch, S = kSeq, D = kModel, H = kHeads, Dh = kModel / kHeads;
  Tensor h = layer_norm(x, p.ln1_w, p.ln1_b, 1e-5);
  std::vector<Tensor> qkv = split(linear(h, p.w_qkv), D, -1);  // 3 x (B, S, D)
  auto heads = [&](const Tensor& t) { return transpose(reshape(t, {B, S, H, Dh}), 1, 2); };
  AttentionOptions causal;
  causal.causal = true;
  Tensor a = scaled_dot_product_attention(heads(qkv[0]), heads(qkv[1]), heads(qkv[2]), causal).out;
  Tensor y = add(x, linear(reshape(transpose(a, 1, 2), {B, S, D}), p.w_o));  // (B, S, D)
  h = layer_norm(y, p.ln2_w, p.ln2_b, 1e-5);
  Tensor m = linear(swiglu(linear(h, p.w_gate), linear(h, p.w_up)), p.w_down);  // silu(g) * u
  return mean(add(y, m));
}

}  // namespace

BlockWorkload::BlockWorkload(Device device)
    : device(device),
      p(device),
      x(workload_tensor(10, {kBatch, kSeq, kModel}, 1.0f, 0.0f, device)) {}

void BlockWorkload::step(double& forward_s, double& backward_s) {
  auto t0 = Clock::now();
  Tensor loss = block_loss(p, x);
  synchronize(device);
  auto t1 = Clock::now();
  backward(loss);
  synchronize(device);
  auto t2 = Clock::now();
  for (Tensor* t : p.all())
    zero_grad(*t);
  forward_s += seconds(t0, t1);
  backward_s += seconds(t1, t2);
}

std::vector<float> BlockWorkload::check() {
  Tensor loss = block_loss(p, x);
  backward(loss);
  std::vector<float> values = {loss.item<float>()};
  for (Tensor* t : p.all()) {
    Tensor g = grad(*t);
    values.push_back(static_cast<float>(std::sqrt(ops::sum(ops::mul(g, g)).item_double())));
    zero_grad(*t);
  }
  return values;
}

// ---- measuring ----

StepTimes measure(const Step& step, int trials, double min_trial_s) {
  double forward_s = 0, backward_s = 0;
  step(forward_s, backward_s);  // warm-up: page faults, allocator cache
  int reps = 1;
  for (;;) {
    auto start = Clock::now();
    for (int i = 0; i < reps; ++i)
      step(forward_s, backward_s);
    double t = seconds(start, Clock::now());
    if (t >= min_trial_s || reps >= (1 << 20)) break;
    reps = std::max(2 * reps, static_cast<int>(std::ceil(reps * 1.2 * min_trial_s / t)));
  }
  std::vector<double> total, forward, backward, cpu;
  for (int trial = 0; trial < trials; ++trial) {
    forward_s = backward_s = 0;
    double cpu_start = process_cpu_seconds();
    auto start = Clock::now();
    for (int i = 0; i < reps; ++i)
      step(forward_s, backward_s);
    total.push_back(seconds(start, Clock::now()) / reps);
    cpu.push_back((process_cpu_seconds() - cpu_start) / reps);
    forward.push_back(forward_s / reps);
    backward.push_back(backward_s / reps);
  }
  StepTimes s;
  s.total_s = median_of(total);
  s.forward_s = median_of(forward);
  s.backward_s = median_of(backward);
  s.cpu_s = median_of(cpu);
  s.reps = reps;
  return s;
}

}  // namespace tandem::bench::autograd_workload
