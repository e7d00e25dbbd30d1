#!/usr/bin/env bash
# The layers of src/ stay visible and acyclic: a file includes only from its
# own layer or below (base <- format <- {train, store} <- accel <- interop;
# mpi uses the public headers and accel), the CLI only the public headers,
# and no header includes itself through a chain. The same rule is checked on
# the symbols each object file uses (nm), so a call that runs back up a layer
# through the public header fails too, and no two files call each other
# round a cycle. And every file access goes through the one file-system
# table: only src/base/fs.c's object calls libc's file functions.
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
    interop) echo "base format store train accel interop" ;;
    mpi) echo "base accel mpi" ;;
    testing) echo "base testing" ;;
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

# Symbols: which object file calls which (nm), checked against the same
# layers, and for cycles between files. The checker first proves it can fail:
# an object compiled here that calls from base/ up into accel/ must be caught.
: "${CKPT_BUILD_DIR:?}"
objdir="$CKPT_BUILD_DIR/CMakeFiles"
probe=$(mktemp -d)
trap 'rm -rf "$probe"' EXIT
cat >"$probe/upcall.c" <<'C'
int ckpt_save_state(void *acc, const char *dir);
int ckpt__layer_probe(void) { return ckpt_save_state(0, "x"); }
C
cc -c -o "$probe/upcall.c.o" "$probe/upcall.c"
python3 - "$objdir" "$probe/upcall.c.o" <<'PY' || bad=1
import os, subprocess, sys
ALLOWED = {
    "base": {"base"}, "format": {"base", "format"}, "store": {"base", "format", "store"},
    "train": {"base", "format", "train"},
    "accel": {"base", "format", "store", "train", "accel"},
    "interop": {"base", "format", "store", "train", "accel", "interop"},
    "mpi": {"base", "accel", "mpi"},
    "testing": {"base", "testing"},
}

def objects(root):
    found = {}
    for d, _, files in os.walk(root):
        for n in files:
            p = os.path.join(d, n)
            rel = "src/" + p.split("/src/", 1)[1][:-2] if "/src/" in p else ""
            # Objects of files that moved away stay in a build folder: skip them.
            if n.endswith(".c.o") and rel and os.path.exists(rel):
                found.setdefault(rel, p)
    return found

def problems(objs):
    defs, uses = {}, {}
    for rel, p in sorted(objs.items()):
        out = subprocess.run(["nm", "-P", p], capture_output=True, text=True, check=True).stdout
        uses[rel] = set()
        for line in out.splitlines():
            f = line.split()
            if len(f) < 2:
                continue
            if f[1] == "U":
                uses[rel].add(f[0])
            elif f[1] in "TDBRGSVW":
                defs.setdefault(f[0], rel)
    graph, bad = {}, []
    for rel in sorted(uses):
        layer = rel.split("/")[1]
        for sym in sorted(uses[rel]):
            dep = defs.get(sym)
            if not dep or dep == rel:
                continue
            graph.setdefault(rel, set()).add(dep)
            dl = dep.split("/")[1]
            if dl not in ALLOWED.get(layer, set()):
                bad.append(f"upward call: {rel} ({layer}) uses {sym} from {dep} ({dl})")
    # Cycles between files: Tarjan's strongly connected components.
    index, low, stack, on, n = {}, {}, [], set(), [0]
    sys.setrecursionlimit(10000)
    def visit(v):
        index[v] = low[v] = n[0]; n[0] += 1
        stack.append(v); on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w); low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop(); on.discard(w); comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                bad.append("call cycle between files: " + " <-> ".join(sorted(comp)))
    for v in sorted(objs):
        if v not in index:
            visit(v)
    return bad, sum(len(g) for g in graph.values())

objs = objects(sys.argv[1])
if len(objs) < 20:
    print(f"symbol check: only {len(objs)} object files under {sys.argv[1]}", file=sys.stderr)
    sys.exit(1)
# The checker must see a planted upward call ...
planted = dict(objs)
planted["src/base/layer_probe.c"] = sys.argv[2]
found, _ = problems(planted)
if not any("src/base/layer_probe.c" in b and "src/accel/" in b for b in found):
    print("symbol check: a planted call from base/ to accel/ was not caught", file=sys.stderr)
    sys.exit(1)
# ... and the library has none.
found, nedges = problems(objs)
for b in found:
    print(b, file=sys.stderr)
if found:
    sys.exit(1)
print(f"symbols: {len(objs)} object files, {nedges} file-to-file call edges, "
      "none upward, no cycle")
PY

# The file-system table: no object of the library but src/base/fs.c's names
# a libc file, folder or mapping function (nm -u), so every such call goes
# through the table that the test layers wrap. The check first proves it
# can fail: a planted object that calls lstat must be caught.
cat >"$probe/direct.c" <<'C'
#include <sys/stat.h>
int ckpt__fs_probe(const char *p);
int ckpt__fs_probe(const char *p) { struct stat st; return lstat(p, &st); }
C
cc -c -o "$probe/direct.c.o" "$probe/direct.c"
python3 - "$objdir" "$probe/direct.c.o" <<'PY' || bad=1
import os, re, subprocess, sys
# The libc calls of fs.h's table, with their large-file, fortified and old
# glibc spellings.
NAMES = """open openat creat close read pread write pwrite readv writev lseek fsync
fdatasync sync_file_range ftruncate truncate fcntl flock posix_fadvise
fallocate posix_fallocate rename renameat renameat2 mkdir mkdirat rmdir unlink
unlinkat link linkat symlink symlinkat readlink readlinkat stat lstat fstat
fstatat statx statfs fstatfs access faccessat opendir fdopendir readdir closedir dirfd
scandir nftw ftw mmap munmap mremap msync fopen freopen""".split()
pat = re.compile(r"^(__)?(%s)(64)?(_2|_chk)?$" % "|".join(NAMES))
pat_old = re.compile(r"^__(x|fx|lx|fxat)stat(64)?$")

