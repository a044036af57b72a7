#!/usr/bin/env bash
# Size check: lists the functions longer than N lines (default 100) in tracked C++/CUDA sources
# (universal-ctags end lines) and the source files over 900 lines.   scripts/funclen.sh [N]
N=${1:-100}
cd "$(git rev-parse --show-toplevel)"
git ls-files '*.cpp' '*.h' '*.cu' '*.cuh' '*.inc' | grep -v '^tests/fixtures' > /tmp/fl_files
ctags --languages=C++,CUDA --map-C++=+.cu --map-C++=+.cuh --kinds-C++=f --fields=+ne -x --_xformat='%{input} %{line} %{end} %{name}' -L /tmp/fl_files 2>/dev/null \
 | awk -v n=$N '$3!="" && $3-$2+1>n {print $3-$2+1, $1":"$2, $4}' | sort -rn
echo "--- files > 900 lines"
xargs wc -l < /tmp/fl_files | awk '$1>900 && $2!="total"' | sort -rn
