#!/usr/bin/env bash
# The trainer's layer order (docs/design.md#trainer-layers): a sub-folder of trainer/ may include
# its own headers and those of the sub-folders listed before it, never one listed after it.
# Prints each include that runs upward and exits 1 when there is one.
set -euo pipefail
cd "$(dirname "$0")/.."
layers=(config runtime rewards distributed rundir plan objectives step output report app)
rank() { local i; for i in "${!layers[@]}"; do [ "${layers[$i]}" = "$1" ] && { echo "$i"; return; }; done; echo -1; }
bad=0
while IFS= read -r file; do
  sub=$(echo "$file" | sed -E 's|trainer/(src\|include/q4/trainer)/([a-z_]+)/.*|\2|')
  from=$(rank "$sub")
  if [ "$from" -lt 0 ]; then echo "check_layers: $file is in no layer (${layers[*]})"; bad=1; continue; fi
  while IFS= read -r inc; do
    to_sub=$(echo "$inc" | sed -E 's|.*"q4/trainer/([a-z_]+)/.*|\1|')
    to=$(rank "$to_sub")
    if [ "$to" -lt 0 ] || [ "$to" -gt "$from" ]; then
      echo "check_layers: $file ($sub) includes $inc ($to_sub)"; bad=1
    fi
  done < <(grep -o '#include "q4/trainer/[^"]*"' "$file" || true)
done < <(find trainer/src trainer/include/q4/trainer -mindepth 2 -type f \( -name '*.cpp' -o -name '*.h' \) | sort)
[ "$bad" -eq 0 ] && echo "check_layers: ok (${layers[*]})"
exit "$bad"
