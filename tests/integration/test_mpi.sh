#!/usr/bin/env bash
# ckpt train under real mpirun jobs of 1, 2 and 4 processes:
#  - the whole job (mpirun and every rank) is killed with SIGKILL at random
#    moments, some aimed at a save in progress, and resumed each time: the
#    final checkpoint equals an uninterrupted run's with the same process
#    count bit for bit (ckpt diff), and so does the metrics log;
#  - a fault on one rank only (EIO on its fsync, then ENOSPC on its write):
#    no new checkpoint, the previous one intact, verified and resumed from,
#    and every rank reports the same error, naming that rank;
#  - one rank's file corrupted in the newest checkpoint: every rank falls back
#    to the same older checkpoint, and the run still ends bit for bit equal;
#  - SIGTERM to every rank: each saves at the same step and exits 0.
# The suite runs it as several tests side by side (tests/CMakeLists.txt):
# CKPT_MPI_PROCS selects the process counts of the kill part (default
# "1 2 4"; empty: none), CKPT_MPI_REST=0 skips the rest.
source "$(dirname "$0")/common.bash"
PROCS=${CKPT_MPI_PROCS-1 2 4}

mpi_setup

mpi() { # mpi P ARGS...: ckpt train on P processes
    local p=$1
    shift
    mpirun --oversubscribe -np "$p" "$CKPT_BIN" train "$@"
}
# A quarter of the data set (400 training rows) keeps each job short: 50
# steps of 8 samples on one process, 25 global batches of 16 on two, 12 of
# 32 on four.
zcat "$CKPT_DATA" >"$WORK/all.csv"
head -n 480 "$WORK/all.csv" | gzip >"$WORK/small.csv.gz"
export CKPT_DATA=$WORK/small.csv.gz
ARGS=(--epochs 1 --batch-size 8 --quiet --workers 0)

# kill_job MPIRUN_PID: SIGKILL to the ranks and mpirun at once, then waits
# until every one is gone (no rank may go on writing after "the crash").
kill_job() {
    local mp=$1 ranks
    ranks=$(pgrep -P "$mp" || true)
    kill -9 $ranks "$mp" 2>/dev/null || true
    wait "$mp" 2>/dev/null || true
    for r in $ranks; do
        while kill -0 "$r" 2>/dev/null; do sleep 0.05; done
    done
}

# ---- kill -9 and resume, for 1, 2 and 4 processes --------------------------
total_kills=0 mid_save=0 aim_misses=0 expected=0
RANDOM=${KILL_SEED:-$$}
for p in $PROCS; do
    ref=$WORK/ref$p
    start=$(date +%s%N)
    run_rc 0 mpi "$p" "${ARGS[@]}" --save-every 4 --project-dir "$ref"
    elapsed_ms=$(( ($(date +%s%N) - start) / 1000000 ))
    ref_final=$(latest_checkpoint "$ref")
    kills_for=$(( p == 1 ? 1 : 2 + (p == 2) ))
    expected=$((expected + kills_for))
    run=$WORK/run$p
    k=0
    while :; do
        every=$(( 1 << (RANDOM % 3) ))  # the steps saved at must not matter
        args=("${ARGS[@]}" --save-every "$every" --project-dir "$run" --resume)
        if [ "$k" -ge "$kills_for" ]; then
            run_rc 0 mpi "$p" "${args[@]}"
            break
        fi
        # (killed anyway: no leak check, so no slow full-stack unwinding)
        ASAN_OPTIONS=detect_leaks=0 mpirun --oversubscribe -np "$p" "$CKPT_BIN" train "${args[@]}" \
            >"$WORK/train.out" 2>&1 &
        mp=$!
        if [ $((k % 2)) -eq 1 ]; then
            # aimed: as soon as a save's temporary folder shows up
            for _ in $(seq 1 200000); do
                compgen -G "$run/checkpoints/.checkpoint_*.tmp*" >/dev/null && break
                kill -0 "$mp" 2>/dev/null || break
            done
        else
            delay_ms=$(( elapsed_ms * (20 + RANDOM % 50) / 100 ))
            sleep "$(printf '%d.%03d' $((delay_ms / 1000)) $((delay_ms % 1000)))"
        fi
        if ! kill -0 "$mp" 2>/dev/null; then # it finished first: fine, one more round
            wait "$mp" || { cat "$WORK/train.out" >&2; fail "P=$p: a run exited with an error"; }
            rm -rf "$run"
            continue
        fi
        kill_job "$mp"
        k=$((k + 1))
        total_kills=$((total_kills + 1))
        if ls -A "$run/checkpoints" 2>/dev/null | has '^\.checkpoint_.*\.tmp'; then
            mid_save=$((mid_save + 1))
        elif [ $((k % 2)) -eq 0 ] && [ "$aim_misses" -lt 6 ]; then
            # an aimed kill that the save outran (a loaded machine): aim again
            aim_misses=$((aim_misses + 1))
            k=$((k - 1))
        fi
        if ls "$run/checkpoints" 2>/dev/null | has '^checkpoint_'; then
            run_rc 0 "$CKPT_BIN" verify "$run"
        fi
    done
    run_rc 0 "$CKPT_BIN" diff "$ref_final" "$(latest_checkpoint "$run")"
    grep -q "bit for bit" "$WORK/out" || fail "P=$p: diff did not say bit for bit"
    cmp "$ref/logs/metrics.jsonl" "$run/logs/metrics.jsonl" || fail "P=$p: metrics logs differ"
    manifest=$(latest_checkpoint "$run")/checkpoint.json
    grep -q "\"num_processes\": $p," "$manifest" || fail "P=$p: manifest does not record $p processes"
    n_rng=$(ls "$(latest_checkpoint "$run")" | grep -c '^random_states_[0-9]*\.safetensors$')
    [ "$n_rng" -eq "$p" ] || fail "P=$p: $n_rng random state files, expected one per rank"
