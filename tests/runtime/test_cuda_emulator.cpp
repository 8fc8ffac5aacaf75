// The emulated CUDA device (Note [Emulated CUDA device]): the executor's
// indices, barriers, shared memory, warp operations and atomics, its error
// reports, the emulated runtime's streams and events, and that it catches the
// bugs it exists to catch. Those deliberate bugs (a missing __syncthreads, a
// shared-memory race, an out-of-bounds store) run in a child process, this
// binary re-executed on one hidden test case, whose output the parent reads:
// a sanitizer report there must not fail the suite that asked for it.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <numeric>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tandem/runtime/cuda/backends.h"
#include "tandem/runtime/cuda/cuda_api.h"
#include "tandem/runtime/device.h"
#include "tandem/runtime/error.h"
#include "tandem/runtime/stream.h"
#if defined(__SANITIZE_ADDRESS__)
#define TANDEM_TEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define TANDEM_TEST_ASAN 1
#endif
#endif
#ifdef TANDEM_TEST_ASAN
#include <sanitizer/asan_interface.h>
#endif
// Last: it defines threadIdx, __global__ and the other CUDA names.
#include "tandem/runtime/cuda/emulator/kernel_api.h"

extern char** environ;

using namespace tandem;
using Catch::Matchers::Contains;

namespace {

#if defined(__SANITIZE_THREAD__)
constexpr bool kTsan = true;
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
constexpr bool kTsan = true;
#else
constexpr bool kTsan = false;
#endif
#else
constexpr bool kTsan = false;
#endif
#ifdef TANDEM_TEST_ASAN
constexpr bool kAsan = true;
void* asan_region_is_poisoned(void* p, size_t bytes) {
  return __asan_region_is_poisoned(p, bytes);
}
#else
constexpr bool kAsan = false;
void* asan_region_is_poisoned(void*, size_t) {
  return nullptr;
}
#endif

void run(dim3 grid, dim3 block, size_t shared_bytes, const std::function<void()>& body) {
  emu::run_grid({{grid.x, grid.y, grid.z}, {block.x, block.y, block.z}, shared_bytes}, body);
}

// --- kernels -------------------------------------------------------------

__global__ void index_kernel(int* out) {
  const unsigned t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  const unsigned b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  const unsigned per_block = blockDim.x * blockDim.y * blockDim.z;
  out[b * per_block + t] = static_cast<int>(b * 1000 + t);
}

// Tree sum of one value per thread (blockDim.x a power of two); `with_sync`
// false drops the barriers, the bug a GPU punishes only sometimes.
__global__ void block_sum_kernel(const int* in, int* out, bool with_sync) {
  TANDEM_SHARED(int, partial, 256);
  const unsigned t = threadIdx.x;
  partial[t] = in[blockIdx.x * blockDim.x + t];
  if (with_sync) __syncthreads();
  for (unsigned width = blockDim.x / 2; width > 0; width /= 2) {
    if (t < width) partial[t] += partial[t + width];
    if (with_sync) __syncthreads();
  }
  if (t == 0) out[blockIdx.x] = partial[0];
}

// Each thread reads its neighbour's slot without waiting for it: a race.
__global__ void neighbour_kernel(int* out) {
  TANDEM_SHARED(int, slots, 64);
  const unsigned t = threadIdx.x;
  slots[t] = static_cast<int>(t) + 1;
  out[t] = slots[(t + 1) % blockDim.x];  // missing __syncthreads() before this read
  __syncthreads();
}

__global__ void reverse_kernel(const float* in, float* out, int n) {
  TANDEM_DYNAMIC_SHARED(float, tile);
  const int t = static_cast<int>(threadIdx.x);
  if (t < n) tile[t] = in[t];
  __syncthreads();
  if (t < n) out[t] = tile[n - 1 - t];
}

__global__ void warp_kernel(int* sums, int* down, int* broadcast, unsigned* ballots, int* votes) {
  const int t = static_cast<int>(threadIdx.x);
  const int lane = t % warpSize;
  int v = t;
  for (int offset = 16; offset > 0; offset /= 2)
    v += __shfl_xor_sync(0xffffffffu, v, offset);
  sums[t] = v;
  int d = t;
  for (int offset = 16; offset > 0; offset /= 2)
    d += __shfl_down_sync(0xffffffffu, d, offset);
  down[t] = d;
  broadcast[t] = __shfl_sync(0xffffffffu, t * 10, 5);
  ballots[t] = __ballot_sync(0xffffffffu, lane % 2 == 1);
  votes[t] = __any_sync(0xffffffffu, lane == 7) * 10 + __all_sync(0xffffffffu, lane < 32) * 1 +
             __all_sync(0xffffffffu, lane < 31) * 100;
}

__global__ void atomic_kernel(int* count, float* fsum, double* dsum, int* max, int* cas_count) {
  const int id = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  atomicAdd(count, 1);
  atomicAdd(fsum, 1.0f);
  atomicAdd(dsum, 0.5);
  atomicMax(max, id);
  int old = atomicAdd(cas_count, 0), seen;  // a plain read would race with the others' CAS
  do {
    seen = old;
    old = atomicCAS(cas_count, seen, seen + 2);
  } while (old != seen);
}

__global__ void divergent_kernel() {
  if (threadIdx.x < 16) {
    __syncthreads();
  } else {
    __syncwarp();
  }
}

__global__ void oob_kernel(float* out, int n) {
  const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i <= n) out[i] = 1.0f;  // off by one: i == n is past the end
}

