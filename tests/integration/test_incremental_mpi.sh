#!/usr/bin/env bash
# Incremental saves under a real 2-process Open MPI job: with --freeze, the
# save plan spreads only the model's frozen tensors over the ranks, so each
# rank's model shard file holds frozen bytes alone; the second save writes a
# second copy of it (link_copies 2, the default: no one copy serves every
# retained checkpoint) and every later save links it (same inode), while the
# trained layers stay in model.safetensors (written again); the job resumes
# from the linked checkpoint and verifies.
source "$(dirname "$0")/common.bash"
mpi_setup
zcat "$CKPT_DATA" >"$WORK/all.csv"
head -n 480 "$WORK/all.csv" | gzip >"$WORK/small.csv.gz"
export CKPT_DATA=$WORK/small.csv.gz
FREEZE=(--freeze 'fc1.*' --freeze 'fc2.*')
inode() { stat -c %i "$1"; }
proj=$WORK/p
run_rc 0 mpirun --oversubscribe -np 2 "$CKPT_BIN" train --epochs 1 --batch-size 8 --workers 0 \
    --save-every 5 --total-limit 0 --project-dir "$proj" "${FREEZE[@]}"
cks=$proj/checkpoints
last=$(ls "$cks" | sed -n 's/^checkpoint_\([0-9]*\)$/\1/p' | sort -n | tail -n1)
[ -n "$last" ] && [ "$last" -ge 2 ] || fail "expected at least three checkpoints: $(ls "$cks")"
for r in 1 2; do
    f=model-0000$r-of-00002.safetensors
    [ -f "$cks/checkpoint_0/$f" ] || fail "checkpoint_0 has no $f: $(ls "$cks/checkpoint_0")"
    [ "$(inode "$cks/checkpoint_0/$f")" != "$(inode "$cks/checkpoint_1/$f")" ] ||
        fail "rank $((r - 1))'s frozen file $f has no second copy"
    [ "$(inode "$cks/checkpoint_1/$f")" = "$(inode "$cks/checkpoint_$last/$f")" ] ||
        fail "rank $((r - 1))'s frozen file $f was written again, not linked"
done
[ "$(inode "$cks/checkpoint_0/model.safetensors")" != \
    "$(inode "$cks/checkpoint_$last/model.safetensors")" ] || fail "the trained layers were linked"
pct=$(sed -n 's/^bytes written per save: .* on average (\([0-9.]*\)%.*/\1/p' "$WORK/out" | head -n1)
if [ -n "$pct" ]; then
    # the second copy is one full write among the later saves
    awk -v p="$pct" 'BEGIN { exit !(p < 40) }' || fail "later saves wrote $pct% of the first's bytes"
fi
run_rc 0 "$CKPT_BIN" verify "$proj"
run_rc 0 mpirun --oversubscribe -np 2 "$CKPT_BIN" train --epochs 2 --batch-size 8 --workers 0 \
    --save-every 5 --total-limit 0 --project-dir "$proj" --resume "${FREEZE[@]}" --quiet
run_rc 0 "$CKPT_BIN" verify "$proj"
echo "ok: 2 ranks: each rank's frozen model file linked at every save (${pct:-?}% written per later save), resume verifies"
