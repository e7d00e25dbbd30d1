#!/usr/bin/env bash
# ckpt train survives kill -9 at random moments: killed at least 10 times,
# several of them during a save (each restart saves every 1, 2 or 4 steps, and
# every third kill waits for a save's temporary folder to appear), and
# resumed each time, the final checkpoint equals an uninterrupted run's bit for
# bit, and so do the metrics log and the accuracy. After every kill, each
# visible checkpoint verifies.
# With CKPT_KILL_ASYNC=1 (test_kill_resume_async.sh) every run saves with
# --async, and the aimed kills wait for the background thread to be writing
# a file into the temporary folder; CKPT_KILLS sets the number of kills.
# With CKPT_KILL_FREEZE=1 (test_kill_resume_freeze.sh) every run freezes the
# first two layers (--freeze): each save links the frozen file of the one
# before, and kills land while it does.
source "$(dirname "$0")/common.bash"
ASYNC=()
[ "${CKPT_KILL_ASYNC:-0}" = 1 ] && ASYNC=(--async)
[ "${CKPT_KILL_FREEZE:-0}" = 1 ] && ASYNC+=(--freeze 'fc1.*' --freeze 'fc2.*')
KILLS=${CKPT_KILLS:-10}
# what an aimed kill waits for: a save's temporary folder, or (async) a file
# the background thread is writing in it
aim="checkpoints/.checkpoint_*.tmp*"
[ "${CKPT_KILL_ASYNC:-0}" = 1 ] && aim="$aim/*.safetensors"

ref=$WORK/ref
start=$(date +%s%N)
run_rc 0 "${TRAIN[@]}" "${ASYNC[@]}" --workers 2 --project-dir "$ref"
elapsed_ms=$(( ($(date +%s%N) - start) / 1000000 ))
ref_final=$(latest_checkpoint "$ref")
ref_acc=$(grep "test accuracy" "$WORK/out") || fail "no accuracy line"

# Kill delays of 3..15% of the uninterrupted run, so a run is killed about ten
# times before it ends, whatever the build's speed; if one ends sooner, another
# round starts in a fresh folder until 10 kills have happened.
RANDOM=${KILL_SEED:-$$}
kills=0 mid_save=0 rounds=0
while [ "$kills" -lt "$KILLS" ]; do
    rounds=$((rounds + 1))
    run=$WORK/run$rounds
    while :; do
        workers=$((RANDOM % 3))             # the data order must not depend on it
        every=$(( 1 << (RANDOM % 3) ))      # nor the steps saved at
        args=("${TRAIN[@]}" "${ASYNC[@]}" --workers "$workers" --save-every "$every" --project-dir "$run" --resume)
        if [ "$kills" -ge "$KILLS" ]; then
            run_rc 0 "${args[@]}"
            cp "$WORK/out" "$WORK/train.out"
            break
        fi
        "${args[@]}" >"$WORK/train.out" 2>&1 &
        pid=$!
        if [ $((kills % 3)) -eq 2 ]; then
            # aimed: kill as soon as a save's temporary folder (async: a
            # file in it) shows up
            for _ in $(seq 1 100000); do
                compgen -G "$run/$aim" >/dev/null && break
                kill -0 "$pid" 2>/dev/null || break
            done
        else
            delay_ms=$(( elapsed_ms * (3 + RANDOM % 13) / 100 ))
            sleep "$(printf '%d.%03d' $((delay_ms / 1000)) $((delay_ms % 1000)))"
        fi
        kill -9 "$pid" 2>/dev/null || true
        rc=0
        wait "$pid" || rc=$?
        [ "$rc" -eq 0 ] && break
        if [ "$rc" -ne 137 ]; then
            cat "$WORK/train.out" >&2
            fail "ckpt train exited $rc (expected 0 or a kill)"
        fi
        kills=$((kills + 1))
        if ls -A "$run/checkpoints" 2>/dev/null | has '^\.checkpoint_.*\.tmp'; then
            mid_save=$((mid_save + 1))
        fi
        if ls "$run/checkpoints" 2>/dev/null | has '^checkpoint_'; then
            run_rc 0 "$CKPT_BIN" verify "$run"
        fi
    done
    final=$(latest_checkpoint "$run")
    run_rc 0 "$CKPT_BIN" diff "$ref_final" "$final"
    grep -q "bit for bit" "$WORK/out" || fail "diff did not say bit for bit"
    cmp "$ref/logs/metrics.jsonl" "$run/logs/metrics.jsonl" || fail "metrics logs differ"
    [ "$(grep "test accuracy" "$WORK/train.out")" = "$ref_acc" ] || fail "accuracy differs"
done
[ "$mid_save" -ge 1 ] || fail "no kill landed during a save"
echo "ok: $kills kills ($mid_save left a save half-done) in $rounds round(s); final checkpoints equal bit for bit"
