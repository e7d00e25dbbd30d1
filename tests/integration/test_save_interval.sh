#!/usr/bin/env bash
# ckpt train --save-every-seconds: a checkpoint once that many seconds passed
# since the last save (ckpt_should_save), on top of --save-every; a run with
# time-based saves ends exactly like one without; bad values are usage errors.
source "$(dirname "$0")/common.bash"
# A quarter of the data set (400 training rows: 12 steps an epoch) keeps the
# save after every step short.
zcat "$CKPT_DATA" >"$WORK/all.csv"
head -n 480 "$WORK/all.csv" | gzip >"$WORK/small.csv.gz"
export CKPT_DATA=$WORK/small.csv.gz

ref=$WORK/ref
run_rc 0 "$CKPT_BIN" train --epochs 1 --save-every 0 --quiet --project-dir "$ref"
ref_final=$(latest_checkpoint "$ref")

# An interval shorter than any step: a save after every step (12 in one epoch).
run=$WORK/run
run_rc 0 "$CKPT_BIN" train --epochs 1 --save-every 0 --save-every-seconds 0.000001 \
    --total-limit 0 --quiet --project-dir "$run"
n=$(find "$run/checkpoints" -maxdepth 1 -name 'checkpoint_*' | wc -l)
steps=$(wc -l <"$run/logs/metrics.jsonl")
[ "$n" -eq "$steps" ] || fail "expected a checkpoint after each of $steps steps, found $n"
run_rc 0 "$CKPT_BIN" diff "$ref_final" "$(latest_checkpoint "$run")"

# A long interval: only the final save.
long=$WORK/long
run_rc 0 "$CKPT_BIN" train --epochs 1 --save-every 0 --save-every-seconds 3600 \
    --total-limit 0 --quiet --project-dir "$long"
n=$(find "$long/checkpoints" -maxdepth 1 -name 'checkpoint_*' | wc -l)
[ "$n" -eq 1 ] || fail "expected only the final checkpoint, found $n"

for bad in -1 nan abc; do
    run_rc 2 "$CKPT_BIN" train --save-every-seconds "$bad" --project-dir "$WORK/bad"
    grep -q "save-every-seconds" "$WORK/err" || fail "no message naming --save-every-seconds"
done
echo "ok: --save-every-seconds saves on time and changes nothing else ($steps checkpoints)"