done
if [ -n "$PROCS" ]; then
    [ "$total_kills" -ge "$expected" ] || fail "only $total_kills kills"
    # (every second kill of a job is aimed at a save: only P=1 has one kill)
    [ "$expected" -le 1 ] || [ "$mid_save" -ge 1 ] || fail "no kill landed during a save"
    echo "ok: $total_kills kills of whole jobs ($mid_save during a save); P=$PROCS resumed bit for bit"
fi
[ "${CKPT_MPI_REST:-1}" = 1 ] || exit 0
# The uninterrupted runs of 1 and 2 processes the rest compares with (the
# kill part's references, when it ran for them).
for p in 1 2; do
    [ -d "$WORK/ref$p" ] || run_rc 0 mpi "$p" "${ARGS[@]}" --save-every 4 --project-dir "$WORK/ref$p"
done

# ---- a fault on one rank ------------------------------------------------------
# same_error FILE CODE_TEXT RANK1_FILE: both ranks printed the same "save
# failed" line (after their own "[rank r]" tag), and it names rank 1, the
# file of rank 1 that failed and the OS error.
same_error() {
    local lines
    lines=$(grep "save failed: " "$1" | sed 's/^ckpt: \[rank [0-9]*\] //' | sort -u)
    [ "$(grep -c "save failed: " "$1")" -eq 2 ] || { cat "$1" >&2; fail "expected a save error from both ranks"; }
    [ "$(printf '%s\n' "$lines" | wc -l)" -eq 1 ] || { cat "$1" >&2; fail "the ranks report different errors"; }
    case $lines in
    *"save failed: rank 1: "*"$3"*"$2"*) ;;
    *) fail "the error does not name rank 1, its file $3 and '$2': $lines" ;;
    esac
}
proj=$WORK/fault
# Rank 1 fsyncs each file it writes once: its part of the replicated
# tensors and its shards (the save plan), then its generator, last. Its 2k-th
# fsync is then its generator file in the second save (step 20 of 25).
k=$(grep -o '"rank": 1[,}]' "$(latest_checkpoint "$WORK/ref2")/checkpoint.json" | wc -l)
[ "$k" -ge 1 ] || fail "rank 1 wrote no file in $(latest_checkpoint "$WORK/ref2")"
export CKPT_FAULT=fsync:$((2 * k)):EIO CKPT_FAULT_RANK=1
run_rc 3 mpi 2 "${ARGS[@]}" --save-every 10 --project-dir "$proj"
same_error "$WORK/err" "fsync: Input/output error" random_states_1.safetensors
[ "$(ls -A "$proj/checkpoints" | grep -v '^\.lock$' | tr '\n' ' ')" = "checkpoint_0 " ] ||
    fail "after the failed save: $(ls -A "$proj/checkpoints" | tr '\n' ' ') (expected checkpoint_0 only)"
run_rc 0 "$CKPT_BIN" verify "$proj"
before=$(cat "$proj/checkpoints/checkpoint_0/checkpoint.json")
# resumed from step 10, rank 1's first write of the next save fails (its
# first file: its part of the model)
export CKPT_FAULT=write:1:ENOSPC
run_rc 3 mpi 2 "${ARGS[@]}" --save-every 10 --project-dir "$proj" --resume
same_error "$WORK/err" "write: No space left on device" -00002-of-00002.safetensors
[ "$(ls -A "$proj/checkpoints" | grep -v '^\.lock$' | tr '\n' ' ')" = "checkpoint_0 " ] ||
    fail "after the second failed save: $(ls -A "$proj/checkpoints" | tr '\n' ' ')"
