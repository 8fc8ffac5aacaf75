#!/usr/bin/env bash
# The two README commands:
#   tools/dev.sh demo   install what is missing, build, run the main job (tandem-train)
#   tools/dev.sh test   install what is missing, build, run the whole test suite
# Safe to re-run: installing is skipped when every package is present, the
# build directory is reused (ccache keeps rebuilds cheap).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# The sanitizer and fuzz builds compile with -g, and ccache then hashes the
# build directory's path by default: a fresh checkout elsewhere (CI's) would
# miss every object of those builds. Meson's compile lines use relative paths,
# so without the directory in the hash any checkout hits (the debug info then
# names the directory that first compiled the object).
export CCACHE_NOHASHDIR=1
# Five build directories (normal, AVX2, TSan, ASan, fuzz) hold about 12 GB of
# objects together; ccache's default 5 GB would evict one configuration while
# another builds, and CI would rebuild it cold.
export CCACHE_MAXSIZE="${CCACHE_MAXSIZE:-20G}"
build="${TANDEM_BUILD_DIR:-$root/build}"
jobs="${TANDEM_JOBS:-2}"

packages=(
  meson ninja-build pkg-config ccache g++ python3
  libopenmpi-dev openmpi-bin libeigen3-dev libopenblas-dev catch2
  libfmt-dev libcli11-dev nlohmann-json3-dev libdlpack-dev
  clang libclang-rt-14-dev
)

