#!/usr/bin/env bash
# The style's line limit, checked: no line of the library, its public
# headers or the command (src/, include/, tools/) is longer than 100
# columns (.clang-format's ColumnLimit; make format-check formats new lines).
# And files of one concern: no file of src/, tools/ or python/ is over 1,100
# lines (docs/ARCHITECTURE.md).
set -euo pipefail
: "${CKPT_SOURCE_DIR:?}"
cd "$CKPT_SOURCE_DIR"
long=$(find src include tools -name '*.[ch]' -print0 | sort -z |
    xargs -0 awk 'length > 100 { printf "%s:%d: %d columns\n", FILENAME, FNR, length }')
if [ -n "$long" ]; then
    echo "$long" >&2
    echo "FAIL: the lines above are over 100 columns" >&2
    exit 1
fi
echo "ok: no line in src/, include/, tools/ is over 100 columns"
big=$(find src tools python -name '*.[ch]' -o -name '*.py' | sort |
    xargs wc -l | awk '$2 != "total" && $1 > 1100 { printf "%s: %d lines\n", $2, $1 }')
if [ -n "$big" ]; then
    echo "$big" >&2
    echo "FAIL: the files above are over 1,100 lines: split them by concern" >&2
    exit 1
fi
echo "ok: no file in src/, tools/, python/ is over 1,100 lines"
