#!/usr/bin/env bash
# The shipped library reads no test variable: fault injection and its
# CKPT_FAULT / CKPT_FAULT_RANK variables live in src/testing, a layer over
# the file-system table that only the test variant of the library has (the
# CMake option CKPT_FAULT_ENV, on where the tests are built, off in make
# build and make install). Shown three ways: no file outside src/testing
# names the variables; a release configuration leaves src/testing out; and a
# program built from the shipped sources runs untouched with CKPT_FAULT set,
# while the same program from the test variant fails at its first I/O call.
set -euo pipefail
: "${CKPT_SOURCE_DIR:?}" "${CKPT_BUILD_DIR:?}"
cd "$CKPT_SOURCE_DIR"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

if grep -rln 'CKPT_FAULT' src --include='*.[ch]' | grep -v '^src/testing/' >&2; then
    echo "FAIL: the files above name CKPT_FAULT outside src/testing" >&2
    exit 1
fi
grep -q 'getenv("CKPT_FAULT")' src/testing/layers.c ||
    { echo "FAIL: src/testing/layers.c no longer reads CKPT_FAULT (check this test)" >&2; exit 1; }

# What CMake compiles into a release library.
cmake -S . -B "$tmp/release" -DCMAKE_BUILD_TYPE=Release -DCKPT_BUILD_TESTS=OFF \
    -DCKPT_WITH_MPI=OFF >/dev/null
if grep -rl 'src/testing/' "$tmp/release/CMakeFiles/ckpt_obj.dir" >&2; then
    echo "FAIL: a release configuration compiles src/testing (see above)" >&2
    exit 1
fi
if cmake -S . -B "$tmp/refused" -DCKPT_BUILD_TESTS=ON -DCKPT_FAULT_ENV=OFF >"$tmp/out" 2>&1; then
    echo "FAIL: CMake configured the tests without the test layers" >&2
    exit 1
fi

# The shipped sources (all of src/ but src/mpi and src/testing), built
# unoptimised into one program that writes a state-dict file through the
# public API.
cc=${CC:-cc}
mapfile -t srcs < <(find src -name '*.c' ! -path 'src/mpi/*' ! -path 'src/testing/*' | sort)
flags=(-std=c11 -O0 -D_GNU_SOURCE -DCKPT_BUILDING -Iinclude -Isrc
    $(pkg-config --cflags jansson libxxhash zlib))
objs=()
for s in "${srcs[@]}"; do
    o="$tmp/obj/${s//\//_}.o"
    mkdir -p "$tmp/obj"
    "$cc" "${flags[@]}" -c "$s" -o "$o" &
    objs+=("$o")
    [ "$(jobs -rp | wc -l)" -ge 2 ] && wait -n
done
wait
"$cc" "${flags[@]}" -o "$tmp/gen_release" tests/progs/gen_statedict.c "${objs[@]}" \
    $(pkg-config --libs jansson libxxhash zlib) -lpthread -lm

CKPT_FAULT="any:1:EIO:persist" "$tmp/gen_release" "$tmp/release.safetensors" ||
    { echo "FAIL: the release build obeyed CKPT_FAULT" >&2; exit 1; }
[ -s "$tmp/release.safetensors" ] || { echo "FAIL: the release build wrote nothing" >&2; exit 1; }
if CKPT_FAULT="any:1:EIO:persist" "$CKPT_BUILD_DIR/tests/gen_statedict" "$tmp/test.safetensors" \
    2>"$tmp/err"; then
    echo "FAIL: the test variant ignored CKPT_FAULT (check this test)" >&2
    exit 1
fi
grep -q 'Input/output error' "$tmp/err" ||
    { cat "$tmp/err" >&2; echo "FAIL: the test variant failed, but not by the fault" >&2; exit 1; }
echo "ok: the shipped library reads no CKPT_FAULT variable; the test variant does"
