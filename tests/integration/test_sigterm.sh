#!/usr/bin/env bash
# SIGTERM, SIGUSR1 (what Slurm sends with --signal before a kill) and SIGINT
# make ckpt train save a checkpoint at the current step, mid-epoch, and exit 0 ("preempted at step N, checkpoint saved: DIR"); resuming from it
# ends exactly where an uninterrupted run ends.
source "$(dirname "$0")/common.bash"

ref=$WORK/ref
run_rc 0 "${TRAIN[@]}" --save-every 0 --project-dir "$ref"
ref_final=$(latest_checkpoint "$ref")
ref_acc=$(grep "test accuracy" "$WORK/out")

# Sends signal $1 once the run in $2 has logged at least $3 steps; checks the
# preemption message and that the checkpoint holds that very step.
interrupt() {
    local sig=$1 run=$2 after=$3 pid rc=0 lines n dir
    "${TRAIN[@]}" --save-every 0 --project-dir "$run" --resume >"$WORK/sig.out" 2>"$WORK/sig.err" &
    pid=$!
    for _ in $(seq 1 6000); do
        lines=0
        [ -f "$run/logs/metrics.jsonl" ] && lines=$(wc -l <"$run/logs/metrics.jsonl")
        [ "$lines" -ge "$after" ] && break
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.01
    done
    kill -"$sig" "$pid" || fail "SIG$sig: the run ended before the signal"
    wait "$pid" || rc=$?
    [ "$rc" -eq 0 ] || { cat "$WORK/sig.err" >&2; fail "SIG$sig: exit $rc, expected 0"; }
    grep -q "^preempted at step [0-9]*, checkpoint saved: " "$WORK/sig.out" \
        || { cat "$WORK/sig.out" >&2; fail "SIG$sig: no preemption message"; }
    n=$(sed -n 's/^preempted at step \([0-9]*\), checkpoint saved: .*/\1/p' "$WORK/sig.out")
    dir=$(sed -n 's/^preempted at step [0-9]*, checkpoint saved: //p' "$WORK/sig.out")
    [ "$n" -lt 92 ] || fail "SIG$sig: the run ended before the signal"
    [ "$dir" = "$(latest_checkpoint "$run")" ] || fail "SIG$sig: saved to $dir, not the latest"
    run_rc 0 "$CKPT_BIN" inspect "$dir"
    grep -q "step $n," "$WORK/out" || fail "SIG$sig: checkpoint is not at step $n"
    [ "$(wc -l <"$run/logs/metrics.jsonl")" -eq "$n" ] || fail "SIG$sig: metrics log not at step $n"
    run_rc 0 "$CKPT_BIN" verify "$dir"
    echo "SIG$sig: preempted at step $n"
}

run=$WORK/run
interrupt TERM "$run" 10
interrupt USR1 "$run" 25
interrupt INT "$run" 40
run_rc 0 "${TRAIN[@]}" --save-every 0 --project-dir "$run" --resume
[ "$(grep "test accuracy" "$WORK/out")" = "$ref_acc" ] || fail "accuracy differs"
run_rc 0 "$CKPT_BIN" diff "$ref_final" "$(latest_checkpoint "$run")"
cmp "$ref/logs/metrics.jsonl" "$run/logs/metrics.jsonl" || fail "metrics logs differ"
echo "ok: SIGTERM, SIGUSR1 and SIGINT checkpoints resume exactly"
