#!/usr/bin/env bash
# The shipped library reads no test variable: the code that arms an I/O fault
# from CKPT_FAULT / CKPT_FAULT_RANK is compiled only with CKPT_FAULT_ENV (the
# CMake option that is on where the tests are built, off in make build and
# make install). Compiles the one file that reads them both ways and looks
# for the variable's name in the object.
set -euo pipefail
: "${CKPT_SOURCE_DIR:?}"
cd "$CKPT_SOURCE_DIR"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cc=${CC:-cc}
flags=(-std=c11 -D_GNU_SOURCE -DCKPT_BUILDING -Iinclude -Isrc -c src/base/io.c)
"$cc" "${flags[@]}" -o "$tmp/release.o"
"$cc" "${flags[@]}" -DCKPT_FAULT_ENV -o "$tmp/test.o"
if ! strings "$tmp/test.o" | grep -q CKPT_FAULT; then
    echo "FAIL: the test build of src/base/io.c does not read CKPT_FAULT (check the test)" >&2
    exit 1
fi
if strings "$tmp/release.o" | grep CKPT_FAULT >&2; then
    echo "FAIL: src/base/io.c built without CKPT_FAULT_ENV still names the variables above" >&2
    exit 1
fi
if grep -rln 'getenv("CKPT_FAULT' src --include='*.c' | grep -v '^src/base/io.c$' >&2; then
    echo "FAIL: the files above read CKPT_FAULT outside src/base/io.c's CKPT_FAULT_ENV block" >&2
    exit 1
fi
echo "ok: without CKPT_FAULT_ENV the library reads no CKPT_FAULT variable"
