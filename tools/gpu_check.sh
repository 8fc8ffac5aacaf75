#!/usr/bin/env bash
# GPU check: everything GPU-related in one go, for the first minutes on a GPU
# machine (H100/H200: sm_90). Run from anywhere in the repository:
#   tools/gpu_check.sh
# Steps, each within what is left of one time budget (TANDEM_GPU_CHECK_BUDGET_S,
# default 480 s = 8 minutes):
#   1. the build dependencies: the machine's own; else apt-get; else the .deb
#      files of .gpu-deps/ (tools/gpu_deps.sh fetches them where Debian's
#      registry is reachable), unpacked under build-gpu-deps/, never into /;
#   2. a CUDA build in build-gpu (-Dcuda=enabled -Dgpu_arch=sm_90);
#   3. the suites natively on the GPU: runtime, tensor, autograd and comm (their
#      CUDA cases compare every kernel with the CPU reference), parallel-cuda and
#      train-cuda (4 rank threads sharing the GPU through the threads backend),
#      and nccl (one rank) when MPI and NCCL were found;
#   4. compute-sanitizer memcheck and racecheck over the tensor suite's CUDA
#      cases;
#   5. the benchmarks on the GPU: tandem-bench tensor's GPU rows (matmul
#      against cuBLAS, f32 and bf16); autograd --device cuda (the block step,
#      and attention forward+backward in bf16 against PyTorch's flash kernel
#      and in f32, where the machine's python3 or TANDEM_BENCH_PYTHON has a
#      CUDA PyTorch; else those rows are skipped); cp --device cuda (every CP
#      mode with 4 rank threads sharing the GPU, S=8192); overlap --device
#      cuda (the dual-pipe step with 2 rank threads on the GPU against the
#      sequential step).
# Writes build-gpu-logs/summary.json (every step: status, seconds, note; every
# benchmark's JSON) and, when $OUT is set (the device tool), copies it and a
# tarball of the logs there. Exits non-zero when a step failed, when a CUDA
# case was skipped (the GPU went unseen), or when the budget ran out.
set -uo pipefail

self="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")"
root="$(cd "$(dirname "$self")/.." && pwd)"
cd "$root" || exit 1
build="build-gpu"
logs="build-gpu-logs"
prefix="$root/build-gpu-deps/root"
budget="${TANDEM_GPU_CHECK_BUDGET_S:-480}"
jobs="${TANDEM_JOBS:-$(nproc 2>/dev/null || echo 4)}"
start=$SECONDS
failed=()
export PATH="/usr/local/cuda/bin:$PATH"
export TANDEM_WAIT_TIMEOUT_S="${TANDEM_WAIT_TIMEOUT_S:-120}"

# What the build needs besides CUDA, as tools/dev.sh installs it (MPI, hence
# NCCL, is optional: 178 packages are too many to carry).
packages=(
  meson ninja-build pkg-config g++ python3
  libeigen3-dev libopenblas-dev catch2 libfmt-dev libcli11-dev nlohmann-json3-dev libdlpack-dev
)

remaining() { echo $((budget - (SECONDS - start))); }

# One line per step for summary.json: name, status, seconds, note.
record() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "${4:-}" >>"$logs/steps.tsv"; }

# step NAME CMD...: runs CMD (a command, or a function of this script through
# its --run) within the remaining budget, at most $step_cap seconds when that
# is set, output to $logs/NAME.log.
step_cap=0
step() {
  local name="$1"
  shift
  local left
  left=$(remaining)
  if ((left <= 5)); then
    echo "gpu_check: $name: not run, the ${budget}s budget is spent"
    failed+=("$name (no time left)")
    record "$name" "not run" 0 "budget spent"
    return 1
  fi
  local limit=$left
  ((step_cap > 0 && step_cap < limit)) && limit=$step_cap
  echo "gpu_check: $name (${left}s left)"
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$self" --run "$@" >"$logs/$name.log" 2>&1
  local rc=$?
  tail -n 15 "$logs/$name.log"
  if ((rc == 0)); then
    record "$name" passed $((SECONDS - t0))
    return 0
  fi
  local status=failed
  ((rc == 124 || rc == 137)) && status="timed out"
  echo "gpu_check: $name: $status (exit $rc)"
  failed+=("$name")
  record "$name" "$status" $((SECONDS - t0)) "exit $rc; log $logs/$name.log"
  return 1
}