[ "$(cat "$proj/checkpoints/checkpoint_0/checkpoint.json")" = "$before" ] || fail "checkpoint_0 changed"
unset CKPT_FAULT CKPT_FAULT_RANK
run_rc 0 mpi 2 "${ARGS[@]}" --save-every 10 --project-dir "$proj" --resume
run_rc 0 "$CKPT_BIN" diff "$(latest_checkpoint "$WORK/ref2")" "$(latest_checkpoint "$proj")"
echo "ok: EIO and ENOSPC on rank 1 only: no new checkpoint, the same error on every rank, resumed bit for bit"

# ---- one rank's file corrupted in the newest checkpoint -----------------------
newest=$(latest_checkpoint "$proj")
older=$(ls -d "$proj"/checkpoints/checkpoint_* | sort -t_ -k2 -n | tail -2 | head -1)
f=$newest/random_states_1.safetensors
flip_byte "$f" $(( $(stat -c %s "$f") - 1 ))
run_rc 0 mpi 2 --epochs 1 --batch-size 8 --workers 0 --save-every 10 --project-dir "$proj" --resume
grep -q "skipping $newest: rank 1: .*random_states_1.safetensors" "$WORK/err" ||
    { cat "$WORK/err" >&2; fail "no warning that rank 1 found $newest corrupt"; }
for r in 0 1; do
    grep -q "\[rank $r\] resumed from $older at step" "$WORK/out" ||
        { cat "$WORK/out" >&2; fail "rank $r did not resume from $older"; }
done
run_rc 0 "$CKPT_BIN" diff "$(latest_checkpoint "$WORK/ref2")" "$(latest_checkpoint "$proj")"
echo "ok: rank 1's corrupt file in the newest checkpoint: both ranks fell back to $older, ended bit for bit"

# ---- SIGTERM to every rank ---------------------------------------------------
proj=$WORK/term
mpirun --oversubscribe -np 2 "$CKPT_BIN" train --epochs 4 --batch-size 8 --workers 0 --save-every 0 \
    --project-dir "$proj" >"$WORK/out" 2>"$WORK/err" &
mp=$!
for _ in $(seq 1 600); do
    [ -s "$proj/logs/metrics.jsonl" ] && break
    sleep 0.05
done
ranks=$(pgrep -P "$mp" || true)
[ "$(echo $ranks | wc -w)" -eq 2 ] || fail "expected 2 ranks under mpirun, found: $ranks"
kill -TERM $ranks
rc=0
wait "$mp" || rc=$?
[ "$rc" -eq 0 ] || { cat "$WORK/out" "$WORK/err" >&2; fail "after SIGTERM mpirun exited $rc (a rank failed)"; }
grep -q "preempted at step" "$WORK/out" || fail "no preemption message"
step=$(sed -n 's/.*preempted at step \([0-9]*\).*/\1/p' "$WORK/out")
run_rc 0 "$CKPT_BIN" verify "$proj"
grep -q "\"step\": $step," "$(latest_checkpoint "$proj")/checkpoint.json" ||
    fail "the checkpoint is not at step $step"
echo "ok: SIGTERM: every rank saved at step $step and exited 0"

# ---- --init-from and Hugging Face shards under 2 ranks ------------------------
# A 1-process checkpoint's model starts a 2-rank fine-tuning run (a partial,
# collective load); the 2-rank run saves its model as HF shards; a second
# identical job ends bit for bit the same.
src=$(latest_checkpoint "$WORK/ref1")
for j in ft1 ft2; do
    run_rc 0 mpi 2 --epochs 1 --batch-size 8 --workers 0 --save-every 0 --seed 3 \
        --project-dir "$WORK/$j" --init-from "$src" --max-shard-size 100KB
    grep -q "initialised the model from $src" "$WORK/out" || { cat "$WORK/out" >&2; fail "no init line"; }
done
ck=$(latest_checkpoint "$WORK/ft1")
[ -f "$ck/model.safetensors.index.json" ] || fail "the 2-rank run did not save HF shards"
run_rc 0 "$CKPT_BIN" verify "$WORK/ft1"
run_rc 0 "$CKPT_BIN" diff "$ck" "$(latest_checkpoint "$WORK/ft2")"
echo "ok: --init-from a 1-process checkpoint under 2 ranks, HF shards saved, reproducible"
