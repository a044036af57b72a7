#!/usr/bin/env bash
# The trainer's layer order (docs/design.md#trainer-layers): a sub-folder of trainer/ may include
# its own headers and those of the sub-folders listed before it, never one listed after it.
# Prints each include that runs upward and exits 1 when there is one. Pure bash after the one
# find (no process per file or include: a fork costs tens of milliseconds on a busy CI machine).
set -euo pipefail
cd "$(dirname "$0")/.."
layers=(config runtime rewards distributed rundir plan objectives step output report app)
declare -A rank_of
for i in "${!layers[@]}"; do rank_of[${layers[$i]}]=$i; done
bad=0
while IFS= read -r file; do
  [[ $file =~ ^trainer/(src|include/q4/trainer)/([a-z_]+)/ ]] && sub=${BASH_REMATCH[2]} || sub=$file
  from=${rank_of[$sub]:--1}
  if [ "$from" -lt 0 ]; then echo "check_layers: $file is in no layer (${layers[*]})"; bad=1; continue; fi
  while IFS= read -r line; do
    [[ $line =~ \#include\ \"q4/trainer/[^\"]*\" ]] || continue
    inc=${BASH_REMATCH[0]}
    [[ $inc =~ \"q4/trainer/([a-z_]+)/ ]] && to_sub=${BASH_REMATCH[1]} || to_sub=$inc
    to=${rank_of[$to_sub]:--1}
    if [ "$to" -lt 0 ] || [ "$to" -gt "$from" ]; then
      echo "check_layers: $file ($sub) includes $inc ($to_sub)"; bad=1
    fi
  done < "$file"
done < <(find trainer/src trainer/include/q4/trainer -mindepth 2 -type f \( -name '*.cpp' -o -name '*.h' \) | sort)
[ "$bad" -eq 0 ] && echo "check_layers: ok (${layers[*]})"
exit "$bad"
