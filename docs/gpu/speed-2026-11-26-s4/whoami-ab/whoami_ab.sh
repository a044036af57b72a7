for f in .debs/*.deb; do dpkg -x $f /; done; export PATH=/usr/local/cuda/bin:$PATH
tp=$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)')
c="-G Ninja -DCMAKE_BUILD_TYPE=Release -DQ4_BUILD_TESTS=OFF -DCMAKE_PREFIX_PATH=$tp -DCMAKE_CUDA_ARCHITECTURES=90"
(cmake -S .prev -B build-prev $c && cmake --build build-prev -j8 --target q4train q4dat) > $OUT/prev-build.log 2>&1 &
(cmake -S . -B build-gpu $c && cmake --build build-gpu -j8 --target q4train q4dat) > $OUT/build.log 2>&1; wait
build-gpu/bin/q4dat init --config tests/fixtures/qwen3_4b.config.json --out /tmp/q4b.dat --seed 0 > /dev/null
w() { rm -rf /tmp/w-$2; $1/bin/q4train --config configs/whoami.yaml --set model.config=$PWD/tests/fixtures/qwen3_4b.config.json --set model.tokenizer=$PWD/assets/qwen3/tokenizer.json --set model.weights=/tmp/q4b.dat --set output.dir=/tmp/w-$2 --set train.steps=30 --set eval.at_start=false --set output.checkpoint_every=0 $3 > /tmp/w-$2.log 2>&1
python3 -c "
import json,statistics,sys
m=[json.loads(l) for l in open('/tmp/w-$2/metrics.jsonl') if l.strip()]
ms=[r['step_ms'] for r in m if r['step']>=3]
print('$2', 'median', round(statistics.median(ms),1), 'slowest', round(max(ms),1))"; }
w build-gpu new1; w build-prev old1; w build-gpu new2; w build-prev old2
w build-gpu newp "--profile-trace /tmp/new.json"; w build-prev oldp "--profile-trace /tmp/old.json"
python3 tools/bench/kernel_table.py /tmp/new.json 30 > $OUT/whoami-new.md; python3 tools/bench/kernel_table.py /tmp/old.json 30 > $OUT/whoami-old.md
head -3 $OUT/whoami-new.md $OUT/whoami-old.md