__global__ void fill_kernel(float* out, int n, float value) {
  for (int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x); i < n;
       i += static_cast<int>(gridDim.x * blockDim.x))
    out[i] = value;
}

__global__ void throwing_kernel() {
  if (threadIdx.x == 3) throw Error("[test] kernel failure");
}

// --- child processes -----------------------------------------------------

struct Child {
  int status = -1;  // exit status, or 128 + signal
  std::string output;
};

// Runs this binary on one hidden test case with stdout and stderr captured,
// TANDEM_CUDA set to `tandem_cuda` when given.
Child run_child(const std::string& test_case, const std::string& tandem_cuda = "") {
  char path[] = "/tmp/tandem-emulator-child-XXXXXX";
  int fd = mkstemp(path);
  REQUIRE(fd >= 0);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fd, 1);
  posix_spawn_file_actions_adddup2(&actions, fd, 2);
  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string var = *e;
    if (var.rfind("TSAN_OPTIONS=", 0) == 0) continue;
    if (!tandem_cuda.empty() && var.rfind("TANDEM_CUDA=", 0) == 0) continue;
    env_strings.push_back(var);
  }
  if (!tandem_cuda.empty()) env_strings.push_back("TANDEM_CUDA=" + tandem_cuda);
  // Keep going after a report, so the child also prints its result.
  env_strings.emplace_back("TSAN_OPTIONS=halt_on_error=0");
  std::vector<char*> envp;
  for (auto& s : env_strings)
    envp.push_back(s.data());
  envp.push_back(nullptr);
  std::string exe = "/proc/self/exe", colour = "--use-colour", no = "no";
  std::string name = test_case;
  char* argv[] = {exe.data(), name.data(), colour.data(), no.data(), nullptr};
  pid_t pid = -1;
  int rc = posix_spawn(&pid, exe.c_str(), &actions, nullptr, argv, envp.data());
  posix_spawn_file_actions_destroy(&actions);
  close(fd);
  REQUIRE(rc == 0);
  int wstatus = 0;
  REQUIRE(waitpid(pid, &wstatus, 0) == pid);
  Child child;
  child.status = WIFEXITED(wstatus) ? WEXITSTATUS(wstatus) : 128 + WTERMSIG(wstatus);
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  child.output = text.str();
  std::remove(path);
  return child;
}

// The integer the child printed after `key`, or `fallback`.
long long printed(const std::string& output, const std::string& key, long long fallback) {
  auto pos = output.find(key);
  if (pos == std::string::npos) return fallback;
  return std::stoll(output.substr(pos + key.size()));
}

}  // namespace

TEST_CASE("emulated threads see their own indices", "[emulator]") {
  std::vector<int> out(3 * 2 * 24, -1);
  run(dim3(3, 2), dim3(4, 3, 2), 0, [&] { index_kernel(out.data()); });
  for (int b = 0; b < 6; ++b) {
    for (int t = 0; t < 24; ++t)
      REQUIRE(out[b * 24 + t] == b * 1000 + t);
  }
}