def objects(root):
    found = {}
    for d, _, files in os.walk(root):
        for n in files:
            p = os.path.join(d, n)
            rel = "src/" + p.split("/src/", 1)[1][:-2] if "/src/" in p else ""
            if n.endswith(".c.o") and rel and os.path.exists(rel) and "/ckpt_obj.dir/" in p:
                found.setdefault(rel, p)
    return found

def direct(objs):
    bad = []
    for rel, p in sorted(objs.items()):
        if rel == "src/base/fs.c":
            continue
        out = subprocess.run(["nm", "-u", "-P", p], capture_output=True, text=True,
                             check=True).stdout
        for line in out.splitlines():
            sym = line.split()[0].split("@")[0]
            if pat.match(sym) or pat_old.match(sym):
                bad.append(f"direct file call outside the table: {rel} calls {sym}")
    return bad

objs = objects(sys.argv[1])
if "src/base/fs.c" not in objs or len(objs) < 20:
    print(f"fs check: src/base/fs.c's object not among {len(objs)} under {sys.argv[1]}",
          file=sys.stderr)
    sys.exit(1)
planted = dict(objs)
planted["src/format/fs_probe.c"] = sys.argv[2]
if not any("src/format/fs_probe.c calls lstat" in b for b in direct(planted)):
    print("fs check: a planted direct lstat call was not caught", file=sys.stderr)
    sys.exit(1)
found = direct(objs)
for b in found:
    print(b, file=sys.stderr)
if found:
    sys.exit(1)
print(f"file-system table: {len(objs) - 1} object files call no libc file function; "
      "only src/base/fs.c does")
PY

# The CLI: its checkpoints' bytes go through the library (so through the
# table, its trust rules and the test layers); it opens by itself only what
# is not a checkpoint, in the files listed here, each for the reason given
# (docs/ARCHITECTURE.md, "The CLI and the table"). Any other tools/ object
# that names a libc file function fails, and a planted one is caught.
python3 - "$objdir" "$probe/direct.c.o" <<'PY' || bad=1
import os, re, subprocess, sys
NAMES = """open openat creat close read pread write pwrite readv writev lseek fsync
fdatasync sync_file_range ftruncate truncate fcntl flock posix_fadvise
fallocate posix_fallocate rename renameat renameat2 mkdir mkdirat rmdir unlink
unlinkat link linkat symlink symlinkat readlink readlinkat stat lstat fstat
fstatat statx access faccessat opendir fdopendir readdir closedir dirfd
scandir nftw ftw mmap munmap mremap msync fopen freopen fdopen""".split()
pat = re.compile(r"^(__)?(%s)(64)?(_2|_chk)?$" % "|".join(NAMES))
pat_old = re.compile(r"^__(x|fx|lx|fxat)stat(64)?$")
OWN = {
    "tools/cli_common.c": "cli_fopen_regular (the tool's own files) and cli_classify "
                          "(what a path on the command line is)",
    "tools/cli_train.c": "the metrics log ckpt train writes",
    "tools/cli_train_setup.c": "finding the demo's data set",
    "tools/digits.c": "reading the demo's data set",
    "tools/cli_files.c": "listing a folder's state files by name for inspect and diff",
    "tools/cli_inspect.c": "whether a file named in advice exists",
    "tools/cli_verify.c": "whether a path is a project, a checkpoint or a partial one",
}
def objects(root):
    found = {}
    for d, _, files in os.walk(root):
        if "/ckpt_cli.dir/" not in d + "/":
            continue
        for n in files:
            p = os.path.join(d, n)
            rel = "tools/" + p.split("/tools/", 1)[1][:-2] if "/tools/" in p else ""
            if n.endswith(".c.o") and rel and os.path.exists(rel):
                found.setdefault(rel, p)
    return found
def direct(objs):
    bad = []
    for rel, p in sorted(objs.items()):
        if rel in OWN:
            continue
        out = subprocess.run(["nm", "-u", "-P", p], capture_output=True, text=True,
                             check=True).stdout
        for line in out.splitlines():
            sym = line.split()[0].split("@")[0]
            if pat.match(sym) or pat_old.match(sym):
                bad.append(f"the CLI opens files itself outside its own files' code: {rel} "
                           f"calls {sym} (checkpoints go through the library)")
    return bad
objs = objects(sys.argv[1])
if len(objs) < 10:
    print(f"CLI fs check: only {len(objs)} tools objects under {sys.argv[1]}", file=sys.stderr)
    sys.exit(1)
planted = dict(objs)
planted["tools/cli_probe.c"] = sys.argv[2]
if not any("tools/cli_probe.c calls lstat" in b for b in direct(planted)):
    print("CLI fs check: a planted direct lstat call was not caught", file=sys.stderr)
    sys.exit(1)
found = direct(objs)
for b in found:
    print(b, file=sys.stderr)
if found:
    sys.exit(1)
print(f"CLI: {len(objs)} object files; only {len(OWN)} open the tool's own files themselves")
PY

[ "$bad" -eq 0 ] || exit 1
echo "layers: $(find src -name '*.[ch]' | wc -l) library files, every include within its layer or below, no cycles"
