#!/usr/bin/env bash
# Build llama.cpp's `llama-server` from the source that the llama-cpp-python sdist on PyPI vendors, once,
# into a cache outside the clone (so CI runs and later clones reuse it):
#
#     scripts/build_llama_cpp.sh            # or: make llama-cpp
#
# It prints the directory it built, which holds bin/llama-server and the source tree (src/) with
# convert_hf_to_gguf.py and gguf-py/. `drafters/export` and the engine tests find it the same way
# (eval/llama_cpp.py: $DRAFTSMITH_LLAMA_CPP, else this cache). A cold build takes about 5 minutes on 2
# cores; a built cache returns at once. llama.cpp's source is built as vendored, but for the patches in
# eval/llama_cpp_patches/, each with its reason at its head; the build records their digest
# (bin/patches.sha256), and a build whose patches differ from the clone's is rebuilt.
set -euo pipefail
export LC_ALL=C  # the patches' order, and so their digest, is the byte order of their names

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
PYTHON="${PYTHON:-python3}"
DEST="${DRAFTSMITH_LLAMA_CPP:-$HOME/.cache/draftsmith/llama.cpp/llama-cpp-python-$VERSION}"

PATCHES="$(cd "$(dirname "$0")/.." && pwd)/eval/llama_cpp_patches"
DIGEST="$(cat "$PATCHES"/*.patch | sha256sum | cut -d' ' -f1)"

if [ -x "$DEST/bin/llama-server" ] && [ -f "$DEST/src/convert_hf_to_gguf.py" ] \
        && [ "$(cat "$DEST/bin/patches.sha256" 2>/dev/null)" = "$DIGEST" ]; then
    echo "$DEST"
    exit 0
fi

mkdir -p "$DEST"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

echo "llama.cpp: fetching the llama-cpp-python $VERSION source distribution" >&2
"$PYTHON" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$work" >&2
tar -xzf "$work/llama_cpp_python-$VERSION.tar.gz" -C "$work"
rm -rf "$DEST/src"
mv "$work/llama_cpp_python-$VERSION/vendor/llama.cpp" "$DEST/src"
for p in "$PATCHES"/*.patch; do
    echo "llama.cpp: applying $(basename "$p")" >&2
    if command -v patch > /dev/null; then
        patch -p1 --quiet -d "$DEST/src" < "$p"
    else  # git applies a patch outside a repository too
        (cd "$DEST/src" && git apply -p1 < "$p")
    fi
done

# No network at run time (no curl, no OpenSSL); the server only, no tests or examples.
echo "llama.cpp: building llama-server (about 5 minutes on 2 cores)" >&2
cmake -S "$DEST/src" -B "$DEST/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF >&2
cmake --build "$DEST/build" --target llama-server -j "$(nproc)" >&2
mkdir -p "$DEST/bin.tmp"
cp "$DEST/build/bin/llama-server" "$DEST/bin.tmp/"
echo "$DIGEST" > "$DEST/bin.tmp/patches.sha256"
rm -rf "$DEST/bin" "$DEST/build"
mv "$DEST/bin.tmp" "$DEST/bin"  # last: a build interrupted before here is rebuilt next time
echo "$DEST"
