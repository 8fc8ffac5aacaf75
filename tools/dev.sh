#!/usr/bin/env bash
# The two README commands:
#   tools/dev.sh demo   install what is missing, build, run the main job
#   tools/dev.sh test   install what is missing, build, run the whole test suite
# Safe to re-run: installing is skipped when every package is present, the
# build directory is reused (ccache keeps rebuilds cheap).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${TANDEM_BUILD_DIR:-$root/build}"
jobs="${TANDEM_JOBS:-2}"

packages=(
  meson ninja-build pkg-config ccache g++ python3
  libopenmpi-dev openmpi-bin libeigen3-dev libopenblas-dev catch2
  libfmt-dev libcli11-dev nlohmann-json3-dev libdlpack-dev
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

configure_and_build() {
  if [[ ! -f "$build/build.ninja" ]]; then
    meson setup "$build" "$root" ${TANDEM_MESON_ARGS:-}
  fi
  ninja -C "$build" -j "$jobs"
}

# The threaded suites again under ThreadSanitizer (its own build directory,
# CUDA/MPI off; ccache keeps rebuilds cheap). TANDEM_SKIP_TSAN=1 skips it.
tsan_build="${TANDEM_TSAN_BUILD_DIR:-$root/build-tsan}"
tsan_suites=(runtime comm autograd parallel)
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
        TANDEM_WAIT_TIMEOUT_S=300 "$tsan_build/tests/tandem-tests-$s" --use-colour no \
        -r junit -o "$tsan_build/tests/junit-tsan-$s.xml" >"$tsan_build/tests/tsan-$s.log" 2>&1; then
      echo "tandem: ThreadSanitizer run of $s failed (log: $tsan_build/tests/tsan-$s.log):"
      grep -m 5 -A 20 "WARNING: ThreadSanitizer" "$tsan_build/tests/tsan-$s.log" || tail -20 "$tsan_build/tests/tsan-$s.log"
      failed=$((failed + 1))
    fi
  done
  return $failed
}

run_tests() {
  cd "$build"
  rm -f tests/junit-*.xml
  local status=0 tsan_failed=0
  meson test --no-rebuild --print-errorlogs --num-processes 1 || status=$?
  local reports=(tests/junit-*.xml)
  if [[ "${TANDEM_SKIP_TSAN:-0}" != 1 ]]; then
    run_tsan || tsan_failed=$?
    reports+=("$tsan_build"/tests/junit-tsan-*.xml)
  fi
  TANDEM_EXTRA_FAILURES=$tsan_failed python3 "$root/tools/junit_summary.py" "${reports[@]}" || status=1
  return $status
}

case "${1:-}" in
  demo)
    install_missing
    configure_and_build
    shift
    exec "$build/tools/tandem-demo" "$@"
    ;;
  test)
    install_missing
    configure_and_build
    run_tests
    ;;
  *)
    echo "usage: tools/dev.sh demo|test" >&2
    exit 2
    ;;
esac
