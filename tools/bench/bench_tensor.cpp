// `tandem-bench tensor`: tandem's tensor ops against baselines measured in the
// same run (Note [Benchmark timing]).
//
//   matmul (CPU)   ops::matmul vs cblas_sgemm called directly, 1 and 2 threads
//   elementwise    add, mul, exp, gelu, softmax vs plain loops over std::vector
//   copy           ops::clone of a contiguous tensor vs std::memcpy (Note [Large
//                  copies]: tandem's large copies use `rep movsb` where that
//                  beats glibc's memcpy)
//   matmul (GPU)   ops::matmul vs cuBLAS called directly, f32 and bf16
//
// The tandem side allocates its output on every call, as user code does; the
// baselines write into a preallocated buffer. Before timing, each row checks
// that tandem and the baseline computed the same thing, so a fast wrong
// kernel reports an error instead of a good ratio.
#include <cblas.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <vector>

#include "tandem/runtime/allocator.h"
#include "tandem/runtime/device.h"
#include "tandem/runtime/stream.h"
#include "tandem/tensor/cpu/copy_bytes.h"
#include "tandem/tensor/ops.h"
#include "tools/bench/bench.h"
#include "tools/bench/cuda_baseline.h"

namespace tandem::bench {
namespace {

constexpr double kMatmulTarget = 0.95;
constexpr double kElementwiseTarget = 0.8;
constexpr int64_t kRowLength = 1024;  // softmax rows; elementwise tensors are (n / 1024, 1024)

// Runs `measure` for one row; any exception (a tandem op that fails, a result
// that disagrees with the baseline) becomes the row's error.
template <class F>
void add_row(Report& report, Row row, F&& measure) {
  if (!report.wants(row)) return;
  try {
    row.timing = measure();
  } catch (const std::exception& e) {
    row.error = e.what();
  }
  report.add(std::move(row));
}

void check_agrees(const std::string& mismatch, const std::string& what) {
  TANDEM_CHECK(mismatch.empty(), "[bench::tensor] {}: {}", what, mismatch);
}

double max_abs(const std::vector<float>& v) {
  double m = 0;
  for (float x : v)
    m = std::max(m, static_cast<double>(std::fabs(x)));
  return m;
}

// ---- CPU matmul ----

PairTiming time_cpu_matmul(int64_t n, int threads, const TimingConfig& config) {
  Generator gen(static_cast<uint64_t>(n));
  Tensor a = ops::randn({n, n}, gen);
  Tensor b = ops::randn({n, n}, gen);
  std::vector<float> a_host = a.to_vector<float>();
  std::vector<float> b_host = b.to_vector<float>();
  std::vector<float> c_host(static_cast<size_t>(n * n));
  // Both sides run on the same OpenBLAS; each is given the thread count its
  // own way.
  ops::set_num_threads(threads);
  openblas_set_num_threads(threads);

  const int m = static_cast<int>(n);
  Tensor out;
  Kernel tandem = [&](int reps) {
    for (int i = 0; i < reps; ++i)
      out = ops::matmul(a, b);
    current_stream(Device::cpu()).synchronize();
  };
  Kernel baseline = [&](int reps) {
    for (int i = 0; i < reps; ++i) {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, m, m, 1.0f, a_host.data(), m,
                  b_host.data(), m, 0.0f, c_host.data(), m);
    }
  };
  tandem(1);
  baseline(1);
  check_agrees(compare(out.to_vector<float>(), c_host, 1e-3, 1e-4 * max_abs(c_host)),
               fmt::format("matmul {}", n));
  return time_interleaved(tandem, baseline, config);
}

void bench_cpu_matmul(Report& report, const TimingConfig& config) {
  for (int threads : {1, 2}) {
    for (int64_t n : {256, 512, 1024, 2048}) {
      Row row;
      row.group = "matmul";
      row.name = fmt::format("f32 {}x{}x{}", n, n, n);
      row.device = "cpu";
      row.threads = threads;
      row.baseline = "cblas_sgemm (OpenBLAS)";
      row.flops = 2.0 * static_cast<double>(n) * n * n;
      row.target = kMatmulTarget;
      add_row(report, std::move(row), [&] { return time_cpu_matmul(n, threads, config); });
    }
  }
}

// ---- elementwise ----

void add_loop(const float* a, const float* b, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    out[i] = a[i] + b[i];
}

void mul_loop(const float* a, const float* b, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    out[i] = a[i] * b[i];
}

void exp_loop(const float* a, const float*, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    out[i] = std::exp(a[i]);
}

// The tanh approximation of GPT-2 and llm.c.
void gelu_loop(const float* a, const float*, float* out, int64_t n) {
  constexpr float kSqrt2OverPi = 0.7978845608028654f;
  for (int64_t i = 0; i < n; ++i) {
    float x = a[i];
    out[i] = 0.5f * x * (1.0f + std::tanh(kSqrt2OverPi * (x + 0.044715f * x * x * x)));
  }
}

// Per row: max, exp and sum, scale.
void softmax_loop(const float* a, const float*, float* out, int64_t n) {
  for (int64_t row = 0; row < n; row += kRowLength) {
    const float* x = a + row;
    float* y = out + row;
    float max = x[0];
    for (int64_t i = 1; i < kRowLength; ++i)
      max = std::max(max, x[i]);
    float sum = 0;
    for (int64_t i = 0; i < kRowLength; ++i) {
      y[i] = std::exp(x[i] - max);
      sum += y[i];
    }
    float scale = 1.0f / sum;
    for (int64_t i = 0; i < kRowLength; ++i)
      y[i] *= scale;
  }
}

struct ElementwiseOp {
  const char* name;
  Tensor (*tandem)(const Tensor& a, const Tensor& b);
  void (*baseline)(const float* a, const float* b, float* out, int64_t n);
};

const ElementwiseOp kElementwiseOps[] = {
    {"add", [](const Tensor& a, const Tensor& b) { return ops::add(a, b); }, add_loop},
    {"mul", [](const Tensor& a, const Tensor& b) { return ops::mul(a, b); }, mul_loop},
    {"exp", [](const Tensor& a, const Tensor&) { return ops::exp(a); }, exp_loop},
    {"gelu", [](const Tensor& a, const Tensor&) { return ops::gelu(a); }, gelu_loop},
    {"softmax", [](const Tensor& a, const Tensor&) { return ops::softmax(a, -1); }, softmax_loop},
};

PairTiming time_elementwise(const ElementwiseOp& op, int64_t n, const TimingConfig& config) {
  Generator gen(static_cast<uint64_t>(n));
  Tensor a = ops::randn({n / kRowLength, kRowLength}, gen);
  Tensor b = ops::randn({n / kRowLength, kRowLength}, gen);
  std::vector<float> a_host = a.to_vector<float>();
  std::vector<float> b_host = b.to_vector<float>();
  std::vector<float> out_host(static_cast<size_t>(n));
  ops::set_num_threads(1);

  Tensor out;
  Kernel tandem = [&](int reps) {
    for (int i = 0; i < reps; ++i)
      out = op.tandem(a, b);
    current_stream(Device::cpu()).synchronize();
  };
  Kernel baseline = [&](int reps) {
    for (int i = 0; i < reps; ++i)
      op.baseline(a_host.data(), b_host.data(), out_host.data(), n);
  };
  tandem(1);
  baseline(1);
  check_agrees(compare(out.to_vector<float>(), out_host, 1e-4, 1e-6),
               fmt::format("{} {}", op.name, n));
  return time_interleaved(tandem, baseline, config);
}

void bench_elementwise(Report& report, const TimingConfig& config) {
  for (int64_t n : {int64_t{1} << 20, int64_t{1} << 24}) {
    for (const ElementwiseOp& op : kElementwiseOps) {
      Row row;
      row.group = "elementwise";
      row.name = fmt::format("{} {}M f32", op.name, n >> 20);
      row.device = "cpu";
      row.threads = 1;
      row.baseline = "plain loop";
      row.target = kElementwiseTarget;
      add_row(report, std::move(row), [&] { return time_elementwise(op, n, config); });
    }
  }
}

// ---- copy ----

PairTiming time_copy(int64_t bytes, const TimingConfig& config) {
  const int64_t n = bytes / static_cast<int64_t>(sizeof(float));
  Generator gen(static_cast<uint64_t>(n));
  Tensor a = ops::randn({n}, gen);
  std::vector<float> out_host(static_cast<size_t>(n));
  ops::set_num_threads(1);

  Tensor out;
  Kernel tandem = [&](int reps) {
    for (int i = 0; i < reps; ++i)
      out = ops::clone(a);
  };
  Kernel baseline = [&](int reps) {
    for (int i = 0; i < reps; ++i)
      std::memcpy(out_host.data(), a.raw_data(), static_cast<size_t>(bytes));
  };
  tandem(1);
  baseline(1);
  check_agrees(compare(out.to_vector<float>(), out_host, 0.0, 0.0),
               fmt::format("copy {} bytes", bytes));
  return time_interleaved(tandem, baseline, config);
}

void bench_copy(Report& report, const TimingConfig& config) {
  report.set("copy_rep_movsb", cpu::copy_bytes_uses_rep_movsb(),
             fmt::format("large copies (>= {} KiB): {}", cpu::kRepMovsbFrom >> 10,
                         cpu::copy_bytes_uses_rep_movsb() ? "rep movsb" : "std::memcpy"));
  for (int64_t bytes : {int64_t{256} << 10, int64_t{4} << 20, int64_t{64} << 20}) {
    Row row;
    row.group = "copy";
    row.name = bytes >= (int64_t{1} << 20) ? fmt::format("{} MiB f32", bytes >> 20)
                                           : fmt::format("{} KiB f32", bytes >> 10);
    row.device = "cpu";
    row.threads = 1;
    row.baseline = "std::memcpy into one buffer";
    add_row(report, std::move(row), [&] { return time_copy(bytes, config); });
  }
}

// ---- GPU matmul ----

PairTiming time_gpu_matmul(Device device, int64_t n, DType dtype, const TimingConfig& config) {
  Generator gen(static_cast<uint64_t>(n));
  Tensor a = ops::randn({n, n}, gen, dtype, device);
  Tensor b = ops::randn({n, n}, gen, dtype, device);
  Tensor c = empty({n, n}, dtype, device);
  CublasGemm cublas(a, b, c);
  const Stream& stream = current_stream(device);

  Tensor out;
  Kernel tandem = [&](int reps) {
    for (int i = 0; i < reps; ++i)
      out = ops::matmul(a, b);
    stream.synchronize();
  };
  Kernel baseline = [&](int reps) { cublas.run(reps); };
  tandem(1);
  baseline(1);
  // Compared on the device, relative to the largest element: bf16 rounds each
  // output to 8 bits, and tandem may use TF32 for f32 where cuBLAS does not.
  Tensor want = ops::to(c, DType::F32);
  double scale = ops::amax(ops::abs(want)).item_double();
  double error = ops::amax(ops::abs(ops::sub(ops::to(out, DType::F32), want))).item_double();
  TANDEM_CHECK(error <= 1e-2 * scale,
               "[bench::tensor] {} matmul {}: expected tandem within 1e-2 * max|C| = {} of "
               "cuBLAS, got a difference of {}",
               dtype_name(dtype), n, 1e-2 * scale, error);
  return time_interleaved(tandem, baseline, config);
}

void bench_gpu_matmul(Report& report, const TimingConfig& config) {
  std::string skip;
  if (!cuda_available()) {
    skip = built_with_cuda() ? "no CUDA device on this machine" : "tandem was built without CUDA";
  } else {
    skip = cublas_unavailable_reason();
  }
  if (!skip.empty()) {
    report.set("gpu", {{"skipped", true}, {"reason", skip}},
               fmt::format("GPU rows skipped: {}", skip));
    return;
  }
  Device device = Device::cuda(0);
  report.set("gpu", {{"skipped", false}, {"device", device.str()}},
             fmt::format("GPU rows on {} against cuBLAS (default math mode)", device));
  for (DType dtype : {DType::F32, DType::BF16}) {
    for (int64_t n : {4096, 8192}) {
      Row row;
      row.group = "gpu-matmul";
      row.name = fmt::format("{} {}x{}x{}", dtype_name(dtype), n, n, n);
      row.device = device.str();
      row.threads = 0;
      row.baseline = dtype == DType::F32 ? "cublasSgemm" : "cublasGemmEx (bf16, f32 accumulate)";
      row.flops = 2.0 * static_cast<double>(n) * n * n;
      row.target = kMatmulTarget;
      add_row(report, std::move(row), [&] { return time_gpu_matmul(device, n, dtype, config); });
    }
  }
}

// ---- memory ----

void report_memory(Report& report) {
  std::vector<Device> devices = {Device::cpu()};
  if (cuda_available()) devices.push_back(Device::cuda(0));
  nlohmann::ordered_json memory = nlohmann::ordered_json::object();
  std::string text;
  for (Device device : devices) {
    MemoryStats s = memory_stats(device);
    memory[device.str()] = {
        {"allocated_bytes", s.allocated_bytes}, {"peak_allocated_bytes", s.peak_allocated_bytes},
        {"reserved_bytes", s.reserved_bytes},   {"peak_reserved_bytes", s.peak_reserved_bytes},
        {"num_allocs", s.num_allocs},           {"num_system_allocs", s.num_system_allocs},
    };
    constexpr double kMiB = 1024.0 * 1024.0;
    text += fmt::format(
        "\nallocator {}: {:.1f} MiB allocated now (peak {:.1f} MiB), {:.1f} MiB reserved "
        "(peak {:.1f} MiB); {} allocations, {} from the system",
        device, s.allocated_bytes / kMiB, s.peak_allocated_bytes / kMiB, s.reserved_bytes / kMiB,
        s.peak_reserved_bytes / kMiB, s.num_allocs, s.num_system_allocs);
  }
  report.set("memory", std::move(memory), text);
}

}  // namespace

