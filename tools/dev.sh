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

run_tests() {
  cd "$build"
  rm -f tests/junit-*.xml
  local status=0
  meson test --no-rebuild --print-errorlogs --num-processes 1 || status=$?
  python3 "$root/tools/junit_summary.py" tests/junit-*.xml || status=1
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
