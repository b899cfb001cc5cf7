#!/usr/bin/env bash
# Build llama.cpp's `llama-server` from the source that the llama-cpp-python sdist on PyPI vendors, once,
# into a cache outside the clone (so CI runs and later clones reuse it):
#
#     scripts/build_llama_cpp.sh            # or: make llama-cpp
#     LLAMA_CPP_BACKEND=cuda scripts/build_llama_cpp.sh   # offloads to an NVIDIA GPU (needs nvcc)
#     LLAMA_CPP_SOURCE=/path/to/llama.cpp scripts/build_llama_cpp.sh   # offline: the sdist's vendor/llama.cpp
#
# It prints the directory it built, which holds bin/llama-server, bin/llama-quantize and the source tree (src/) with
# convert_hf_to_gguf.py and gguf-py/. `drafters/export` and the engine tests find it the same way
# (eval/engines/llama_cpp.py: $DRAFTSMITH_LLAMA_CPP, else this cache). A cold build takes about 5 minutes on 2
# cores; a built cache returns at once. llama.cpp's source is built as vendored, but for the patches in
# eval/engines/llama_cpp_patches/, each with its reason at its head; the build records their digest
# (bin/patches.sha256), and a build whose patches differ from the clone's is rebuilt.
#
# LLAMA_CPP_BACKEND: `cpu` or `cuda`, ggml's CUDA backend for the machine's NVIDIA GPUs (GGML_NATIVE: their
# architectures only; 293 s on 16 cores for an H200), recorded in bin/backend; a build of the other backend is
# rebuilt, and unset, the cached build's backend is kept (cpu where there is none). llama-server offloads every
# layer it can by default, and the engine report names the device its log says it ran on.
# LLAMA_CPP_SOURCE: a directory holding llama.cpp's source as the sdist vendors it (unpatched), for a machine
# that cannot reach PyPI; it is copied, not changed. LLAMA_CPP_CMAKE_ARGS: more arguments for CMake's
# configure step (a toolkit's library paths, say), split at spaces.
#
# AMX: on a CPU with Intel's AMX (Sapphire Rapids and later Xeons), GGML_NATIVE turns on ggml's AMX kernels,
# which repack Q4_0, Q4_1, Q8_0 and K-quant weights at load and crash llama-server with SIGSEGV in
# ggml_backend_amx_mul_mat on some such machines (cloud VMs among them; llama.cpp issue 20824, open upstream
# without a fix): every quantized GGUF dies in the server's warm-up decode. So where /proc/cpuinfo lists
# amx_int8 the build leaves them out (-mno-amx-*, which GCC and Clang honour whatever -march=native says; the
# AVX-512 kernels and the CPU's other repacking stay), recorded in bin/amx. LLAMA_CPP_AMX=on keeps them, for a
# machine where they work. Elsewhere the flags are not passed and nothing changes.
set -euo pipefail
export LC_ALL=C  # the patches' order, and so their digest, is the byte order of their names

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
PYTHON="${PYTHON:-python3}"
DEST="${DRAFTSMITH_LLAMA_CPP:-$HOME/.cache/draftsmith/llama.cpp/llama-cpp-python-$VERSION}"
BACKEND="${LLAMA_CPP_BACKEND:-$(cat "$DEST/bin/backend" 2>/dev/null || echo cpu)}"
case "$BACKEND" in
    cpu) BACKEND_FLAGS=() ;;
    cuda) BACKEND_FLAGS=(-DGGML_CUDA=ON -DGGML_CUDA_NCCL=OFF) ;;
    *) echo "llama.cpp: LLAMA_CPP_BACKEND must be cpu or cuda, got '$BACKEND'" >&2; exit 2 ;;
esac

# amx: `none` on a CPU without AMX (no flag passed), else `off` (the default) or `on` (LLAMA_CPP_AMX=on).
# A build without bin/amx predates this choice: on an AMX CPU it was built with the kernels (`on`).
CPUINFO="${DRAFTSMITH_CPUINFO:-/proc/cpuinfo}"  # the tests point it at another CPU's
if grep -qw amx_int8 "$CPUINFO" 2>/dev/null; then
    AMX="${LLAMA_CPP_AMX:-off}"
    BUILT_AMX="$(cat "$DEST/bin/amx" 2>/dev/null || echo on)"
else
    AMX=none
    BUILT_AMX="$(cat "$DEST/bin/amx" 2>/dev/null || echo none)"
