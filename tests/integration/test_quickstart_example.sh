#!/usr/bin/env bash
# examples/quickstart.c (the README's API example) runs, and a run of it
# killed with SIGKILL and started again ends with the very same weights.
source "$(dirname "$0")/common.bash"

ex=${CKPT_BUILD_DIR:?set CKPT_BUILD_DIR}/example_quickstart
[ -x "$ex" ] || fail "$ex not built"
run_rc 0 "$ex" "$WORK/a"
want=$(tail -1 "$WORK/out")
[[ $want == "w = ["* ]] || fail "unexpected output: $want"
[ "$(grep -c ', saved ' "$WORK/out")" -eq 12 ] || fail "expected 12 saves"
# the scheduler is prepared as a scheduler, not registered as a custom object:
# it is scheduler.safetensors, and export writes it as scheduler.bin
last=$(latest_checkpoint "$WORK/a")
[ -f "$last/scheduler.safetensors" ] || fail "no scheduler.safetensors in $last"
[ ! -e "$last/custom_checkpoint_0.safetensors" ] || fail "the scheduler is saved as a custom object"
run_rc 0 "$CKPT_BIN" export "$last" "$WORK/exp"
[ -f "$WORK/exp/scheduler.bin" ] || fail "export dropped the scheduler: $(ls "$WORK/exp")"

# killed as soon as its first checkpoint exists, then run again
"$ex" "$WORK/b" >/dev/null 2>&1 &
pid=$!
for _ in $(seq 1 100000); do
    compgen -G "$WORK/b/checkpoints/checkpoint_*" >/dev/null && break
    kill -0 "$pid" 2>/dev/null || break
done
kill -9 "$pid" 2>/dev/null || true
wait "$pid" || true
run_rc 0 "$ex" "$WORK/b"
grep -q "^resumed from " "$WORK/out" || fail "the second run did not resume"
[ "$(tail -1 "$WORK/out")" = "$want" ] || fail "resumed run ended with $(tail -1 "$WORK/out"), not $want"

# a finished run resumes at its end and changes nothing
run_rc 0 "$ex" "$WORK/a"
[ "$(tail -1 "$WORK/out")" = "$want" ] || fail "re-running a finished run changed it"
echo "ok: quickstart runs and resumes exactly ($want)"
