// tandem-demo: the stand-in main job until the training demo exists. On the
// best device (or the one asked for) it builds seeded random tensors, runs a
// tiny classifier's forward pass (matmul, layer_norm, softmax, cross_entropy),
// prints what came out, the allocator's statistics and a short matmul timing.
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <exception>
#include <string>

#include "tandem/runtime/allocator.h"
#include "tandem/runtime/device.h"
#include "tandem/runtime/stream.h"
#include "tandem/tensor/ops.h"

namespace {

using tandem::Tensor;
namespace ops = tandem::ops;

// One line per tensor: shape, dtype, device and a summary of its values.
void describe(const std::string& name, const Tensor& t) {
  fmt::print("  {:<10} {:<14} {:<5} {:<7} min {:>9.4f}  max {:>9.4f}  mean {:>9.4f}\n", name,
             t.shape(), tandem::dtype_name(t.dtype()), t.device(), ops::amin(t).item_double(),
             ops::amax(t).item_double(), ops::mean(ops::to(t, tandem::DType::F32)).item_double());
}

void print_memory(tandem::Device device) {
  tandem::MemoryStats s = tandem::memory_stats(device);
  constexpr double kMiB = 1024.0 * 1024.0;
  fmt::print(
      "allocator {}: {:.2f} MiB allocated (peak {:.2f}), {:.2f} MiB reserved, "
      "{} allocations, {} from the system\n",
      device, s.allocated_bytes / kMiB, s.peak_allocated_bytes / kMiB, s.reserved_bytes / kMiB,
      s.num_allocs, s.num_system_allocs);
}

void run(tandem::Device device, int64_t n, int threads) {
  ops::set_num_threads(threads);
  fmt::print("device {} (GPUs: {}, built with CUDA: {})\n", device, tandem::cuda_device_count(),
             tandem::built_with_cuda() ? "yes" : "no");
  tandem::Generator gen(2024);
  const auto f32 = tandem::DType::F32;
  // A batch of n inputs of width n through one linear layer into n classes.
  Tensor x = ops::randn({n, n}, gen, f32, device);
  Tensor w = ops::normal({n, n}, 0.0, 1.0 / std::sqrt(static_cast<double>(n)), gen, f32, device);
  Tensor gamma = ops::ones({n}, f32, device);
  Tensor beta = ops::zeros({n}, f32, device);
  Tensor targets = ops::arange(0, static_cast<double>(n), 1, tandem::DType::I64, device);

  Tensor h = ops::matmul(x, w);
  Tensor logits = ops::layer_norm(h, gamma, beta).out;
  Tensor probs = ops::softmax(logits, -1);
  Tensor loss = ops::cross_entropy(logits, targets);

  fmt::print("\ntensors:\n");
  describe("x", x);
  describe("w", w);
  describe("h = x @ w", h);
  describe("layer_norm", logits);
  describe("softmax", probs);
  fmt::print("  row sums of softmax: min {:.6f} max {:.6f} (expected 1)\n",
             ops::amin(ops::sum(probs, {-1})).item_double(),
             ops::amax(ops::sum(probs, {-1})).item_double());
  // Random unit-variance logits: E[logsumexp] ~ log(N) + 1/2, E[target logit] = 0.
  fmt::print("  cross_entropy: {:.4f} (expected about log({}) + 1/2 = {:.4f})\n",
             loss.item_double(), n, std::log(static_cast<double>(n)) + 0.5);

  // Short timing: a few matmuls after a warm-up, then wait for the stream.
  const tandem::Stream& stream = tandem::current_stream(device);
  constexpr int kReps = 10;
  Tensor y = ops::matmul(x, w);
  stream.synchronize();
  auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < kReps; ++i)
    y = ops::matmul(x, w);
  stream.synchronize();
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  double flops = 2.0 * static_cast<double>(n) * n * n * kReps;
  fmt::print("\ntiming: {} matmuls of {}x{} in {:.2f} ms ({:.1f} GFLOP/s, BLAS threads: {})\n",
             kReps, n, n, seconds * 1e3, flops / seconds / 1e9, ops::num_threads());
  print_memory(device);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"tandem-demo: a tiny forward pass on the best device"};
  std::string device_name;
  int64_t size = 256;
  int threads = 1;
  app.add_option("--device", device_name, "cpu or cuda (default: cuda when a GPU is present)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--size", size, "batch, width and classes N (tensors are N x N)")
      ->check(CLI::Range(int64_t{2}, int64_t{8192}));
  app.add_option("--threads", threads, "CPU matmul (OpenBLAS) threads")->check(CLI::Range(1, 64));
  CLI11_PARSE(app, argc, argv);

  try {
    tandem::Device device =
        device_name.empty() ? tandem::default_device() : tandem::Device::parse(device_name);
    run(device, size, threads);
  } catch (const std::exception& e) {
    fmt::print(stderr, "tandem-demo: error: {}\n", e.what());
    return 1;
  }
  return 0;
}