int run_tensor(const Options& options) {
  TimingConfig config = timing_config(options);
  Report report("tensor", options, config);
  // A core type set in the environment wins over hold_blas_to_kernel_isa's
  // (Note [Baselines on the kernels' instructions]): say when the two differ.
  const char* wanted = openblas_core_for_kernels();
  const std::string core = openblas_get_corename();
  const bool like_for_like =
      wanted == nullptr ||
      std::equal(core.begin(), core.end(), wanted, wanted + std::strlen(wanted),
                 [](char a, char b) { return std::tolower(a) == std::tolower(b); });
  // Note [Idle BLAS threads]: how long OpenBLAS's idle workers poll.
  const char* timeout_env = std::getenv("OPENBLAS_THREAD_TIMEOUT");
  const std::string thread_timeout = timeout_env != nullptr ? timeout_env : "default";
  report.set(
      "openblas",
      {{"config", openblas_get_config()},
       {"core", core},
       {"core_matches_kernels", like_for_like},
       {"thread_timeout", thread_timeout}},
      fmt::format("baseline BLAS: {} (kernels: {}, OPENBLAS_THREAD_TIMEOUT={}); tandem's CPU "
                  "kernels: {}{}",
                  openblas_get_config(), core, thread_timeout, ops::cpu_vector_isa(),
                  like_for_like ? ""
                                : fmt::format("\nnote: OpenBLAS runs its {} kernels, not {} "
                                              "(OPENBLAS_CORETYPE from the environment): "
                                              "unset it for like-for-like matmul ratios",
                                              core, wanted)));
  bench_cpu_matmul(report, config);
  bench_elementwise(report, config);
  bench_copy(report, config);
  bench_gpu_matmul(report, config);
  report_memory(report);
  return report.finish();
}

}  // namespace tandem::bench
