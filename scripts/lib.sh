# Shared preamble of the developer scripts (scripts/*.sh, scripts/bench/*.sh): source it first.
#   . "$(dirname "$0")/lib.sh"          (from scripts/)
#   . "$(dirname "$0")/../lib.sh"       (from scripts/bench/)
# It sets $root (the repository root) and cds there, and defines:
#   q4_log MSG...                 a timestamped line on stderr
#   q4_die MSG...                 the same, then exit 1
#   q4_phase NAME CMD...          runs CMD, then prints "NAME ok in Ns" (or FAILED) with its time
#   q4_out                        $OUT (default gpu-out/), created; logs and results go there
#   q4_out_dir DIR NAME           a benchmark's folder: DIR, else $OUT, else runs/NAME; created,
#                                 its absolute path printed
#   q4_gpu_env                    the GPU machine's environment: carried .debs/*.deb unpacked
#                                 into / (PCRE2, utf8proc), CUDA's bin on PATH
#   q4_torch_prefix               CMAKE_PREFIX_PATH of python3's LibTorch (the GPU build's)
#   q4_gpu_configure SRC BUILD [CMAKE_ARGS...]
#                                 configures a Release GPU build of SRC in BUILD against that
#                                 LibTorch, for CUDA_ARCH (default "native": the local GPU; e.g.
#                                 CUDA_ARCH="90;120" for a list, CUDA_ARCH=default for the
#                                 build's default, the cards users have)
#   q4_gpu_build BUILD LOG "TARGET..." [CMAKE_ARGS...]
#                                 q4_gpu_configure of the repository into BUILD, then builds the
#                                 targets, output in LOG; prints LOG's last 60 lines on failure
#   q4_timed_build BUILD LOG "TARGET..." [CMAKE_ARGS...]
#                                 q4_gpu_build and "build: N s", or nothing with SKIP_BUILD=1
#   q4_clang                      installs clang with libFuzzer's runtime when missing
#   q4_asan_build TARGET...       builds TARGETs in build-asan/ (clang, ASan+UBSan, fuzz coverage)
#   q4_train_run BIN WORK NAME CONFIG [--set ...]
#                                 one q4train run (BIN/q4train) into WORK/NAME, its log WORK/NAME.log;
#                                 on failure the log's tail and exit 1
# NVLink multicast (NVLS) stays off in every NCCL/symmetric-memory user: the lent multi-GPU
# machines do not support it.
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

q4_log() { echo "[$(date +%H:%M:%S)] $*" >&2; }
q4_die() { q4_log "$@"; exit 1; }

q4_phase() {
  local name=$1 t0=$SECONDS; shift
  if "$@"; then
    echo "$name ok in $((SECONDS - t0))s"
  else
    local rc=$?
    echo "$name FAILED (exit $rc) after $((SECONDS - t0))s"
    return "$rc"
  fi
}

q4_out() { mkdir -p "${OUT:-$root/gpu-out}" && (cd "${OUT:-$root/gpu-out}" && pwd); }

q4_out_dir() {
  local dir=${1:-${OUT:-$root/runs/$2}}
  mkdir -p "$dir" && (cd "$dir" && pwd)
}

q4_gpu_env() {
  local f
  for f in "$root"/.debs/*.deb; do [ -e "$f" ] && dpkg -x "$f" /; done
  export PATH=/usr/local/cuda/bin:$PATH
}

q4_torch_prefix() { python3 -c 'import torch; print(torch.utils.cmake_prefix_path)'; }

q4_gpu_configure() {
  local src=$1 build=$2 arch=(); shift 2
  # CUDA_ARCH=default: no architecture given, the build's own default (sm_90/100/120/121).
  [ "${CUDA_ARCH:-native}" = default ] || arch=("-DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCH:-native}")
  cmake -S "$src" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    "-DCMAKE_PREFIX_PATH=$(q4_torch_prefix)" "${arch[@]}" "$@"
}

q4_gpu_build() {
  local build=$1 log=$2 targets=$3; shift 3
  { q4_gpu_configure "$root" "$build" "$@" >"$log" 2>&1 &&
    cmake --build "$build" -j "$(nproc)" --target $targets >>"$log" 2>&1; } ||
    { tail -n 60 "$log"; return 1; }
}

q4_timed_build() {
  [ "${SKIP_BUILD:-0}" != 1 ] || return 0
  local t0
  t0=$(date +%s)
  q4_gpu_build "$@"
  echo "build: $(( $(date +%s) - t0 )) s"
}

# q4_clang: installs clang and libFuzzer's runtime when missing (scripts/fuzz.sh, scripts/sanitize.sh).
q4_clang() {
  if ! command -v clang++ >/dev/null 2>&1 ||
     ! compgen -G "/usr/lib/llvm-*/lib/clang/*/lib/linux/libclang_rt.fuzzer-*.a" >/dev/null; then
    local sudo=""; [ "$(id -u)" = 0 ] || sudo=sudo
    $sudo apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends clang \
      libclang-rt-14-dev >/dev/null
  fi
}

# q4_asan_build TARGET...: builds TARGETs in build-asan/, the sanitizer build that scripts/sanitize.sh
# and scripts/fuzz.sh share: clang at -O1, ASan+UBSan, and libFuzzer's coverage in every object
# (Q4_FUZZ), so the unit tests and the fuzz targets link the same sanitized libraries.
q4_asan_build() {
  q4_clang
  cmake -S "$root" -B "$root/build-asan" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    "-DCMAKE_CXX_FLAGS_RELEASE=-O1 -DNDEBUG" -DCMAKE_CXX_COMPILER=clang++ -DQ4_SANITIZE=ON \
    -DQ4_FUZZ=ON >/dev/null
  cmake --build "$root/build-asan" -j "$(nproc)" --target "$@"
}

q4_train_run() {
  local bin=$1 work=$2 name=$3 config=$4; shift 4
  rm -rf "${work:?}/$name"
  "$bin/q4train" --config "$config" --set "output.dir=$work/$name" "$@" >"$work/$name.log" 2>&1 \
    || { tail -n 30 "$work/$name.log"; q4_die "$name: q4train failed"; }
}
