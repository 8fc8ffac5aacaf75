#!/usr/bin/env bash
# Fails CI on two things a reviewer should not have to catch by eye:
# - a tracked source file past the size a reader takes in one sitting (STYLE,
#   "Layout": past ~800 lines a file is split by responsibility);
#   TANDEM_MAX_LINES overrides 800;
# - an include of a library header that does not name it under tandem/
#   (Note [Prefixed includes] in meson.build): it would still build in the
#   tree, where the source root is on the include path of tests and tools,
#   but an installed header written that way could find a user's file.
# Run by `tools/dev.sh test` before it builds.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
max="${TANDEM_MAX_LINES:-800}"
bad=0
while IFS= read -r -d '' f; do
  lines=$(wc -l <"$root/$f")
  if ((lines > max)); then
    echo "tandem: $f has $lines lines, expected at most $max (split it by responsibility)"
    bad=$((bad + 1))
  fi
done < <(git -C "$root" ls-files -z -- '*.cpp' '*.h' '*.cu' '*.cuh' '*.py' '*.sh')
while IFS= read -r hit; do
  echo "tandem: $hit: expected the header under tandem/ (#include \"tandem/...\")"
  bad=$((bad + 1))
done < <(git -C "$root" grep -n -E '^\s*#\s*include\s*[<"](runtime|tensor|comm|autograd|parallel)/|^\s*#\s*include\s*[<"]tandem\.h' \
  -- '*.cpp' '*.h' '*.cu' '*.cuh' '*.md' || true)
((bad == 0))
