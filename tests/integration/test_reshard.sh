#!/usr/bin/env bash
# Reshard through real mpirun jobs: ckpt train --shard-optimizer on 4
# processes (ZeRO-1: each keeps the AdamW moments of its share, saved as
# sharded tensors in optimizer-0000k-of-00004.safetensors), against the same
# run unsharded:
#  - the sharded and unsharded checkpoints hold the same tensors bit for bit
#    (ckpt diff assembles the chunks);
#  - a mid-run checkpoint of each, resumed on 2, 1 and 3 processes (the same
#    global batch of 48), sharded and unsharded: each pair ends bit for bit
#    equal, which holds only if the moments came back exactly;
#  - another global batch is refused with a message saying what would fit.
source "$(dirname "$0")/common.bash"

mpi_setup

assert_contains() { # FILE TEXT
    grep -qF -- "$2" "$1" || { cat "$1"; fail "$1 lacks: $2"; }
}
mpi() { # mpi P ARGS...
    local p=$1
    shift
    mpirun --oversubscribe -np "$p" "$CKPT_BIN" train "$@"
}
zcat "$CKPT_DATA" >"$WORK/all.csv"
head -n 480 "$WORK/all.csv" | gzip >"$WORK/small.csv.gz"
export CKPT_DATA=$WORK/small.csv.gz
# Global batch 48 = 4 x 12 = 3 x 16 = 2 x 24 = 1 x 48; 8 steps an epoch, 2 epochs,
# a checkpoint every 4 steps: checkpoint_0..3.
bs_for() { echo $((48 / $1)); }
ARGS=(--epochs 2 --quiet --workers 0 --save-every 4 --total-limit 0)

mpi 4 "${ARGS[@]}" --batch-size 12 --shard-optimizer --project-dir "$WORK/z4"
mpi 4 "${ARGS[@]}" --batch-size 12 --project-dir "$WORK/p4"
Z=$WORK/z4/checkpoints P=$WORK/p4/checkpoints
[ -f "$Z/checkpoint_3/optimizer-00004-of-00004.safetensors" ] || fail "no shard files in $Z/checkpoint_3"
# Unsharded, the replicated model and moments are written once, spread over
# the four ranks by the save plan: ranks 1..3 have their parts in shard
# files; rank 0's part (the small tensors come first) stays plain tensors of
# the objects' own files, which rank 0 writes.
for r in 2 3 4; do
    compgen -G "$P/checkpoint_3/*-0000$r-of-00004.safetensors" >/dev/null ||
        fail "the unsharded run's rank $((r - 1)) wrote no part of the replicated state"
done
grep -A1 '{"name": "model.safetensors"' "$P/checkpoint_3/checkpoint.json" | grep -q '"tensors": {$' ||
    fail "the unsharded run's rank 0 wrote no part of the replicated state"
"$CKPT_BIN" verify "$WORK/z4" | tee "$WORK/verify.out"
assert_contains "$WORK/verify.out" "4 processes"
"$CKPT_BIN" inspect "$Z/checkpoint_3" >"$WORK/inspect.out"
assert_contains "$WORK/inspect.out" "4 processes"
assert_contains "$WORK/inspect.out" "rank 2's chunks of tensors of model.safetensors"
for n in 1 3; do
    "$CKPT_BIN" diff "$Z/checkpoint_$n" "$P/checkpoint_$n" >"$WORK/diff.out" ||
        { cat "$WORK/diff.out"; fail "sharded and unsharded checkpoint_$n differ"; }
    assert_contains "$WORK/diff.out" "bit for bit"
done

# Resume the step-12 checkpoint (checkpoint_2, mid-epoch) on q processes.
for q in 2 1 3; do
    for kind in z p; do
        rm -rf "$WORK/$kind$q"
        mkdir -p "$WORK/$kind$q/checkpoints"
        cp -r "$WORK/${kind}4/checkpoints/checkpoint_2" "$WORK/$kind$q/checkpoints/"
        extra=()
        [ $kind = z ] && extra=(--shard-optimizer)
        mpi "$q" "${ARGS[@]}" --batch-size "$(bs_for "$q")" "${extra[@]}" --resume \
            --project-dir "$WORK/$kind$q"
    done
    last=$(ls "$WORK/z$q/checkpoints" | sort -t_ -k2 -n | tail -n1)
    [ "$last" = checkpoint_3 ] || fail "resume on $q ended at $last"
    if [ "$q" -gt 1 ]; then
        [ -f "$WORK/z$q/checkpoints/$last/optimizer-0000$q-of-0000$q.safetensors" ] ||
            fail "no shard files after resuming on $q"
    fi
    "$CKPT_BIN" diff "$WORK/z$q/checkpoints/$last" "$WORK/p$q/checkpoints/$last" >"$WORK/diff.out" ||
        { cat "$WORK/diff.out"; fail "resumed on $q: sharded and unsharded runs differ"; }
    assert_contains "$WORK/diff.out" "bit for bit"
done

# Another global batch: refused, saying what would fit.
rm -rf "$WORK/bad" && mkdir -p "$WORK/bad/checkpoints"
cp -r "$Z/checkpoint_2" "$WORK/bad/checkpoints/"
if mpi 2 "${ARGS[@]}" --batch-size 12 --shard-optimizer --resume --project-dir "$WORK/bad" \
    >"$WORK/bad.out" 2>&1; then
    fail "a resume with another global batch was accepted"
fi
assert_contains "$WORK/bad.out" "this run has 24 (2 x --batch-size 12): --batch-size 24 keeps it on 2 processes"
echo "PASS: reshard 4 -> 2, 1, 3 (sharded optimizer)"
