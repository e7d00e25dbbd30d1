#!/usr/bin/env bash
# The layers of src/ stay visible and acyclic: a file includes only from its
# own layer or below (base <- format <- store <- accel; train uses format;
# mpi uses the public headers and accel), the CLI only the public headers,
# and no header includes itself through a chain.
set -euo pipefail
: "${CKPT_SOURCE_DIR:?}"
cd "$CKPT_SOURCE_DIR"

allowed() { # layer -> the layers its files may include
    case $1 in
    base) echo "base" ;;
    format) echo "base format" ;;
    store) echo "base format store" ;;
    train) echo "base format train" ;;
    accel) echo "base format store train accel" ;;
    mpi) echo "base accel mpi" ;;
    *) echo "" ;;
    esac
}

bad=0
while IFS= read -r f; do
    layer=${f#src/}
    layer=${layer%%/*}
    ok=$(allowed "$layer")
    while IFS= read -r inc; do
        dep=${inc%%/*}
        [ "$dep" = "$inc" ] && continue # a public header or a same-folder name
        case " $ok " in *" $dep "*) ;; *)
            echo "layer violation: $f ($layer) includes $inc ($dep)" >&2
            bad=1
            ;;
        esac
    done < <(sed -n 's/^#include "\([^"]*\)".*/\1/p' "$f")
done < <(find src -name '*.[ch]' | sort)

# The CLI: public headers and its own.
while IFS= read -r f; do
    while IFS= read -r inc; do
        case $inc in
        ckpt.h | ckpt_mpi.h) ;;
        */*) echo "the CLI reaches into the library: $f includes $inc" >&2; bad=1 ;;
        *) [ -f "tools/$inc" ] || { echo "the CLI includes an internal header: $f includes $inc" >&2; bad=1; } ;;
        esac
    done < <(sed -n 's/^#include "\([^"]*\)".*/\1/p' "$f")
done < <(find tools -name '*.[ch]' | sort)

# No include cycles among the library's headers (depth-first search).
python3 - <<'PY' || bad=1
import os, re, sys
hdrs = {}
for root, _, files in os.walk("src"):
    for n in files:
        if n.endswith(".h"):
            p = os.path.join(root, n)
            rel = os.path.relpath(p, "src")
            incs = re.findall(r'^#include "([^"]+)"', open(p).read(), re.M)
            hdrs[rel] = [i for i in incs if "/" in i]
state = {}
def visit(h, stack):
    state[h] = 1
    for d in hdrs.get(h, []):
        if state.get(d) == 1:
            print("include cycle: " + " -> ".join(stack + [h, d]), file=sys.stderr)
            sys.exit(1)
        if d in hdrs and not state.get(d):
            visit(d, stack + [h])
    state[h] = 2
for h in sorted(hdrs):
    if not state.get(h):
        visit(h, [])
PY

[ "$bad" -eq 0 ] || exit 1
echo "layers: $(find src -name '*.[ch]' | wc -l) library files, every include within its layer or below, no cycles"
