// tandem-libtorch-autograd: the LibTorch 1.13 side of `tandem-bench autograd`.
// It measures what tools/bench/bench_autograd.cpp measures for tandem — a chain
// of 1,000 tiny elementwise ops (forward+backward) and one transformer block
// step at 1 and 2 threads — with the same trial protocol, and prints one JSON
// object. tandem-bench runs it in a separate process, with and without
// OMP_WAIT_POLICY=passive, so LibTorch's OpenMP threads never share a process
// with tandem's (Note [LibTorch rounds] in bench_autograd.cpp).
//
// A comparison tool only: built when Debian's libtorch-dev is installed, never
// a dependency of tandem.
//
//   tandem-libtorch-autograd [--chain-trials N] [--block-trials N] [--min-trial-ms X]
#include <dlfcn.h>
#include <sys/resource.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <exception>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace {

using Clock = std::chrono::steady_clock;
using Json = nlohmann::ordered_json;
namespace F = torch::nn::functional;

// Note [Autograd benchmark workload] in bench_autograd_workload.h: these constants and
// workload_values() must match that file bit for bit.
constexpr int kChainOps = 1000;
constexpr int64_t kChainNumel = 4;
constexpr int64_t kBatch = 4, kSeq = 256, kModel = 256, kHeads = 4, kHidden = 1024;

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

torch::Tensor workload_tensor(uint64_t salt, std::vector<int64_t> shape, float scale,
                              float offset = 0.0f) {
  int64_t n = 1;
  for (int64_t s : shape)
    n *= s;
  std::vector<float> v = workload_values(salt, n, scale, offset);
  return torch::from_blob(v.data(), shape, torch::kFloat32).clone();
}

torch::Tensor leaf(torch::Tensor t) {
  return t.set_requires_grad(true);
}

double seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Process CPU time, reported next to wall time (see bench_autograd_workload.h).
double process_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// LibTorch sets its OpenMP threads; Debian's build reaches OpenBLAS (pthreads)
// for its GEMMs, whose thread count torch::set_num_threads does not touch, so
// it is set here too, found at run time to keep OpenBLAS out of the link line.
using SetBlasThreads = void (*)(int);
SetBlasThreads blas_thread_setter() {
  return reinterpret_cast<SetBlasThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
}

void set_threads(int n) {
  torch::set_num_threads(n);
  if (SetBlasThreads set = blas_thread_setter()) set(n);
}

// ---- the workloads (the same as bench_autograd_workload.cpp's) ----

struct ChainWorkload {
  torch::Tensor x = leaf(workload_tensor(11, {kChainNumel}, 1.0f));
  torch::Tensor c = workload_tensor(12, {kChainNumel}, 0.125f);

  torch::Tensor forward() const {
    torch::Tensor y = x;
    for (int i = 0; i < kChainOps; ++i) {
      switch (i % 3) {
        case 0:
          y = y * 0.9;
          break;
        case 1:
          y = y + c;
          break;
        default:
          y = torch::tanh(y);
      }
    }
    return y.sum();
  }

  void step(double& forward_s, double& backward_s) {
    auto t0 = Clock::now();
    torch::Tensor loss = forward();
    auto t1 = Clock::now();
    loss.backward();
    auto t2 = Clock::now();
    x.mutable_grad() = torch::Tensor();  // set to none, as tandem's zero_grad
    forward_s += seconds(t0, t1);
    backward_s += seconds(t1, t2);
  }

  // (chain output, sum of x's gradient)
  std::vector<float> check() {
    torch::Tensor loss = forward();
    loss.backward();
    float g = x.grad().sum().item<float>();
    x.mutable_grad() = torch::Tensor();
    return {loss.item<float>(), g};
  }
};

struct BlockWorkload {
  torch::Tensor ln1_w = leaf(workload_tensor(1, {kModel}, 0.125f, 1.0f));
  torch::Tensor ln1_b = leaf(workload_tensor(2, {kModel}, 0.125f));
  torch::Tensor w_qkv = leaf(workload_tensor(3, {3 * kModel, kModel}, 1.0f / 16));
  torch::Tensor w_o = leaf(workload_tensor(4, {kModel, kModel}, 1.0f / 16));
  torch::Tensor ln2_w = leaf(workload_tensor(5, {kModel}, 0.125f, 1.0f));
  torch::Tensor ln2_b = leaf(workload_tensor(6, {kModel}, 0.125f));
  torch::Tensor w_gate = leaf(workload_tensor(7, {kHidden, kModel}, 1.0f / 16));
  torch::Tensor w_up = leaf(workload_tensor(8, {kHidden, kModel}, 1.0f / 16));
  torch::Tensor w_down = leaf(workload_tensor(9, {kModel, kHidden}, 1.0f / 32));
  torch::Tensor x = workload_tensor(10, {kBatch, kSeq, kModel}, 1.0f);
  // Above the diagonal: keys after the query, masked out.
  torch::Tensor future = torch::ones({kSeq, kSeq}, torch::kBool).triu(1);

  std::vector<torch::Tensor*> params() {
    return {&ln1_w, &ln1_b, &w_qkv, &w_o, &ln2_w, &ln2_b, &w_gate, &w_up, &w_down};
  }

