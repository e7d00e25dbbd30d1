#!/usr/bin/env bash
# Extending and changing a run with ckpt train --resume:
#  - a larger --epochs continues the run to the new end, on the new run's
#    learning-rate schedule taken up at the saved step (the first resumed
#    step already uses it), and the next checkpoints record the new --epochs;
#  - another global batch is refused naming the flag (--batch-size N), exit 2
#    as docs/CLI.md says, nothing saved; with --drop-data-position the run
#    continues at the saved step, the loader at the next epoch's start;
#  - a progress bar is redrawn only on a terminal without --log-every
#    (test_mpi_regroup: nor in an MPI job).
source "$(dirname "$0")/common.bash"

P=$WORK/p
run_rc 0 "$CKPT_BIN" train --epochs 1 --save-every 20 --quiet --project-dir "$P"
grep -q '"step":46,' "$P/logs/metrics.jsonl" || fail "the first run did not reach step 46"

# ---- a longer run: --epochs 2 continues from step 46 to 92
run_rc 0 "$CKPT_BIN" train --epochs 2 --save-every 20 --project-dir "$P" --resume
grep -q "^--epochs 2 (the checkpoint's run had 1): the run now ends at step 92" "$WORK/out" \
    || { cat "$WORK/out" "$WORK/err" >&2; fail "no note on the longer run"; }
grep -q "resumed from .*checkpoint_2 at step 46" "$WORK/out" || fail "not resumed at 46"
last=$(latest_checkpoint "$P")
"$CKPT_BIN" ls --json "$last" | python3 -c '
import json, sys
assert json.load(sys.stdin)["checkpoints"][0]["step"] == 92' || fail "the longer run did not end at 92"
# the next saves record the new setting
"$CKPT_BIN" inspect "$last" | has "^    epochs *= 2$" || fail "the run config still says 1 epoch"
# the learning rate of the first resumed step is the new schedule's (warmup
# 92/20 = 4 steps, cosine to 0 at 92), not the old one's end (0)
python3 - "$P/logs/metrics.jsonl" <<'PY' || fail "learning rate after the resume"
import json, math, sys
lines = {d["step"]: d for d in map(json.loads, open(sys.argv[1]))}
w, T = 4, 92
for s in (47, 60, 92):
    want = 0.002 * 0.5 * (1 + math.cos(math.pi * (s - 1 - w) / (T - w)))
    got = lines[s]["lr"]
    assert abs(got - want) <= 1e-15 + 1e-12 * want, (s, got, want)
assert sorted(lines) == list(range(1, 93)), "the log does not hold steps 1..92 once each"
PY
# resumed again with the same settings: no note, nothing to do
run_rc 0 "$CKPT_BIN" train --epochs 2 --save-every 20 --project-dir "$P" --resume
! grep -q "the checkpoint's run had" "$WORK/out" || fail "a note without a change"

# ---- another global batch: refused naming the flag, exit 2, nothing saved
before=$(ls "$P/checkpoints")
run_rc 2 "$CKPT_BIN" train --epochs 2 --batch-size 16 --project-dir "$P" --resume --quiet
grep -q "global batch of 32 (1 x --batch-size 32), this run has 16 (1 x --batch-size 16): --batch-size 32 keeps it on 1 process, or --drop-data-position" \
    "$WORK/err" || { cat "$WORK/err" >&2; fail "the refusal does not name --batch-size"; }
! grep -q "use batch_size" "$WORK/err" || fail "the library's hint instead of the flag"
[ "$(ls "$P/checkpoints")" = "$before" ] || fail "a refused resume changed the checkpoints"
run_rc 2 "$CKPT_BIN" train --drop-data-position --project-dir "$WORK/fresh"
grep -q "applies to a --resume only" "$WORK/err" || fail "--drop-data-position without --resume"

# ---- --drop-data-position: step 92 carries over, the loader starts epoch 3
# (0-based 2: the checkpoint ended epoch 2 at its last batch), 93 batches of
# 16 an epoch; the run ends at 3 x 93 = 279 steps
cp -r "$P" "$WORK/q"
run_rc 0 "$CKPT_BIN" train --epochs 3 --batch-size 16 --save-every 50 --project-dir "$WORK/q" \
    --resume --drop-data-position --log-every 1000
grep -q "the global batch changed from 32 to 16 (--drop-data-position): the data loader starts epoch 3" \
    "$WORK/out" || { cat "$WORK/out" "$WORK/err" >&2; fail "no note on the dropped position"; }
grep -q "resumed from .* at step 92" "$WORK/out" || fail "the step did not carry over"
python3 - "$WORK/q/logs/metrics.jsonl" <<'PY' || fail "the run after --drop-data-position"
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
assert [d["step"] for d in lines] == list(range(1, 280)), "steps are not 1..279"
assert lines[92]["step"] == 93 and lines[92]["epoch"] == 2, lines[92]
PY
run_rc 0 "$CKPT_BIN" verify "$WORK/q"

# ---- the progress bar: redrawn on a terminal only without --log-every and
# outside an MPI job (script gives the run a pseudo-terminal)
if command -v script >/dev/null 2>&1; then
    redraws() { # the count of "\repoch" (a redraw; log lines end "\r\n" on a pty)
        python3 -c 'import sys; print(sys.stdin.buffer.read().count(b"\repoch"))'
    }
    n=$(script -qec "$CKPT_BIN train --epochs 1 --save-every 0 --project-dir $WORK/t1" /dev/null | redraws)
    [ "$n" -gt 0 ] || fail "no progress bar on a terminal"
    n=$(script -qec "$CKPT_BIN train --epochs 1 --save-every 0 --project-dir $WORK/t2 --log-every 10" \
        /dev/null | redraws)
    [ "$n" = 0 ] || fail "--log-every on a terminal still redraws ($n)"
fi
echo "ok"
