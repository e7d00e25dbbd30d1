#!/usr/bin/env bash
# A full disk during a save (CKPT_FAULT="write:N:ENOSPC" makes the library's
# N-th write fail): ckpt train says "save failed: ... No space left on device",
# exits 3, leaves the earlier checkpoints intact and no half-written folder, and
# --resume then finishes exactly like an uninterrupted run. The same for a
# failing fsync (EIO) and rename.
source "$(dirname "$0")/common.bash"

ref=$WORK/ref
run_rc 0 "${TRAIN[@]}" --epochs 1 --save-every 10 --project-dir "$ref"
ref_final=$(latest_checkpoint "$ref")

# Finds an N whose fault hits a save after at least one complete checkpoint,
# checks the failure, then resumes without the fault.
check_fault() {
    local kind=$1 errname=$2 message=$3 n run rc found=0
    for n in 1 2 3 5 8 12 20 30 45 70 100 150 220 330 500 750; do
        run=$WORK/$kind-$n
        rc=0
        CKPT_FAULT="$kind:$n:$errname" "${TRAIN[@]}" --epochs 1 --save-every 10 --project-dir "$run" \
            >"$WORK/out" 2>"$WORK/err" || rc=$?
        [ "$rc" -eq 0 ] && break # N beyond the run's calls: nothing failed
        [ "$rc" -eq 3 ] || { cat "$WORK/err" >&2; fail "$kind:$n: exit $rc, expected 3"; }
        grep -q "^ckpt: save failed: .*$message" "$WORK/err" \
            || { cat "$WORK/err" >&2; fail "$kind:$n: no clear message"; }
        if ls "$run/checkpoints" 2>/dev/null | has '^checkpoint_'; then
            found=1
            break
        fi
    done
    [ "$found" -eq 1 ] || fail "$kind: no N made a save fail after a complete checkpoint"
    ! ls -A "$run/checkpoints" | has '\.tmp' || fail "$kind:$n: a temporary folder was left"
    run_rc 0 "$CKPT_BIN" verify "$run"
    local before
    before=$(ls "$run/checkpoints" | grep -c '^checkpoint_')
    run_rc 0 "${TRAIN[@]}" --epochs 1 --save-every 10 --project-dir "$run" --resume
    run_rc 0 "$CKPT_BIN" diff "$ref_final" "$(latest_checkpoint "$run")"
    cmp "$ref/logs/metrics.jsonl" "$run/logs/metrics.jsonl" || fail "$kind: metrics logs differ"
    echo "$kind:$n:$errname: failed after $before checkpoint(s), resumed exactly"
}

check_fault write ENOSPC "No space left on device"
check_fault fsync EIO "Input/output error"
check_fault rename EIO "Input/output error"
echo "ok: failed saves leave earlier checkpoints intact and resume exactly"
