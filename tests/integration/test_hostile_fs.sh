#!/usr/bin/env bash
# A hostile folder: what the trust rules of docs/CRASHSAFETY.md promise, case
# by case, through the CLI.
# - A symlinked, hard-linked, FIFO or foreign checkpoints/.lock is refused with
#   a message naming what was found, and whatever it points at is untouched
#   (prune, a refused resume).
# - FIFOs never hang a reader: inspect/verify/diff/import of a FIFO
#   .safetensors or .bin, a FIFO shard in a Hugging Face import, a FIFO as the
#   newest checkpoint.json for verify, ls, inspect, diff, export, prune,
#   train --resume and --init-from, a FIFO as the data file. Every call runs
#   under `timeout 20`, so a regression fails (124) instead of hanging.
# - A newest checkpoint whose checkpoint.json is a folder, a symlink to
#   /dev/zero or a FIFO is damage: the resume falls back with a warning,
#   verify reports it, prune treats it as any damaged checkpoint.
# - A forged size in a resealed manifest (a huge one; two 2^63-64-byte sizes
#   over real sparse files, on a tmpfs when the test may mount one) is damage:
#   fallback, never "out of memory".
# - On a read-only file system a load takes no write lock (it says so when
#   there is no lock file to lock read-only), and its checkpoints start other
#   runs.
source "$(dirname "$0")/common.bash"

RESEAL=${CKPT_BUILD_DIR:?set CKPT_BUILD_DIR}/tests/reseal_manifest
T=(--epochs 1 --quiet --workers 0)

# run_t WANT CMD...: run_rc under a 20 s timeout (124 if it hung; killed 10 s
# later if it ignored the SIGTERM). run_train: the same for a `ckpt train`
# that may go on to train (slow under sanitizers on a busy machine), 300 s.
run_t() {
    local want=$1
    shift
    run_rc "$want" timeout -k 10 20 "$@"
}
run_train() {
    local want=$1
    shift
    run_rc "$want" timeout -k 10 300 "$CKPT_BIN" train "$@"
}
# says PATTERN: the last command's stderr+stdout has PATTERN.
says() {
    cat "$WORK/err" "$WORK/out" | has -e "$1" || {
        cat "$WORK/out" "$WORK/err" >&2
        fail "expected '$1' in the output"
    }
}

base=$WORK/base
run_rc 0 "$CKPT_BIN" train "${T[@]}" --save-every 10 --total-limit 0 --project-dir "$base"
[ -d "$base/checkpoints/checkpoint_4" ] || fail "expected checkpoints 0..4"
fresh() { # a copy of the project to damage
    rm -rf "$WORK/p"
    cp -a "$base" "$WORK/p"
    P=$WORK/p
    C4=$P/checkpoints/checkpoint_4
}

# ---- the lock -------------------------------------------------------------
fresh
model_sum=$(md5sum <"$C4/model.safetensors")
rm -f "$P/checkpoints/.lock"
ln -s checkpoint_4/model.safetensors "$P/checkpoints/.lock"
run_t 3 "$CKPT_BIN" prune "$P" --keep 3
says "lock file .*\.lock is a symlink"
[ "$(md5sum <"$C4/model.safetensors")" = "$model_sum" ] || fail "prune wrote through the symlinked lock"
[ -d "$P/checkpoints/checkpoint_0" ] || fail "a refused prune removed a checkpoint"

echo "precious" >"$WORK/precious.txt"
rm "$P/checkpoints/.lock"
ln -s ../../precious.txt "$P/checkpoints/.lock"
run_t 3 "$CKPT_BIN" train "${T[@]}" --resume --project-dir "$P"
says "lock file .*\.lock is a symlink"
[ "$(cat "$WORK/precious.txt")" = "precious" ] || fail "a refused resume wrote through the symlinked lock"

rm "$P/checkpoints/.lock"
ln "$C4/model.safetensors" "$P/checkpoints/.lock"
run_t 3 "$CKPT_BIN" prune "$P" --keep 3
says "has 2 names"
[ "$(md5sum <"$C4/model.safetensors")" = "$model_sum" ] || fail "prune wrote through a hard-linked lock"

rm "$P/checkpoints/.lock"
mkfifo "$P/checkpoints/.lock"
run_t 3 "$CKPT_BIN" prune "$P" --keep 3
says "lock file .*\.lock is a FIFO, expected a regular file"

rm "$P/checkpoints/.lock"
echo "my notes, not a lock" >"$P/checkpoints/.lock"
run_t 3 "$CKPT_BIN" prune "$P" --keep 3
says "not touching it"
[ "$(cat "$P/checkpoints/.lock")" = "my notes, not a lock" ] || fail "prune rewrote a foreign .lock"

