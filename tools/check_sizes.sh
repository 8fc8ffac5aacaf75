#!/usr/bin/env bash
# Fails when a tracked source file passes the size a reader takes in one
# sitting (STYLE, "Layout": past ~800 lines a file is split by responsibility).
# Run by `tools/dev.sh test` before it builds; TANDEM_MAX_LINES overrides 800.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
max="${TANDEM_MAX_LINES:-800}"
over=0
while IFS= read -r -d '' f; do
  lines=$(wc -l <"$root/$f")
  if ((lines > max)); then
    echo "tandem: $f has $lines lines, expected at most $max (split it by responsibility)"
    over=$((over + 1))
  fi
done < <(git -C "$root" ls-files -z -- '*.cpp' '*.h' '*.cu' '*.cuh' '*.py' '*.sh')
((over == 0))
