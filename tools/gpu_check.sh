#!/usr/bin/env bash
# GPU check: builds tandem with CUDA for H100/H200 (sm_90), runs the tensor and
# runtime suites (their [cuda] cases compare every CUDA kernel with the CPU
# reference) and a quick tensor benchmark. For a machine with a GPU (Debian-
# like, root, CUDA in /usr/local/cuda); run from anywhere in the repository:
#   tools/gpu_check.sh
# Missing build tools and libraries are installed with apt-get (only when
# missing). Every step shares one time budget (TANDEM_GPU_CHECK_BUDGET_S,
# default 480 s = 8 minutes). Logs go to build-gpu-logs/ and are also copied to
# "$OUT" when that is set. Exits non-zero when a step fails, when a [cuda] case
# was skipped (the GPU was not seen), or when the budget runs out.
set -uo pipefail

self="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")"
root="$(cd "$(dirname "$self")/.." && pwd)"
cd "$root" || exit 1
build="build-gpu"
logs="build-gpu-logs"
budget="${TANDEM_GPU_CHECK_BUDGET_S:-480}"
jobs="${TANDEM_JOBS:-$(nproc 2>/dev/null || echo 4)}"
start=$SECONDS
failed=()
export PATH="/usr/local/cuda/bin:$PATH"
export TANDEM_WAIT_TIMEOUT_S="${TANDEM_WAIT_TIMEOUT_S:-120}"

# The packages of tools/dev.sh: the optional MPI backend and the benchmark's
# dependencies are part of a full build.
packages=(
  meson ninja-build pkg-config g++ python3
  libopenmpi-dev openmpi-bin libeigen3-dev libopenblas-dev catch2
  libfmt-dev libcli11-dev nlohmann-json3-dev libdlpack-dev
)

copy_logs() {
  if [[ -n "${OUT:-}" ]]; then
    mkdir -p "$OUT" && cp -f "$logs"/*.log "$OUT"/ 2>/dev/null
  fi
  return 0
}

remaining() { echo $((budget - (SECONDS - start))); }

# step NAME CMD...: runs CMD (a command or one of the functions below, through
# this script's --run) within the remaining budget, output to $logs/NAME.log.
step() {
  local name="$1"
  shift
  local left
  left=$(remaining)
  if ((left <= 5)); then
    echo "gpu_check: $name: not run, the ${budget}s budget is spent"
    failed+=("$name (no time left)")
    return 1
  fi
  echo "gpu_check: $name (${left}s left)"
  timeout --kill-after=10 "$left" "$self" --run "$@" >"$logs/$name.log" 2>&1
  local rc=$?
  tail -n 30 "$logs/$name.log"
  if ((rc != 0)); then
    ((rc == 124 || rc == 137)) && echo "gpu_check: $name: timed out"
    echo "gpu_check: $name failed (exit $rc)"
    failed+=("$name")
    return 1
  fi
  return 0
}

install_missing() {
  local missing=()
  for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  ((${#missing[@]} == 0)) && return 0
  echo "installing ${missing[*]}"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
}

configure() {
  if [[ -f "$build/build.ninja" ]]; then
    meson setup --reconfigure "$build" -Dcuda=enabled -Dgpu_arch=sm_90
  else
    meson setup "$build" -Dcuda=enabled -Dgpu_arch=sm_90
  fi
}

# A [cuda] case that says SKIP on this machine means the GPU went unseen.
run_suite() {
  local binary="$1"
  "$binary" --use-colour no --durations no
  local rc=$?
  if grep -q "SKIP: no CUDA device" "$logs/$(basename "$binary").log" 2>/dev/null; then
    echo "gpu_check: [cuda] cases were skipped: no usable GPU was found"
    return 1
  fi
  return $rc
}

if [[ "${1:-}" == "--run" ]]; then
  shift
  "$@"
  exit $?
fi

mkdir -p "$logs"
rm -f "$logs"/*.log
trap copy_logs EXIT

step device bash -c 'nvidia-smi || echo "nvidia-smi not found"; nvcc --version'
step install install_missing &&
  step configure configure &&
  step build ninja -C "$build" -j "$jobs" tests/tandem-tests-tensor tests/tandem-tests-runtime \
    tools/tandem-bench &&
  {
    step tandem-tests-tensor run_suite "$build/tests/tandem-tests-tensor"
    step tandem-tests-runtime run_suite "$build/tests/tandem-tests-runtime"
    step tandem-bench "$build/tools/tandem-bench" tensor --quick
  }

elapsed=$((SECONDS - start))
if ((${#failed[@]})); then
  echo "gpu_check: FAILED after ${elapsed}s: ${failed[*]} (logs in $logs/)"
  exit 1
fi
echo "gpu_check: all steps passed in ${elapsed}s (logs in $logs/)"