# ckpt's own lock (a "<pid> <host>" line) is reused as before
rm "$P/checkpoints/.lock"
run_t 0 "$CKPT_BIN" prune "$P" --keep 3
run_t 0 "$CKPT_BIN" prune "$P" --keep 3

# the metrics log is not written through a symlink either
fresh
mkdir -p "$P/logs"
rm -f "$P/logs/metrics.jsonl"
ln -s ../../precious.txt "$P/logs/metrics.jsonl"
run_t 3 "$CKPT_BIN" train "${T[@]}" --resume --project-dir "$P"
says "metrics.jsonl: not a regular file of its own"
[ "$(cat "$WORK/precious.txt")" = "precious" ] || fail "train wrote its log through a symlink"

# ---- FIFOs never block a reader -------------------------------------------
fresh
mkfifo "$WORK/f.safetensors" "$WORK/f.bin"
good=$base/checkpoints/checkpoint_3
for f in "$WORK/f.safetensors" "$WORK/f.bin"; do
    run_t 3 "$CKPT_BIN" import "$f" "$WORK/imp"
    says "a FIFO, expected a regular file"
    run_t 1 "$CKPT_BIN" verify "$f"
    says "a FIFO, expected a regular file"
    [ ! -e "$WORK/imp" ] || fail "a refused import left $WORK/imp"
done
run_t 3 "$CKPT_BIN" inspect "$WORK/f.safetensors"
says "a FIFO, expected a regular file"
run_t 2 "$CKPT_BIN" inspect "$WORK/f.bin"
run_t 3 "$CKPT_BIN" diff "$WORK/f.safetensors" "$good/model.safetensors"
says "a FIFO, expected a regular file"
run_t 2 "$CKPT_BIN" diff "$WORK/f.bin" "$WORK/f.bin"

# a Hugging Face folder whose shard is a FIFO; a folder whose pytorch_model.bin is one
mkdir "$WORK/hf"
mkfifo "$WORK/hf/model-00001-of-00001.safetensors"
cat >"$WORK/hf/model.safetensors.index.json" <<'JSON'
{"metadata": {"total_size": 4}, "weight_map": {"w": "model-00001-of-00001.safetensors"}}
JSON
run_t 3 "$CKPT_BIN" import "$WORK/hf" "$WORK/imp"
says "model-00001-of-00001.safetensors: a FIFO, expected a regular file"
mkdir "$WORK/tb"
mkfifo "$WORK/tb/pytorch_model.bin"
run_t 3 "$CKPT_BIN" import "$WORK/tb" "$WORK/imp"
says "pytorch_model.bin: a FIFO, expected a regular file"

# the data file
run_t 3 "$CKPT_BIN" train "${T[@]}" --data "$WORK/f.bin" --project-dir "$WORK/d"
says "not a regular file"

# ---- a newest checkpoint.json that is not a regular file ------------------
for kind in fifo folder devzero; do
    fresh
    rm "$C4/checkpoint.json"
    case $kind in
    fifo) mkfifo "$C4/checkpoint.json"; what="a FIFO" ;;
    folder) mkdir "$C4/checkpoint.json"; what="a folder" ;;
    devzero) ln -s /dev/zero "$C4/checkpoint.json"; what="a symlink" ;;
    esac
    run_t 1 "$CKPT_BIN" verify "$C4"
    says "checkpoint.json: $what, expected a regular file"
    run_t 1 "$CKPT_BIN" verify "$P"
    says "4 of 5 checkpoints verified"
    run_t 0 "$CKPT_BIN" ls "$P"
    grep -Eq "^4 .* corrupt " "$WORK/out" || { cat "$WORK/out" >&2; fail "ls: $kind checkpoint.json not corrupt"; }
    run_t 3 "$CKPT_BIN" inspect "$C4"
    says "$what, expected a regular file"
    run_t 3 "$CKPT_BIN" diff "$C4" "$good"
    run_t 1 "$CKPT_BIN" diff "$P" "$base"
    run_t 3 "$CKPT_BIN" export "$C4" "$WORK/exp"
    says "$what, expected a regular file"
    [ ! -e "$WORK/exp" ] || fail "a refused export left $WORK/exp"
    run_t 3 "$CKPT_BIN" train "${T[@]}" --init-from "$C4" --project-dir "$WORK/init"
    says "$what, expected a regular file"
    # prune: damage newer than the newest valid checkpoint is kept, as any damage
    run_t 0 "$CKPT_BIN" prune "$P" --keep 2
    [ -d "$C4" ] && [ -d "$P/checkpoints/checkpoint_3" ] && [ -d "$P/checkpoints/checkpoint_2" ] \
        && [ ! -e "$P/checkpoints/checkpoint_1" ] || { ls "$P/checkpoints" >&2; fail "prune with a $kind checkpoint.json"; }
    # the resume falls back to checkpoint_3 with a warning and finishes the run
    run_train 0 "${T[@]}" --resume --project-dir "$P"
    says "warning: skipping .*checkpoint_4: .*checkpoint.json: $what, expected a regular file; falling back"
    [ -e /dev/zero ] && [ -c /dev/zero ] || fail "/dev/zero changed"