TEST_CASE("emulated barriers and shared memory give exact block sums", "[emulator]") {
  constexpr int kBlocks = 40, kThreads = 256;
  std::vector<int> in(kBlocks * kThreads), out(kBlocks, 0);
  std::iota(in.begin(), in.end(), 1);
  run(dim3(kBlocks), dim3(kThreads), 0, [&] { block_sum_kernel(in.data(), out.data(), true); });
  for (int b = 0; b < kBlocks; ++b) {
    long long expected = 0;
    for (int t = 0; t < kThreads; ++t)
      expected += in[b * kThreads + t];
    REQUIRE(out[b] == expected);
  }
}

TEST_CASE("emulated dynamic shared memory holds the launch's bytes", "[emulator]") {
  constexpr int n = 200;
  std::vector<float> in(n), out(n, 0.0f);
  std::iota(in.begin(), in.end(), 0.0f);
  run(dim3(1), dim3(256), n * sizeof(float), [&] { reverse_kernel(in.data(), out.data(), n); });
  for (int i = 0; i < n; ++i)
    REQUIRE(out[i] == in[n - 1 - i]);
}

TEST_CASE("emulated warp shuffles and votes", "[emulator]") {
  constexpr int n = 64;
  std::vector<int> sums(n), down(n), broadcast(n), votes(n);
  std::vector<unsigned> ballots(n);
  run(dim3(1), dim3(n), 0, [&] {
    warp_kernel(sums.data(), down.data(), broadcast.data(), ballots.data(), votes.data());
  });
  for (int t = 0; t < n; ++t) {
    const int warp = t / 32, base = warp * 32;
    const int warp_sum = 32 * base + 31 * 32 / 2;
    INFO("thread " << t);
    REQUIRE(sums[t] == warp_sum);
    if (t % 32 == 0) REQUIRE(down[t] == warp_sum);  // lane 0 has gathered the whole warp
    REQUIRE(broadcast[t] == (base + 5) * 10);
    REQUIRE(ballots[t] == 0xaaaaaaaau);
    REQUIRE(votes[t] == 11);  // any: yes, all lanes < 32: yes, all lanes < 31: no
  }
}

TEST_CASE("emulated atomics are atomic across blocks and host threads", "[emulator]") {
  int count = 0, max = -1, cas_count = 0;
  float fsum = 0.0f;
  double dsum = 0.0;
  run(dim3(16), dim3(128), 0, [&] { atomic_kernel(&count, &fsum, &dsum, &max, &cas_count); });
  REQUIRE(count == 16 * 128);
  REQUIRE(fsum == 16.0f * 128.0f);
  REQUIRE(dsum == 0.5 * 16 * 128);
  REQUIRE(max == 16 * 128 - 1);
  REQUIRE(cas_count == 2 * 16 * 128);
}

TEST_CASE("the emulator reports divergent barriers, kernel exceptions and bad shapes",
          "[emulator]") {
  REQUIRE_THROWS_WITH(run(dim3(2), dim3(32), 0, [] { divergent_kernel(); }),
                      Contains("expected the threads of block") && Contains("to wait at one"));
  REQUIRE_THROWS_WITH(run(dim3(3), dim3(8), 0, [] { throwing_kernel(); }),
                      Contains("[test] kernel failure"));
  REQUIRE_THROWS_WITH(run(dim3(1), dim3(1025), 0, [] {}),
                      Contains("expected a block of 1 to 1024 threads") && Contains("1025"));
  REQUIRE_THROWS_WITH(run(dim3(0), dim3(1), 0, [] {}),
                      Contains("expected a grid of at least one block"));
  // The executor is still usable after a failed grid.
  std::vector<int> out(4 * 24, -1);
  run(dim3(4), dim3(24), 0, [&] { index_kernel(out.data()); });
  REQUIRE(out[3 * 24 + 5] == 3005);
}