have_build_deps() {
  command -v meson >/dev/null && command -v ninja >/dev/null && command -v pkg-config >/dev/null &&
    pkg-config --exists fmt eigen3 openblas catch2 CLI11 nlohmann_json &&
    printf '#include <dlpack/dlpack.h>\n' | g++ -x c++ -fsyntax-only - 2>/dev/null
}

# The carried packages, unpacked under $prefix: compilers, pkg-config and the
# loader find them through the variables below (PKG_CONFIG_SYSROOT_DIR moves
# the /usr of their .pc files under $prefix).
use_carried_deps() {
  local lib="$prefix/usr/lib/x86_64-linux-gnu"
  rm -rf "$prefix"
  mkdir -p "$prefix"
  for deb in "$root"/.gpu-deps/*.deb; do
    dpkg -x "$deb" "$prefix" || return 1
  done
  [[ -e "$prefix/usr/bin/pkg-config" ]] || ln -s pkgconf "$prefix/usr/bin/pkg-config"
  export PATH="$prefix/usr/bin:$PATH"
  export LD_LIBRARY_PATH="$lib:$lib/openblas-pthread${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export LIBRARY_PATH="$lib:$lib/openblas-pthread${LIBRARY_PATH:+:$LIBRARY_PATH}"
  export CPLUS_INCLUDE_PATH="$prefix/usr/include${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}"
  export PKG_CONFIG_LIBDIR="$lib/pkgconfig:$lib/openblas-pthread/pkgconfig:$prefix/usr/share/pkgconfig"
  export PKG_CONFIG_SYSROOT_DIR="$prefix"
}

# In this shell (later steps inherit what it exports).
deps() {
  have_build_deps && { echo "the machine has every build dependency"; return 0; }
  if [[ -n "$(ls "$root"/.gpu-deps/*.deb 2>/dev/null)" ]]; then
    echo "using the carried packages of .gpu-deps/"
    use_carried_deps && have_build_deps && return 0
    echo "the carried packages do not provide every build dependency"
    return 1
  fi
  local missing=()
  for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  echo "installing ${missing[*]}"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" &&
    have_build_deps && return 0
  echo "missing build dependencies: run tools/gpu_deps.sh where Debian's registry is reachable" \
    "and bring .gpu-deps/ along"
  return 1
}

configure() {
  local args=(-Dcuda=enabled -Dgpu_arch=sm_90 -Dbuildtype=release)
  if [[ -f "$build/build.ninja" ]]; then
    meson setup --reconfigure "$build" "${args[@]}"
  else
    meson setup "$build" "${args[@]}"
  fi
}

# suite NAME: the Meson test NAME (with the environment tests/meson.build gives
# it: TANDEM_CUDA=emulated runs on the real GPU where one exists). A CUDA case
# that says SKIP means the GPU went unseen.
suite() {
  meson test -C "$build" --no-rebuild --print-errorlogs "$1"
  local rc=$?
  if grep -qs "SKIP: no CUDA device" "$build/meson-logs/testlog.txt" "$build/tests/junit-$1.xml"; then
    echo "gpu_check: CUDA cases of $1 were skipped: no usable GPU was found"
    return 1
  fi
  return $rc
}

# compute-sanitizer: on PATH, or where CUDA toolkits put it.
sanitizer_path() {
  command -v compute-sanitizer ||
    ls /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer \
      2>/dev/null | head -n 1
}

sanitize() {
  local tool="$1"
  "$(sanitizer_path)" --tool "$tool" --error-exitcode 3 "$build/tests/tandem-tests-tensor" "[cuda]" \
    --use-colour no
}

bench_gpu_matmul() {
  "$build/tools/tandem-bench" tensor --quick --json --filter gpu-matmul >"$logs/bench-tensor.json"
}

bench_gpu_autograd() {
  "$build/tools/tandem-bench" autograd --json --device cuda >"$logs/bench-autograd.json"
}

bench_gpu_cp() {
  "$build/tools/tandem-bench" cp --json --device cuda >"$logs/bench-cp.json"
}

bench_gpu_overlap() {
  "$build/tools/tandem-bench" overlap --json --device cuda >"$logs/bench-overlap.json"
}

summary() {
  python3 - "$logs" "$budget" "$((SECONDS - start))" <<'EOF'
import json, os, subprocess, sys
logs, budget, elapsed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def run(*cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
    except Exception:
        return ""
steps = []
if os.path.exists(os.path.join(logs, "steps.tsv")):
    for line in open(os.path.join(logs, "steps.tsv")):
        name, status, seconds, note = (line.rstrip("\n").split("\t") + [""] * 4)[:4]
        steps.append({"name": name, "status": status, "seconds": int(seconds or 0), "note": note})
benchmarks = {}
for name in ("tensor", "autograd", "cp", "overlap"):
    path = os.path.join(logs, f"bench-{name}.json")
    try:
        benchmarks[name] = json.load(open(path))
    except Exception:
        benchmarks[name] = None
doc = {
    "commit": run("git", "rev-parse", "HEAD"),
    "date": run("date", "-u", "+%Y-%m-%dT%H:%M:%SZ"),
    "gpu": run("nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"),
    "budget_s": budget,
    "elapsed_s": elapsed,
    "passed": all(s["status"] in ("passed", "not run") for s in steps),
    "steps": steps,
    "benchmarks": benchmarks,
}
json.dump(doc, open(os.path.join(logs, "summary.json"), "w"), indent=1)
EOF
}

finish() {
  summary
  if [[ -n "${OUT:-}" ]]; then
    mkdir -p "$OUT" && cp -f "$logs/summary.json" "$OUT/" 2>/dev/null
    tar -czf "$OUT/gpu-check-logs.tar.gz" "$logs" 2>/dev/null
  fi
  return 0
}

if [[ "${1:-}" == "--run" ]]; then
  shift
  "$@"
  exit $?
fi

mkdir -p "$logs"
rm -f "$logs"/*.log "$logs"/*.json "$logs/steps.tsv"
trap finish EXIT

step device bash -c 'nvidia-smi || echo "nvidia-smi not found"; nvcc --version'
t0=$SECONDS
if deps >"$logs/deps.log" 2>&1; then
  record deps passed $((SECONDS - t0)) "$(tail -n 1 "$logs/deps.log")"
else
  record deps failed $((SECONDS - t0)) "$(tail -n 1 "$logs/deps.log")"
  failed+=(deps)
fi
cat "$logs/deps.log"
if ((${#failed[@]} == 0)) && step configure configure && step build ninja -C "$build" -j "$jobs"; then
  for s in runtime tensor autograd comm parallel-cuda train-cuda; do
    step "suite-$s" suite "$s"
  done
  if meson test -C "$build" --list 2>/dev/null | grep -qx nccl; then
    step suite-nccl suite nccl
  else
    record suite-nccl "not run" 0 "built without MPI or NCCL"
  fi
  if [[ -n "$(sanitizer_path)" ]]; then
    step_cap=90 step memcheck sanitize memcheck
    step_cap=90 step racecheck sanitize racecheck
  else
    record memcheck "not run" 0 "compute-sanitizer not found"
    record racecheck "not run" 0 "compute-sanitizer not found"
  fi
  step_cap=120 step bench-tensor bench_gpu_matmul
  step_cap=150 step bench-autograd bench_gpu_autograd
  step_cap=120 step bench-cp bench_gpu_cp
  step_cap=90 step bench-overlap bench_gpu_overlap
fi

elapsed=$((SECONDS - start))
if ((${#failed[@]})); then
  echo "gpu_check: FAILED after ${elapsed}s: ${failed[*]} (logs and summary.json in $logs/)"
  exit 1
fi
echo "gpu_check: all steps passed in ${elapsed}s (logs and summary.json in $logs/)"