  // LibTorch 1.13 has no fused attention on the CPU: scores, mask, softmax.
  torch::Tensor loss() const {
    constexpr int64_t B = kBatch, S = kSeq, D = kModel, H = kHeads, Dh = kModel / kHeads;
    auto norm = [](const torch::Tensor& t, const torch::Tensor& w, const torch::Tensor& b) {
      return F::layer_norm(t, F::LayerNormFuncOptions({D}).weight(w).bias(b).eps(1e-5));
    };
    torch::Tensor h = norm(x, ln1_w, ln1_b);
    std::vector<torch::Tensor> qkv = F::linear(h, w_qkv).split(D, -1);
    auto heads = [&](const torch::Tensor& t) { return t.view({B, S, H, Dh}).transpose(1, 2); };
    torch::Tensor q = heads(qkv[0]), k = heads(qkv[1]), v = heads(qkv[2]);
    torch::Tensor scores = torch::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(Dh));
    scores = scores.masked_fill(future, -std::numeric_limits<float>::infinity());
    torch::Tensor a = torch::matmul(torch::softmax(scores, -1), v);
    torch::Tensor y = x + F::linear(a.transpose(1, 2).reshape({B, S, D}), w_o);
    h = norm(y, ln2_w, ln2_b);
    torch::Tensor m = F::linear(F::silu(F::linear(h, w_gate)) * F::linear(h, w_up), w_down);
    return (y + m).mean();
  }

  void step(double& forward_s, double& backward_s) {
    auto t0 = Clock::now();
    torch::Tensor l = loss();
    auto t1 = Clock::now();
    l.backward();
    auto t2 = Clock::now();
    for (torch::Tensor* p : params())
      p->mutable_grad() = torch::Tensor();
    forward_s += seconds(t0, t1);
    backward_s += seconds(t1, t2);
  }

  // (loss, L2 norm of each parameter's gradient)
  std::vector<float> check() {
    torch::Tensor l = loss();
    l.backward();
    std::vector<float> values = {l.item<float>()};
    for (torch::Tensor* p : params()) {
      values.push_back(p->grad().to(torch::kFloat64).norm().item<float>());
      p->mutable_grad() = torch::Tensor();
    }
    return values;
  }
};

// ---- measuring: the protocol of bench_autograd_workload.cpp's measure() ----

using Step = std::function<void(double& forward_s, double& backward_s)>;

Json measure(const Step& step, int trials, double min_trial_s) {
  double forward_s = 0, backward_s = 0;
  step(forward_s, backward_s);  // warm-up
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
  return {{"median_ms", median_of(total) * 1e3},
          {"forward_median_ms", median_of(forward) * 1e3},
          {"backward_median_ms", median_of(backward) * 1e3},
          {"cpu_median_ms", median_of(cpu) * 1e3},
          {"min_ms", *std::min_element(total.begin(), total.end()) * 1e3},
          {"reps", reps},
          {"trials", trials}};
}

struct Args {
  int chain_trials = 11;
  int block_trials = 7;
  double min_trial_s = 0.02;
};

Args parse_args(int argc, char** argv) {
  Args args;
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    if (i + 1 >= argc) throw std::invalid_argument("expected a value after " + flag);
    std::string value = argv[++i];
    if (flag == "--chain-trials") {
      args.chain_trials = std::stoi(value);
    } else if (flag == "--block-trials") {
      args.block_trials = std::stoi(value);
    } else if (flag == "--min-trial-ms") {
      args.min_trial_s = std::stod(value) * 1e-3;
    } else {
      throw std::invalid_argument("unknown option " + flag);
    }
  }
  if (args.chain_trials < 1 || args.block_trials < 1 || !(args.min_trial_s > 0)) {
    throw std::invalid_argument("expected positive trial counts and --min-trial-ms");
  }
  return args;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Args args = parse_args(argc, argv);
    const char* policy = std::getenv("OMP_WAIT_POLICY");
    Json out = {
        {"program", "tandem-libtorch-autograd"},
        {"torch_version", TORCH_VERSION},
        {"omp_wait_policy", policy != nullptr ? policy : "unset"},
        {"blas_threads", blas_thread_setter() != nullptr
                             ? "OpenBLAS threads set with torch::set_num_threads"
                             : "BLAS threads not controllable (no openblas_set_num_threads)"},
    };

    set_threads(1);
    ChainWorkload chain;
    BlockWorkload block;
    out["check"] = {{"chain", chain.check()}, {"block", block.check()}};
    Json chain_json = measure([&](double& f, double& b) { chain.step(f, b); }, args.chain_trials,
                              args.min_trial_s);
    chain_json["ops"] = kChainOps;
    out["chain"] = std::move(chain_json);

    Json threads = Json::array();
    for (int n : {1, 2}) {
      set_threads(n);
      Json t = measure([&](double& f, double& b) { block.step(f, b); }, args.block_trials,
                       args.min_trial_s);
      t["threads"] = n;
      t["torch_num_threads"] = torch::get_num_threads();
      threads.push_back(std::move(t));
    }
    out["block"] = {
        {"shape",
         {{"B", kBatch}, {"S", kSeq}, {"d", kModel}, {"heads", kHeads}, {"hidden", kHidden}}},
        {"threads", std::move(threads)}};

    rusage usage{};
    getrusage(RUSAGE_SELF, &usage);
    out["max_rss_mib"] = static_cast<double>(usage.ru_maxrss) / 1024.0;  // KiB on Linux
    std::printf("%s\n", out.dump().c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tandem-libtorch-autograd: error: %s\n", e.what());
    return 1;
  }
}