done

# a state file that is a FIFO: damage too
fresh
rm "$C4/optimizer.safetensors"
mkfifo "$C4/optimizer.safetensors"
run_t 1 "$CKPT_BIN" verify "$C4"
says "optimizer.safetensors: a FIFO, expected a regular file"
run_train 0 "${T[@]}" --resume --project-dir "$P"
says "falling back"

# ---- forged sizes in a resealed manifest ----------------------------------
# forge NEWSIZE FILE...: sets the manifest size of each FILE of checkpoint_4
# and reseals the manifest, as a forger would.
forge() {
    local size=$1
    shift
    /usr/bin/python3 - "$C4/checkpoint.json" "$size" "$@" <<'PY' || fail "forging the manifest"
import re, sys
p, size, names = sys.argv[1], sys.argv[2], sys.argv[3:]
t = open(p).read()
for n in names:
    t, k = re.subn(r'("name": "%s",\s*"kind": "[a-z_]+",\s*"size": )\d+' % re.escape(n),
                   lambda m: m.group(1) + size, t)
    assert k == 1, n
open(p, "w").write(t)
PY
    "$RESEAL" "$C4/checkpoint.json" || fail "resealing the manifest"
}

fresh
forge $(( (1 << 62) )) model.safetensors
run_t 1 "$CKPT_BIN" verify "$C4"
says "model.safetensors: size [0-9]* bytes, the manifest says 4611686018427387904"
run_train 0 "${T[@]}" --resume --project-dir "$P"
says "skipping .*checkpoint_4: .*the manifest says 4611686018427387904.*falling back"
cat "$WORK/err" | has -v "out of memory" || fail "a forged size ran out of memory"

# two 2^63-64-byte files whose sizes match the (sparse) files: the sum of the
# read area overflows. Needs a file system that allows such files (tmpfs).
big=9223372036854775744
if [ "$(id -u)" -eq 0 ] && mkdir -p "$WORK/mnt" && mount -t tmpfs -o size=64m,mode=0755 ckpt-test-hostile "$WORK/mnt" 2>/dev/null; then
    unmount() { umount "$WORK/mnt" 2>/dev/null || umount -l "$WORK/mnt" 2>/dev/null || true; }
    trap 'unmount; cleanup' EXIT
    cp -a "$base" "$WORK/mnt/p"
    P=$WORK/mnt/p
    C4=$P/checkpoints/checkpoint_4
    forge "$big" model.safetensors optimizer.safetensors
    truncate -s "$big" "$C4/model.safetensors" "$C4/optimizer.safetensors"
    run_train 0 "${T[@]}" --resume --project-dir "$P"
    says "skipping .*checkpoint_4: .*sizes add up .*falling back"
    cat "$WORK/err" | has -v "out of memory" || fail "overflowing sizes ran out of memory"

    # ---- read-only media --------------------------------------------------
    # a load needs no write: on a read-only file system without a lock file it
    # takes no lock and says so; with one it locks it read-only. The run then
    # fails writing its log, naming the read-only file system.
    rm -rf "$P"
    cp -a "$base" "$P"
    rm "$P/checkpoints/.lock"
    mount -o remount,ro "$WORK/mnt"
    run_train 3 "${T[@]}" --resume --project-dir "$P"
    says "read-only file system: loading without the project lock"
    says "metrics.jsonl: Read-only file system"
    # a checkpoint on read-only media starts another run
    run_train 0 "${T[@]}" --init-from "$P/checkpoints/checkpoint_3" --project-dir "$WORK/fromro"
    run_t 0 "$CKPT_BIN" verify "$P"
    mount -o remount,rw "$WORK/mnt"
    : >"$P/checkpoints/.lock"
    mount -o remount,ro "$WORK/mnt"
    run_train 3 "${T[@]}" --resume --project-dir "$P"
    cat "$WORK/err" | has -v "without the project lock" || fail "an existing lock was skipped"
    says "metrics.jsonl: Read-only file system"
else
    echo "note: no tmpfs mount (needs root): the overflowing-size and read-only cases were not run"
fi
echo "ok"
