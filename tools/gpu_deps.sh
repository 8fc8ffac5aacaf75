#!/usr/bin/env bash
# Fetches, on a Debian 12 machine with network access, the .deb files of the
# build dependencies that a GPU machine without package registries may lack
# (Catch2, fmt, CLI11, nlohmann-json, DLPack, Eigen, OpenBLAS, pkgconf), into
# .gpu-deps/ at the repository root (ignored by git). tools/gpu_check.sh
# unpacks them under build-gpu-deps/ (never into /) when the machine it runs
# on lacks them. About 15 MB.
#   tools/gpu_deps.sh      then carry .gpu-deps to the GPU machine
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest="$root/.gpu-deps"
packages=(
  catch2 libfmt-dev libfmt9 libcli11-dev nlohmann-json3-dev libdlpack-dev libeigen3-dev
  libopenblas-dev libopenblas-pthread-dev libopenblas0-pthread libopenblas0 libgfortran5
  pkgconf pkgconf-bin libpkgconf3
)

rm -rf "$dest"
mkdir -p "$dest"
(cd "$dest" && apt-get download "${packages[@]}" >/dev/null)
echo "gpu_deps: $(ls "$dest" | wc -l) packages, $(du -sh "$dest" | cut -f1), in $dest"
