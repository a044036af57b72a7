#!/usr/bin/env bash
# Rewrites tests/ctest_costs.txt (each long ctest test's seconds, the order ctest -j starts them
# in: cmake/Q4TestSuites.cmake) from the output of ctest runs, e.g. a CI log: for each test its
# longest time over the logs, tests of 4 s or more. Usage: scripts/ctest_costs.sh LOG...
set -euo pipefail
. "$(dirname "$0")/lib.sh"
[ $# -gt 0 ] || q4_die "usage: scripts/ctest_costs.sh LOG..."
out=tests/ctest_costs.txt
{
  sed -n '/^# /p' "$out"
  grep -h -E 'Test +#[0-9]+: .*[ *](Passed|Failed|Skipped) +[0-9.]+ sec$' "$@" |
    sed -E 's/^.*Test +#[0-9]+: //; s/ \.+\**/|/; s/ *(Passed|Failed|Skipped) +/|/; s/ sec$//' |
    awk -F'|' '$3 > m[$1] { m[$1] = $3 } END { for (k in m) if (m[k] >= 4) printf "%.0f %s\n", m[k], k }' |
    grep -v ' trainer_layers$' | sort -k1,1rn -k2
} >"$out.tmp"
mv "$out.tmp" "$out"
echo "wrote $out ($(grep -c '^[0-9]' "$out") tests)"