TEST_CASE("emulated streams and events keep CUDA's ordering", "[emulator]") {
  if (!cuda_emulated()) {
    WARN("SKIP: the CUDA device is not the emulated one (set TANDEM_CUDA=emulated)");
    std::cout << "SKIP: the CUDA device is not the emulated one" << std::endl;
    return;
  }
  REQUIRE(cuda_device_count() >= 1);
  REQUIRE(Device::cuda(0).is_cuda());
  REQUIRE(built_with_cuda());
  constexpr int n = 1 << 16;
  const size_t bytes = n * sizeof(float);
  float* a = static_cast<float*>(cuda_api::malloc(bytes, 0));
  float* b = static_cast<float*>(cuda_api::malloc(bytes, 0));
  Stream producer = Stream::create(Device::cuda(0));
  Stream consumer = Stream::create(Device::cuda(0));
  REQUIRE(producer.native_handle() != nullptr);
  Event start, ready, done;
  start.record(producer);
  // Many launches keep the producer busy for a while before `ready`.
  for (int i = 1; i <= 20; ++i)
    emu::launch(fill_kernel, dim3(64), dim3(128), 0, producer.native_handle(), a, n,
                static_cast<float>(i));
  ready.record(producer);
  ready.wait(consumer);  // the consumer's copy must see the last fill
  cuda_api::memcpy_async(b, a, bytes, cuda_api::CopyKind::DeviceToDevice, consumer.native_handle());
  done.record(consumer);
  done.synchronize();
  REQUIRE(done.query());
  REQUIRE(start.elapsed_ms(ready) >= 0.0f);
  std::vector<float> host(n, 0.0f);
  cuda_api::memcpy_async(host.data(), b, bytes, cuda_api::CopyKind::DeviceToHost,
                         consumer.native_handle());
  for (int i = 0; i < n; i += 997)
    REQUIRE(host[i] == 20.0f);
  // A bad configuration fails at the launch, as cudaGetLastError reports it on a GPU.
  REQUIRE_THROWS_WITH(
      emu::launch(fill_kernel, dim3(1), dim3(2048), 0, producer.native_handle(), a, n, 1.0f),
      Contains("expected a block of 1 to 1024 threads"));
  // A kernel's failure is sticky on its stream and surfaces at the next synchronize().
  emu::launch(throwing_kernel, dim3(1), dim3(8), 0, producer.native_handle());
  REQUIRE_THROWS_WITH(producer.synchronize(), Contains("[test] kernel failure"));
  producer.synchronize();  // taken: the stream works again
  cuda_api::free(a, 0);
  cuda_api::free(b, 0);
}

TEST_CASE("a missing __syncthreads gives a wrong result on the emulator", "[emulator]") {
  Child child = run_child("emulator child: missing syncthreads");
  INFO(child.output);
  const long long expected = 256LL * 257 / 2;  // the block holds 1..256
  REQUIRE(child.output.find("sum ") != std::string::npos);
  REQUIRE(printed(child.output, "sum ", expected) != expected);
  if (kTsan) REQUIRE_THAT(child.output, Contains("WARNING: ThreadSanitizer: data race"));
}

TEST_CASE("a shared-memory race is caught on the emulator", "[emulator]") {
  Child child = run_child("emulator child: shared-memory race");
  INFO(child.output);
  if (kTsan) {
    REQUIRE_THAT(child.output, Contains("WARNING: ThreadSanitizer: data race"));
  } else {
    // Without the barrier some thread reads its neighbour's slot unwritten.
    REQUIRE(printed(child.output, "correct ", 64) < 64);
  }
}

TEST_CASE("an out-of-bounds store is caught on the emulator under ASan", "[emulator]") {
  if (!kAsan) {
    WARN("SKIP: catching an out-of-bounds store needs AddressSanitizer (the ASan stage runs it)");
    std::cout << "SKIP: needs AddressSanitizer" << std::endl;
    return;
  }
  Child child = run_child("emulator child: out-of-bounds store");
  INFO(child.output);
  REQUIRE(child.status != 0);
  REQUIRE_THAT(child.output, Contains("AddressSanitizer: heap-buffer-overflow"));
  REQUIRE_THAT(child.output, Contains("WRITE of size 4"));  // the float past the end
}

