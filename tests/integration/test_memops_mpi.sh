#!/usr/bin/env bash
# Memory ckpt cannot touch, under real mpirun (tests/progs/mpi/memops_run.c):
# parameters and ZeRO-1-sharded external AdamW state on an emulated device
# whose pages are PROT_NONE outside the ops' own copies. Checked:
#  - a save of 2 ranks (sync, then async) writes the same files, byte for
#    byte, as the same state held in host memory, and each rank reads about
#    half of the device state through to_host (its rows of the replicated
#    tensor, its share of the optimizer state), never more than a piece per
#    call, never from another thread;
#  - a load on 2 ranks, and on 3 (resharded), puts the parameters whole and
#    each rank's share of the state back through from_host only (the
#    replicated tensor streamed to the ranks piece by piece);
#  - the checkpoint verifies and exports as the host one does.
source "$(dirname "$0")/common.bash"

mpi_setup
PROG=$CKPT_BUILD_DIR/tests/memops_run
[ -x "$PROG" ] || fail "$PROG is not built"

# job P DIR MODE: runs it, checks every rank's status line and its ops
# counters; MAXFRAC: the most of the device state a rank may read (to_host).
job() {
    local p=$1 dir=$2 mode=$3 out=$WORK/$(basename "$2").$1.$3.out r line
    mkdir -p "$dir"
    timeout 300 mpirun --oversubscribe -np "$p" "$PROG" "$dir" "$mode" >"$out" 2>"$WORK/err" ||
        { cat "$out" "$WORK/err" >&2; fail "P=$p $mode: the job failed"; }
    for ((r = 0; r < p; r++)); do
        line=$(grep "^rank $r $mode " "$out") || fail "P=$p $mode: rank $r printed nothing"
        [[ $line == "rank $r $mode CKPT_OK "* ]] || fail "P=$p $mode: $line"
        if [ "$mode" = load ]; then
            grep -q "^rank $r values saved$" "$out" || fail "P=$p load: rank $r: $(grep "^rank $r values" "$out")"
        fi
        read -r _ _ _ th _ fh _ total _ errors <<<"$(grep "^rank $r to_host " "$out")"
        [ "$errors" = 0 ] || fail "P=$p $mode: rank $r: $errors bad ops calls"
        case $mode in
        save) # two saves of about 1/P of the device state each, a little more for row cuts
            [ "$th" -gt 0 ] && [ "$th" -le $((total * 12 / 10)) ] ||
                fail "P=$p $mode: rank $r read $th of $total bytes through to_host"
            [ "$fh" = 0 ] || fail "P=$p $mode: rank $r wrote $fh bytes while saving" ;;
        load) # the parameters whole (a third of it), its share of the state
            [ "$th" = 0 ] || fail "P=$p load: rank $r read $th bytes while loading"
            [ "$fh" -ge $((total / 3)) ] && [ "$fh" -le $((total * 8 / 10)) ] ||
                fail "P=$p load: rank $r wrote $fh of $total bytes through from_host" ;;
        esac
    done
}

same_checkpoints() { # every state file of $1 is in $2 with the same bytes
    local f n=0
    for f in "$1"/*.safetensors; do
        cmp -s "$f" "$2/$(basename "$f")" || fail "$(basename "$f") differs between $1 and $2"
        n=$((n + 1))
    done
    [ "$n" -ge 4 ] || fail "only $n state files in $1"
}

job 2 "$WORK/host" host
job 2 "$WORK/dev" save
h=$(latest_checkpoint "$WORK/host")
d=$WORK/dev/checkpoints/checkpoint_0
a=$WORK/dev/checkpoints/checkpoint_1
ls "$d" | grep -q -- '-of-00002.safetensors' || fail "no shard files in $d: $(ls "$d")"
same_checkpoints "$h" "$d"
same_checkpoints "$h" "$a"
run_rc 0 "$CKPT_BIN" verify "$a"
job 2 "$WORK/dev" load
rm -rf "$a"
job 3 "$WORK/dev" load
run_rc 0 "$CKPT_BIN" export "$h" "$WORK/exp-host"
run_rc 0 "$CKPT_BIN" export "$d" "$WORK/exp-dev"
for f in "$WORK/exp-host"/*; do
    cmp -s "$f" "$WORK/exp-dev/$(basename "$f")" || fail "export: $(basename "$f") differs"
done
echo "ok: device state saved (sync, async) and loaded (2 and 3 ranks) through its ops only"
