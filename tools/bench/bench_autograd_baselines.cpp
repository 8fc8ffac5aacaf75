// The baseline programs of `tandem-bench autograd`
// (bench_autograd_baselines.h): where they are and how they run.
#include "tools/bench/bench_autograd_baselines.h"

#include <fmt/format.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>

#include "tandem/runtime/error.h"
#include "tools/bench/bench_autograd_workload.h"

namespace tandem::bench::autograd_baselines {
namespace {

using Json = nlohmann::ordered_json;
using autograd_workload::median_of;

constexpr const char* kLibTorchProgram = "tandem-libtorch-autograd";
constexpr const char* kPyTorchScript = "pytorch_autograd.py";

// Note [Autograd baselines]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// Two programs can stand beside tandem, each in its own process, each
// printing one JSON object of the same shape:
// - LibTorch 1.13 (tools/bench/libtorch_autograd.cpp, built when Debian's
//   libtorch-dev is installed; it multiplies on OpenBLAS);
// - PyTorch 2.x (tools/bench/pytorch_autograd.py, run by TANDEM_BENCH_PYTHON
//   or else python3, when it imports torch >= 2; MKL and oneDNN, fused
//   scaled_dot_product_attention). Found next to tandem-bench, where Meson
//   copies it.
// The baselines run the instructions tandem's kernels were built for (Note
// [Baselines on the kernels' instructions] in bench.h); the JSON's
// "baseline_env" says how. On a GPU (--device cuda) only PyTorch stands
// beside tandem: the LibTorch program is built against Debian's CPU-only
// libtorch, and PyTorch runs the block on its own GPU (Note [Autograd on a
// GPU] in bench_autograd_cuda.cpp).

std::filesystem::path self_directory(std::string& why) {
  std::error_code ec;
  std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) {
    why = fmt::format("cannot read /proc/self/exe ({})", ec.message());
    return {};
  }
  return self.parent_path();
}

}  // namespace

std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char ch : s)
    q += ch == '\'' ? std::string("'\\''") : std::string(1, ch);
  return q + "'";
}

std::vector<float> json_floats(const Json& j) {
  std::vector<float> v;
  for (const auto& x : j)
    v.push_back(x.get<float>());
  return v;
}

Timing timing_over_rounds(const std::vector<double>& per_round, int reps) {
  Timing t;
  t.median_s = median_of(per_round);
  t.min_s = *std::min_element(per_round.begin(), per_round.end());
  t.reps = reps;
  t.trials = static_cast<int>(per_round.size());
  return t;
}

std::string run_command(const std::string& command) {
  std::fflush(stdout);
  FILE* pipe = popen(command.c_str(), "r");
  TANDEM_CHECK(pipe != nullptr, "[bench::autograd] expected to start `{}`, got popen failing",
               command);
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, pipe)) > 0)
    out.append(buf, n);
  int status = pclose(pipe);
  TANDEM_CHECK(status != -1 && WIFEXITED(status) && WEXITSTATUS(status) == 0,
               "[bench::autograd] expected `{}` to exit with status 0, got {} (its stderr is "
               "above)",
               command,
               status == -1        ? std::string("pclose failing")
               : WIFEXITED(status) ? fmt::format("status {}", WEXITSTATUS(status))
                                   : fmt::format("signal {}", WTERMSIG(status)));
  return out;
}

std::optional<Baseline> find_libtorch(std::string& why) {
  std::filesystem::path dir = self_directory(why);
  if (dir.empty()) return std::nullopt;
  std::filesystem::path path = dir / kLibTorchProgram;
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) {
    why = fmt::format(
        "{} not found next to tandem-bench (it is built only when libtorch-dev is installed; "
        "install it and re-run `meson setup --reconfigure`)",
        path.string());
    return std::nullopt;
  }
  if (access(path.c_str(), X_OK) != 0) {
    why = fmt::format("{} is not executable", path.string());
    return std::nullopt;
  }
  // OPENBLAS_CORETYPE is inherited (Note [Baselines on the kernels' instructions]).
  const char* core = std::getenv("OPENBLAS_CORETYPE");
  return Baseline{"libtorch", "LibTorch 1.13", shell_quote(path.string()),
                  core != nullptr ? fmt::format("OPENBLAS_CORETYPE={}", core) : ""};
}

std::optional<Baseline> find_pytorch(std::string& why, bool cuda) {
  std::filesystem::path dir = self_directory(why);
  if (dir.empty()) return std::nullopt;
  std::filesystem::path script = dir / kPyTorchScript;
  std::error_code ec;
  if (!std::filesystem::exists(script, ec)) {
    why = fmt::format("{} not found next to tandem-bench", script.string());
    return std::nullopt;
  }
  const char* env_python = std::getenv("TANDEM_BENCH_PYTHON");
  const std::string python = env_python != nullptr && *env_python ? env_python : "python3";
  std::string version;
  try {
    version = run_command(fmt::format("{} -c 'import torch; print(torch.__version__)' 2>/dev/null",
                                      shell_quote(python)));
  } catch (const std::exception&) {
    why = fmt::format(
        "{} cannot import torch (pip install torch, or point TANDEM_BENCH_PYTHON at a Python "
        "that has PyTorch 2.x)",
        python);
    return std::nullopt;
  }
  while (!version.empty() && std::isspace(static_cast<unsigned char>(version.back())))
    version.pop_back();
  if (version.empty() || version[0] < '2' || version[0] > '9' || version[1] != '.') {
    why = fmt::format("{} has torch {}, expected 2.x", python, version);
    return std::nullopt;
  }
  Baseline b{"pytorch", "PyTorch " + version.substr(0, version.find('+')),
             shell_quote(python) + " " + shell_quote(script.string()), ""};
  if (cuda) {
    std::string has_cuda;
    try {
      has_cuda = run_command(
          fmt::format("{} -c 'import torch; print(torch.cuda.is_available())' 2>/dev/null",
                      shell_quote(python)));
    } catch (const std::exception& e) {
      has_cuda = e.what();
    }
    if (has_cuda.rfind("True", 0) != 0) {
      why = fmt::format("{} ({}) has no CUDA: torch.cuda.is_available() is {}", b.name, python,
                        has_cuda.rfind("False", 0) == 0 ? "False" : "not True: " + has_cuda);
      return std::nullopt;
    }
    return b;  // the CPU instruction settings below do not concern the GPU
  }
  if (kernels_below_machine()) {
    b.env = "ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2";
  }
  return b;
}

}  // namespace tandem::bench::autograd_baselines