// GCC's ASan keeps the shadow of unmapped memory: a fiber stack unmapped with
// its parked frames' redzones still poisoned made the next mapping there (a
// new thread's stack and TLS) report a stack-use-after-scope that was not.
TEST_CASE("fiber stacks leave no ASan poison behind when their thread exits", "[emulator]") {
  if (!kAsan) {
    WARN("SKIP: reading ASan's shadow needs AddressSanitizer (the ASan stage runs it)");
    std::cout << "SKIP: needs AddressSanitizer" << std::endl;
    return;
  }
  constexpr int kThreads = 256;
  std::vector<int> in(kThreads, 1), out(1, 0);
  std::thread([&] {
    run(dim3(1), dim3(kThreads), 0, [&] { block_sum_kernel(in.data(), out.data(), true); });
  }).join();
  REQUIRE(out[0] == kThreads);
  // The fibers' mappings are free again; fresh mappings of their size land
  // there first (the kernel gives addresses top-down from the last unmapped).
  const size_t bytes = 512 * 1024 + 4096;
  std::vector<void*> maps;
  for (int i = 0; i < 2 * kThreads; ++i) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    REQUIRE(p != MAP_FAILED);
    maps.push_back(p);
  }
  size_t poisoned = 0;
  for (void* p : maps) {
    if (asan_region_is_poisoned(p, bytes) != nullptr) ++poisoned;
    munmap(p, bytes);
  }
  REQUIRE(poisoned == 0);
}

TEST_CASE("TANDEM_CUDA chooses the CUDA backend once per process", "[emulator]") {
  if (!cuda_emulated()) {
    WARN("SKIP: needs a machine without a GPU whose suite runs with TANDEM_CUDA=emulated");
    std::cout << "SKIP: the CUDA device is not the emulated one" << std::endl;
    return;
  }
  Child three = run_child("emulator child: devices", "emulated:3");
  INFO(three.output);
  REQUIRE_THAT(three.output, Contains("devices 3 emulated 1 cuda:2 ok"));
  Child off = run_child("emulator child: devices", "off");
  INFO(off.output);
  REQUIRE_THAT(off.output, Contains("devices 0 emulated 0"));
  Child zero = run_child("emulator child: devices", "emulated:0");
  INFO(zero.output);
  REQUIRE_THAT(
      zero.output,
      Contains("[cuda] expected TANDEM_CUDA=emulated:N with N in [1, 8], got \"emulated:0\""));
  Child bogus = run_child("emulator child: devices", "gpu");
  INFO(bogus.output);
  REQUIRE_THAT(bogus.output, Contains("[cuda] expected TANDEM_CUDA to be auto, off, emulated or "
                                      "emulated:N, got \"gpu\""));
}

// Hidden: run only by name, in the child processes above.
TEST_CASE("emulator child: devices", "[.][emulator-child]") {
  try {
    const int count = cuda_device_count();
    std::cout << "devices " << count << " emulated " << cuda_emulated();
    if (count == 3) {
      // The last emulated device takes memory and streams like the first.
      Stream s = Stream::create(Device::cuda(2));
      void* p = cuda_api::malloc(64, 2);
      cuda_api::memset_async(p, 0, 64, s.native_handle());
      s.synchronize();
      cuda_api::free(p, 2);
      std::cout << " cuda:2 ok";
    }
    std::cout << std::endl;
  } catch (const Error& e) {
    std::cout << "error: " << e.what() << std::endl;
  }
}

TEST_CASE("emulator child: missing syncthreads", "[.][emulator-child]") {
  std::vector<int> in(256), out(1, 0);
  std::iota(in.begin(), in.end(), 1);
  run(dim3(1), dim3(256), 0, [&] { block_sum_kernel(in.data(), out.data(), false); });
  std::cout << "sum " << out[0] << std::endl;
}

TEST_CASE("emulator child: shared-memory race", "[.][emulator-child]") {
  std::vector<int> out(64, 0);
  run(dim3(1), dim3(64), 0, [&] { neighbour_kernel(out.data()); });
  int correct = 0;
  for (int t = 0; t < 64; ++t)
    correct += out[t] == (t + 1) % 64 + 1;
  std::cout << "correct " << correct << std::endl;
}

TEST_CASE("emulator child: out-of-bounds store", "[.][emulator-child]") {
  constexpr int n = 100;
  // Device memory as the emulated runtime hands it out: one malloc of n floats.
  float* out = static_cast<float*>(cuda_backend::emulator::malloc(n * sizeof(float), 0));
  run(dim3(1), dim3(128), 0, [&] { oob_kernel(out, n); });
  cuda_backend::emulator::free(out, 0);
  std::cout << "no report" << std::endl;
}