fi
case "$AMX" in
    none|on) AMX_FLAGS=() ;;
    off) AMX_FLAGS=("-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
                    "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16") ;;
    *) echo "llama.cpp: LLAMA_CPP_AMX must be on or off, got '$AMX'" >&2; exit 2 ;;
esac

PATCHES="$(cd "$(dirname "$0")/.." && pwd)/eval/engines/llama_cpp_patches"
DIGEST="$(cat "$PATCHES"/*.patch | sha256sum | cut -d' ' -f1)"

if [ -x "$DEST/bin/llama-server" ] && [ -x "$DEST/bin/llama-quantize" ] && [ -x "$DEST/bin/llama-hidden-states" ] \
        && [ -f "$DEST/src/convert_hf_to_gguf.py" ] \
        && [ "$(cat "$DEST/bin/patches.sha256" 2>/dev/null)" = "$DIGEST" ] \
        && [ "$(cat "$DEST/bin/backend" 2>/dev/null || echo cpu)" = "$BACKEND" ] && [ "$BUILT_AMX" = "$AMX" ]; then
    echo "$DEST"
    exit 0
fi

if [ "$BACKEND" = cuda ] && ! command -v nvcc > /dev/null; then
    echo "llama.cpp: LLAMA_CPP_BACKEND=cuda needs CUDA's compiler, nvcc, on PATH" >&2
    exit 2
fi

# Everything is built in a scratch directory beside $DEST and moved into place last, so a failed or interrupted
# build leaves the build that was there (and the runs using it) as they were.
mkdir -p "$(dirname "$DEST")"
work="$(mktemp -d "$DEST.building.XXXXXX")"
trap 'rm -rf "$work"' EXIT

if [ -n "${LLAMA_CPP_SOURCE:-}" ]; then
    [ -f "$LLAMA_CPP_SOURCE/CMakeLists.txt" ] && [ -f "$LLAMA_CPP_SOURCE/convert_hf_to_gguf.py" ] \
        || { echo "llama.cpp: LLAMA_CPP_SOURCE=$LLAMA_CPP_SOURCE holds no llama.cpp source (CMakeLists.txt, convert_hf_to_gguf.py)" >&2; exit 2; }
    echo "llama.cpp: copying the source in $LLAMA_CPP_SOURCE" >&2
    cp -r "$LLAMA_CPP_SOURCE" "$work/src"
else
    echo "llama.cpp: fetching the llama-cpp-python $VERSION source distribution" >&2
    "$PYTHON" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$work" >&2
    tar -xzf "$work/llama_cpp_python-$VERSION.tar.gz" -C "$work"
    mv "$work/llama_cpp_python-$VERSION/vendor/llama.cpp" "$work/src"
fi
for p in "$PATCHES"/*.patch; do
    echo "llama.cpp: applying $(basename "$p")" >&2
    if command -v patch > /dev/null; then
        patch -p1 --quiet --batch -d "$work/src" < "$p"
    else  # git applies a patch outside a repository too
        (cd "$work/src" && git apply -p1 < "$p")
    fi
done

# No network at run time (no curl, no OpenSSL); the server, the quantizer (which writes the quantized GGUFs the
# tests serve) and llama-hidden-states (hidden-states-tool.patch: a target's features, drafter.hidden_states=llamacpp),
# no tests or examples.
echo "llama.cpp: building llama-server and llama-quantize for $BACKEND, AMX kernels $AMX (about 5 minutes on 2 cores)" >&2
cmake -S "$work/src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF \
    ${BACKEND_FLAGS[@]+"${BACKEND_FLAGS[@]}"} ${AMX_FLAGS[@]+"${AMX_FLAGS[@]}"} ${LLAMA_CPP_CMAKE_ARGS:-} >&2
cmake --build "$work/build" --target llama-server llama-quantize llama-hidden-states -j "$(nproc)" >&2
mkdir -p "$work/bin"
cp "$work/build/bin/llama-server" "$work/build/bin/llama-quantize" "$work/build/bin/llama-hidden-states" "$work/bin/"
echo "$DIGEST" > "$work/bin/patches.sha256"
echo "$BACKEND" > "$work/bin/backend"
echo "$AMX" > "$work/bin/amx"
rm -rf "$DEST/bin" "$DEST/src"  # bin first: a build interrupted between here and the last line is rebuilt next time
mkdir -p "$DEST"
mv "$work/src" "$DEST/src"
mv "$work/bin" "$DEST/bin"
echo "$DEST"
