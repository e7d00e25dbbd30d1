#!/usr/bin/env bash
# ckpt train under mpirun with another number of processes than the run that
# saved the checkpoint:
#  - 2 ranks -> 3 with the same --batch-size changes the global batch (16 ->
#    24): refused on every rank naming --batch-size (exit 2), nothing saved;
#  - with --drop-data-position the 3 ranks continue at the saved step, the
#    loader at the next epoch's start, and the result verifies;
#  - a rank of an MPI job logs lines, never redraws a progress bar, although
#    Open MPI gives it a pseudo-terminal.
source "$(dirname "$0")/common.bash"

mpi_setup

zcat "$CKPT_DATA" >"$WORK/all.csv"
head -n 480 "$WORK/all.csv" | gzip >"$WORK/small.csv.gz"
export CKPT_DATA=$WORK/small.csv.gz
ARGS=(--batch-size 8 --workers 0 --save-every 10)
P=$WORK/p

# 400 training rows: 25 global batches of 16 on two ranks
run_rc 0 mpirun --oversubscribe -np 2 "$CKPT_BIN" train --epochs 1 --quiet "${ARGS[@]}" --project-dir "$P"
before=$(ls "$P/checkpoints")

run_rc 2 mpirun --oversubscribe -np 3 "$CKPT_BIN" train --epochs 2 --quiet "${ARGS[@]}" \
    --project-dir "$P" --resume
[ "$(grep -c "global batch of 16 (2 x --batch-size 8), this run has 24 (3 x --batch-size 8): no --batch-size on 3 processes keeps it, or --drop-data-position" "$WORK/err")" = 3 ] \
    || { cat "$WORK/err" >&2; fail "not every rank names --batch-size"; }
[ "$(ls "$P/checkpoints")" = "$before" ] || fail "a refused resume changed the checkpoints"

# 16 global batches of 24 an epoch: from step 25 (the end of epoch 1) the
# loader starts epoch 2 and the run ends at 2 x 16 = 32
run_rc 0 mpirun --oversubscribe -np 3 "$CKPT_BIN" train --epochs 2 "${ARGS[@]}" --log-every 1 \
    --project-dir "$P" --resume --drop-data-position
grep -q "the global batch changed from 16 to 24 (--drop-data-position): the data loader starts epoch 2" \
    "$WORK/out" || { cat "$WORK/out" "$WORK/err" >&2; fail "no note on the dropped position"; }
[ "$(grep -c "resumed from .* at step 25" "$WORK/out")" = 3 ] || fail "not every rank resumed at 25"
python3 - "$P/logs/metrics.jsonl" <<'PY' || fail "the run after --drop-data-position"
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
assert [d["step"] for d in lines] == list(range(1, 33)), [d["step"] for d in lines]
assert all(d["epoch"] == 1 for d in lines[25:]), lines[25:]
PY
run_rc 0 "$CKPT_BIN" verify "$P"
"$CKPT_BIN" ls --json "$P" | python3 -c '
import json, sys
c = json.load(sys.stdin)["checkpoints"][-1]
assert c["step"] == 32 and c["num_processes"] == 3, c' || fail "the last checkpoint is not step 32 of 3 ranks"

# ---- a rank has a pseudo-terminal under mpirun (script gives mpirun one):
# progress lines, no redrawn bar
if command -v script >/dev/null 2>&1; then
    script -qec "mpirun --oversubscribe -np 1 $CKPT_BIN train --epochs 1 --workers 0 --save-every 0 --project-dir $WORK/t" \
        /dev/null >"$WORK/tty"
    python3 - "$WORK/tty" <<'PY' || fail "a rank of an MPI job redraws a progress bar"
import sys
d = open(sys.argv[1], "rb").read()
assert b"epoch 1 step 12/12" in d, d[-400:]
assert d.count(b"\repoch") == 0, d[-400:]
PY
fi
echo "ok"
