#!/usr/bin/env bash
# Whether ggml's AMX kernels are in a llama.cpp build for a CPU with AMX, with and without the flags
# scripts/build_llama_cpp.sh passes on such a CPU (-mno-amx-tile -mno-amx-int8 -mno-amx-bf16). It runs on any
# x86-64 machine with GCC 11 or later: -march=sapphirerapids stands in for -march=native on an AMX CPU, and only
# ggml's CPU library is compiled (about 40 s each on 2 cores), never run.
#
#     scripts/check_amx_build.sh [LLAMA_CPP_SRC]   # default: the source of the cached build (make llama-cpp)
#
# It prints, for each build, the AMX functions ggml defines (ggml_backend_amx_*, the crash site
# ggml_backend_amx_mul_mat among them) and the AMX instructions in the library (ldtilecfg, tileloadd, tdp*).
set -euo pipefail
SRC="${1:-${DRAFTSMITH_LLAMA_CPP:-$HOME/.cache/draftsmith/llama.cpp/llama-cpp-python-0.3.36}/src}"
[ -f "$SRC/ggml/src/ggml-cpu/amx/amx.cpp" ] || { echo "no llama.cpp source at $SRC (make llama-cpp, or name one)" >&2; exit 2; }
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
for variant in with_amx_kernels without_amx_kernels; do
    flags="-march=sapphirerapids"
    [ "$variant" = without_amx_kernels ] && flags="$flags -mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    cmake -S "$SRC" -B "$work/$variant" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF "-DCMAKE_C_FLAGS=$flags" \
        "-DCMAKE_CXX_FLAGS=$flags" > /dev/null 2>&1
    cmake --build "$work/$variant" --target ggml-cpu -j "$(nproc)" > /dev/null 2>&1
    lib="$(find "$work/$variant" -name 'libggml-cpu.a')"
    echo "$variant: $(nm -C "$lib" | grep -c ' T ggml_backend_amx' || true) AMX functions defined" \
         "($(nm -C "$lib" | grep -c ' T ggml_backend_amx_mul_mat' || true) ggml_backend_amx_mul_mat)," \
         "$(objdump -d "$lib" | grep -cE '\s(ldtilecfg|tileloadd|tdpb[a-z]*|tdpbf16ps)\s' || true) AMX instructions"
done