install_missing() {
  local missing=()
  for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if ((${#missing[@]})); then
    echo "tandem: installing ${missing[*]}"
    local sudo=""
    [[ $(id -u) -ne 0 ]] && sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
}

# Builds the ninja targets "$@" (everything when none are named).
configure_and_build() {
  if [[ ! -f "$build/build.ninja" ]]; then
    meson setup "$build" "$root" ${TANDEM_MESON_ARGS:-}
  fi
  ninja -C "$build" -j "$jobs" "$@"
}

# Test cases the sanitizer stages leave out: the train suite's soak (3,000
# steps) and the Llama fine-tune (8 runs of 200 steps) run in the normal
# build only.
suite_filter() {
  [[ "$1" == train ]] && echo "~[soak]~[finetune]"
  return 0
}

# The threaded suites again under ThreadSanitizer (its own build directory,
# CUDA/MPI off; ccache keeps rebuilds cheap). TANDEM_SKIP_TSAN=1 skips it.
# The CUDA cases run on the emulated device (TANDEM_CUDA=emulated, README
# "The emulated CUDA device"), whose emulated threads TSan sees as fibers: a
# shared-memory race in a kernel is a report here.
tsan_build="${TANDEM_TSAN_BUILD_DIR:-$root/build-tsan}"
tsan_suites=(runtime tensor comm autograd parallel train)
run_tsan() {
  if [[ ! -f "$tsan_build/build.ninja" ]]; then
    meson setup "$tsan_build" "$root" -Dcuda=disabled -Dmpi=disabled -Dnccl=disabled \
      -Db_sanitize=thread -Db_lundef=false -Dbuildtype=debugoptimized >/dev/null
  fi
  local targets=()
  for s in "${tsan_suites[@]}"; do targets+=("tests/tandem-tests-$s"); done
  ninja -C "$tsan_build" -j "$jobs" "${targets[@]}"
  rm -f "$tsan_build"/tests/junit-tsan-*.xml
  local failed=0
  for s in "${tsan_suites[@]}"; do
    echo "tandem: ThreadSanitizer: $s"
    if ! TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 suppressions=$root/tools/tsan.supp" \
        TANDEM_WAIT_TIMEOUT_S=300 TANDEM_CUDA=emulated "$tsan_build/tests/tandem-tests-$s" \
        $(suite_filter "$s") --use-colour no \
        -r junit -o "$tsan_build/tests/junit-tsan-$s.xml" >"$tsan_build/tests/tsan-$s.log" 2>&1; then
      echo "tandem: ThreadSanitizer run of $s failed (log: $tsan_build/tests/tsan-$s.log):"
      grep -m 5 -A 20 "WARNING: ThreadSanitizer" "$tsan_build/tests/tsan-$s.log" || tail -20 "$tsan_build/tests/tsan-$s.log"
      failed=$((failed + 1))
    fi
  done
  return $failed
}

# The whole suite again under AddressSanitizer + UndefinedBehaviorSanitizer
# (own build directory, CUDA/MPI off). UB is fatal (-fno-sanitize-recover),
# LeakSanitizer is on (the intentionally leaked process-lifetime singletons
# stay reachable from their static pointers, so it does not report them).
# The CUDA cases run on the emulated device (TANDEM_CUDA=emulated), whose
# device memory is one malloc per allocation: a kernel's out-of-bounds access
# is a report here; the parallel suite runs a second time with its rank
# threads on that device. TANDEM_SKIP_ASAN=1 skips it.
asan_build="${TANDEM_ASAN_BUILD_DIR:-$root/build-asan}"
asan_suites=(runtime tensor autograd comm parallel train tools)
sanitizer_env=(
  ASAN_OPTIONS="detect_leaks=1:abort_on_error=0"
  UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
)
run_asan() {
  if [[ ! -f "$asan_build/build.ninja" ]]; then
    meson setup "$asan_build" "$root" -Dcuda=disabled -Dmpi=disabled -Dnccl=disabled \
      -Db_sanitize=address,undefined -Db_lundef=false -Dbuildtype=debugoptimized \
      "-Dcpp_args=-fno-sanitize-recover=undefined -fno-omit-frame-pointer" >/dev/null
  fi
  local targets=()
  for s in "${asan_suites[@]}"; do targets+=("tests/tandem-tests-$s"); done
  if ! ninja -C "$asan_build" -j "$jobs" "${targets[@]}"; then
    echo "tandem: the AddressSanitizer build failed"
    return 1
  fi
  rm -f "$asan_build"/tests/junit-asan-*.xml
  local failed=0
  for s in "${asan_suites[@]}"; do
    asan_run "$s" "$s" || failed=$((failed + 1))
  done
  # The parallel suite again with its rank threads on the emulated cuda:0
  # (TANDEM_TEST_DEVICE=cuda): the threads backend's device copies and the
  # kernels the layers launch there.
  asan_run parallel-cuda parallel TANDEM_TEST_DEVICE=cuda || failed=$((failed + 1))
  return $failed
}

# asan_run LABEL SUITE [NAME=value…]: one run of tandem-tests-SUITE under the
# sanitizers, reported as junit-asan-LABEL.xml.
asan_run() {
  local label="$1" s="$2"
  shift 2
  echo "tandem: AddressSanitizer + UBSan: $label"
  if ! env "${sanitizer_env[@]}" TANDEM_WAIT_TIMEOUT_S=300 TANDEM_CUDA=emulated "$@" \
      "$asan_build/tests/tandem-tests-$s" \
      $(suite_filter "$s") --use-colour no -r junit -o "$asan_build/tests/junit-asan-$label.xml" \
      >"$asan_build/tests/asan-$label.log" 2>&1; then
    echo "tandem: AddressSanitizer + UBSan run of $label failed (log: $asan_build/tests/asan-$label.log):"
    grep -m 5 -A 20 -E "ERROR: (Address|Leak)Sanitizer|runtime error:" "$asan_build/tests/asan-$label.log" ||
      tail -20 "$asan_build/tests/asan-$label.log"
    return 1
  fi
}

# Runs the Catch2 binaries of suites "${@:4}" from build directory $2 as stage
# $1 (each a JUnit report $2/tests/junit-$1-<suite>.xml), with the environment
# words in $3 (space-separated NAME=value). Returns the number that failed.
run_suites() {
  local label="$1" dir="$2" env_words="$3"
  shift 3
  rm -f "$dir"/tests/junit-"$label"-*.xml
  local failed=0
  for s in "$@"; do
    echo "tandem: $label: $s"
    # shellcheck disable=SC2086 # env_words is a list of words
    if ! env $env_words TANDEM_WAIT_TIMEOUT_S=300 "$dir/tests/tandem-tests-$s" $(suite_filter "$s") \
        --use-colour no -r junit -o "$dir/tests/junit-$label-$s.xml" >"$dir/tests/$label-$s.log" 2>&1; then
      echo "tandem: $label run of $s failed (log: $dir/tests/$label-$s.log):"
      grep -m 5 -B 5 -A 20 -E "FAILED|REQUIRE|CHECK" "$dir/tests/$label-$s.log" || tail -20 "$dir/tests/$label-$s.log"
      failed=$((failed + 1))
    fi
  done
  return $failed
}

# The tensor and autograd suites again from a build whose CPU kernels cannot
# use AVX-512 (-Dcpu_arch=x86-64-v3: AVX2 and FMA, 16 vector registers; Note
# [SIMD width] in tensor/cpu/simd.h), so the AVX2 path is tested whatever CPU
# runs CI. Own build directory, CUDA/MPI and the emulated device off (the
# kernels it would compile a second time run in the other stages); ccache
# keeps rebuilds cheap.
# TANDEM_SKIP_AVX2=1 skips it.
avx2_build="${TANDEM_AVX2_BUILD_DIR:-$root/build-avx2}"
avx2_suites=(tensor autograd)
run_avx2() {
  if [[ ! -f "$avx2_build/build.ninja" ]]; then
    meson setup "$avx2_build" "$root" -Dcpu_arch=x86-64-v3 -Dcuda=disabled -Dmpi=disabled \
      -Dnccl=disabled -Dgpu_emulator=disabled >/dev/null
  fi
  local targets=()
  for s in "${avx2_suites[@]}"; do targets+=("tests/tandem-tests-$s"); done
  if ! ninja -C "$avx2_build" -j "$jobs" "${targets[@]}"; then
    echo "tandem: the AVX2 build failed"
    return 1
  fi
  run_suites avx2 "$avx2_build" "" "${avx2_suites[@]}"
}

# The whole suite a second time from the normal build with every thread's
# default CPU stream asynchronous (TANDEM_CPU_STREAMS=async; the workers'
# streams follow), so that an op that reads before its producer ran, or a
# tensor handed to another thread without an event, shows up as a wrong
# result or an error (README, "Streams and events"). Reports go to
# $build/tests/junit-async-<suite>.xml. TANDEM_SKIP_ASYNC=1 skips it.
async_suites=(runtime tensor autograd comm parallel train tools)
run_async() {
  run_suites async "$build" "TANDEM_CPU_STREAMS=async" "${async_suites[@]}"
}

# The two projects of examples/ built and run as a user's project would be
# (README, "Your own project"): examples/installed against a staged install of
# the normal build ($build/stage, through its relocatable tandem.pc), and
# examples/subproject with this checkout as its subprojects/tandem (a copy of
# the example in $examples_build/subproject-src whose subprojects/tandem links
# here; CUDA, MPI and the emulated device off in that build of tandem). Each
# program exits non-zero unless its loss falls. TANDEM_SKIP_EXAMPLES=1 skips it.
examples_build="${TANDEM_EXAMPLES_BUILD_DIR:-$root/build-examples}"
run_examples() {
  local stage="$build/stage" failed=0
  rm -rf "$stage"
  if ! meson install -C "$build" --destdir "$stage" --no-rebuild --quiet; then
    echo "tandem: the staged install failed"
    return 1
  fi
  local pc
  pc="$(find "$stage" -name tandem.pc -print -quit)"
  rm -rf "$examples_build/installed"
  if ! PKG_CONFIG_PATH="$(dirname "$pc")" meson setup "$examples_build/installed" \
      "$root/examples/installed" >/dev/null ||
      ! ninja -C "$examples_build/installed" -j "$jobs" >/dev/null ||
      ! "$examples_build/installed/moe-dp-cp-ep"; then
    echo "tandem: examples/installed failed"
    failed=$((failed + 1))
  fi
  local src="$examples_build/subproject-src"
  mkdir -p "$src/subprojects"
  cp "$root"/examples/subproject/*.cpp "$root"/examples/subproject/meson.build "$src/"
  ln -sfn "$root" "$src/subprojects/tandem"
  if [[ ! -f "$examples_build/subproject/build.ninja" ]]; then
    meson setup "$examples_build/subproject" "$src" -Dtandem:cuda=disabled -Dtandem:mpi=disabled \
      -Dtandem:gpu_emulator=disabled >/dev/null || failed=$((failed + 1))
  fi
  if ! ninja -C "$examples_build/subproject" -j "$jobs" >/dev/null ||
      ! "$examples_build/subproject/mlp"; then
    echo "tandem: examples/subproject failed"
    failed=$((failed + 1))
  fi
  return $failed
}

# libFuzzer targets (tools/fuzz, built with clang++ in their own directory),
# each run for TANDEM_FUZZ_SECONDS (default 20) from its seed corpus; what the
# run adds goes to $fuzz_build/corpus/<fuzzer>, emptied first so that every
# run costs the same (never into the repository).
# Each run is one test case of $fuzz_build/junit-fuzz-<fuzzer>.xml; a crash
# fails it, and its input is saved as $fuzz_build/crash-<fuzzer>-*. Returns 1
# when the build fails. Skipped when clang++ cannot link libFuzzer.
# TANDEM_SKIP_FUZZ=1 skips it.
fuzz_build="${TANDEM_FUZZ_BUILD_DIR:-$root/build-fuzz}"
fuzzers=(views redistribute safetensors train-cli)
have_libfuzzer() {
  command -v clang++ >/dev/null || return 1
  local probe
  probe="$(mktemp -d)"
  printf 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }\n' \
    >"$probe/probe.cpp"
  clang++ -fsanitize=fuzzer,address,undefined "$probe/probe.cpp" -o "$probe/probe" >/dev/null 2>&1
  local status=$?
  rm -rf "$probe"
  return $status
}
run_fuzz() {
  if ! have_libfuzzer; then
    echo "tandem: fuzzing skipped: clang++ cannot link libFuzzer (-fsanitize=fuzzer)"
    return 0
  fi
  if [[ ! -f "$fuzz_build/build.ninja" ]]; then
    local cxx="clang++"
    command -v ccache >/dev/null && cxx="ccache clang++"
    CXX="$cxx" meson setup "$fuzz_build" "$root" -Dfuzz=true -Dcuda=disabled -Dmpi=disabled \
      -Dnccl=disabled -Dgpu_emulator=disabled -Db_sanitize=address,undefined -Db_lundef=false \
      -Dbuildtype=debugoptimized \
      "-Dcpp_args=-fno-sanitize-recover=undefined -fno-omit-frame-pointer" >/dev/null
  fi
  local targets=()
  for f in "${fuzzers[@]}"; do targets+=("tools/fuzz/fuzz-$f"); done
  if ! ninja -C "$fuzz_build" -j "$jobs" "${targets[@]}"; then
    echo "tandem: the fuzzer build failed"
    return 1
  fi
  local seconds="${TANDEM_FUZZ_SECONDS:-20}"
  rm -f "$fuzz_build"/junit-fuzz-*.xml
  for f in "${fuzzers[@]}"; do
    echo "tandem: fuzzing $f for ${seconds}s"
    rm -rf "$fuzz_build/corpus/$f"
    mkdir -p "$fuzz_build/corpus/$f"
    local log="$fuzz_build/fuzz-$f.log" status=0 start=$SECONDS
    env "${sanitizer_env[@]}" TANDEM_WAIT_TIMEOUT_S=60 "$fuzz_build/tools/fuzz/fuzz-$f" \
      "$fuzz_build/corpus/$f" "$root/tools/fuzz/corpus/$f" -max_total_time="$seconds" \
      -timeout=60 -rss_limit_mb=4096 -print_final_stats=1 \
      -artifact_prefix="$fuzz_build/crash-$f-" >"$log" 2>&1 || status=$?
    local runs
    runs="$(grep -m 1 -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || true)"
    local failure=""
    if ((status != 0)); then
      echo "tandem: fuzzer $f found a failure (log: $log):"
      grep -m 3 -B 2 -A 25 -E "FINDING|ERROR: (Address|Leak)Sanitizer|runtime error:|deadly signal|uncaught" "$log" ||
        tail -30 "$log"
      failure="<failure message=\"exit status $status, see $log\"/>"
    fi
    # One test case per fuzzer, so the closing line counts the smoke runs.
    printf '<testsuites><testsuite name="fuzz-%s"><testcase classname="fuzz" name="fuzz-%s: %ss, %s inputs" time="%s">%s</testcase></testsuite></testsuites>\n' \
      "$f" "$f" "$seconds" "${runs:-?}" "$((SECONDS - start))" "$failure" >"$fuzz_build/junit-fuzz-$f.xml"
  done
}

# Runs `$2…` as a stage named $1 and prints how long it took.
timed() {
  local name="$1" start=$SECONDS status=0
  shift
  "$@" || status=$?
  echo "tandem: stage $name took $((SECONDS - start))s"
  return $status
}

run_tests() {
  cd "$build"
  rm -f tests/junit-*.xml
  local status=0 extra_failed=0 failed=0
  timed tests meson test --no-rebuild --print-errorlogs --num-processes 1 || status=$?
  local reports=(tests/junit-*.xml)
  if [[ "${TANDEM_SKIP_AVX2:-0}" != 1 ]]; then
    failed=0
    timed avx2 run_avx2 || failed=$?
    extra_failed=$((extra_failed + failed))
    reports+=("$avx2_build"/tests/junit-avx2-*.xml)
  fi
  if [[ "${TANDEM_SKIP_ASYNC:-0}" != 1 ]]; then
    failed=0
    timed async run_async || failed=$?
    extra_failed=$((extra_failed + failed))
    reports+=("$build"/tests/junit-async-*.xml)
  fi
  if [[ "${TANDEM_SKIP_EXAMPLES:-0}" != 1 ]]; then
    failed=0
    timed examples run_examples || failed=$?
    extra_failed=$((extra_failed + failed))
  fi
  if [[ "${TANDEM_SKIP_TSAN:-0}" != 1 ]]; then
    failed=0
    timed tsan run_tsan || failed=$?
    extra_failed=$((extra_failed + failed))
    reports+=("$tsan_build"/tests/junit-tsan-*.xml)
  fi
  if [[ "${TANDEM_SKIP_ASAN:-0}" != 1 ]]; then
    failed=0
    timed asan run_asan || failed=$?
    extra_failed=$((extra_failed + failed))
    reports+=("$asan_build"/tests/junit-asan-*.xml)
  fi
  if [[ "${TANDEM_SKIP_FUZZ:-0}" != 1 ]]; then
    failed=0
    timed fuzz run_fuzz || failed=$?
    extra_failed=$((extra_failed + failed))
    for f in "${fuzzers[@]}"; do
      [[ -f "$fuzz_build/junit-fuzz-$f.xml" ]] && reports+=("$fuzz_build/junit-fuzz-$f.xml")
    done
  fi
  TANDEM_EXTRA_FAILURES=$extra_failed python3 "$root/tools/junit_summary.py" "${reports[@]}" || status=1
  return $status
}

case "${1:-}" in
  demo)
    install_missing
    configure_and_build tools/tandem-train  # the demo needs no test binary
    shift
    exec "$build/tools/tandem-train" "$@"
    ;;
  test)
    "$root/tools/check_sources.sh"  # 800-line files, unprefixed includes
    install_missing
    configure_and_build
    run_tests
    ;;
  *)
    echo "usage: tools/dev.sh demo|test" >&2
    exit 2
    ;;
esac
