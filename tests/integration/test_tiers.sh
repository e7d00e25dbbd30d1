#!/usr/bin/env bash
# Storage tiers under real mpirun jobs: 4 ranks as 2 simulated nodes
# (--ranks-per-node 2), each node's saves in a folder of its own
# (--local-dir .../n%n), each rank's part copied to the other node (MPI
# exchanges), every 3rd save persisted to the project folder.
#  - lost node: the job is killed with SIGKILL after a save newer than the
#    newest persisted one, node 1's folder is deleted, and the resumed job
#    loads that newer save from node 0 (its own parts and node 1's replicas)
#    without opening any state file of the project folder (the test layer's
#    open log);
#  - a node back with a stale tier: that job is killed in turn after newer
#    saves, node 1 comes back with its folder from before (older saves), and
#    the resumed job takes the newer save from node 0;
#  - the run then ends bit for bit as an uninterrupted one (ckpt diff, and
#    the metrics log), which saved asynchronously, replicating in its
#    background threads (MPI_THREAD_MULTIPLE);
#  - one process, --persist-every 100: a save at a preemption signal and the
#    run's last save go to the project folder.
# Both nodes lost, a corrupt replica, and no whole checkpoint are covered by
# unit.test_tiers (thread ranks).
source "$(dirname "$0")/common.bash"

mpi_setup

# A sixth of the data set: 200 training rows, 6 global batches of 32 an
# epoch; 2 epochs, a save every step: checkpoints 0..11, persisted 2, 5, ...
zcat "$CKPT_DATA" >"$WORK/all.csv"
head -n 240 "$WORK/all.csv" | gzip >"$WORK/tiny.csv.gz"
export CKPT_DATA=$WORK/tiny.csv.gz
# --total-limit 0: the project's rotation deep-verifies the checkpoints it
# keeps after each persisted save, which would read their state files (the
# open log must show the resume's reads only).
ARGS=(--epochs 2 --batch-size 8 --workers 0 --save-every 1 --persist-every 3 --ranks-per-node 2
    --total-limit 0)
train() { # train PROJECT ARGS...
    local proj=$1
    shift
    mpirun --oversubscribe -np 4 "$CKPT_BIN" train "${ARGS[@]}" --project-dir "$WORK/$proj" \
        --local-dir "$WORK/$proj-local/n%n" "$@"
}

# kill_job MPIRUN_PID (as test_mpi.sh): the ranks and mpirun at once.
kill_job() {
    local mp=$1 ranks
    ranks=$(pgrep -P "$mp" || true)
    kill -9 $ranks "$mp" 2>/dev/null || true
    wait "$mp" 2>/dev/null || true
    for r in $ranks; do
        while kill -0 "$r" 2>/dev/null; do sleep 0.05; done
    done
}

# every_rank_has DIR N: checkpoint_N is committed in every rank's folder.
every_rank_has() {
    local n=0 r
    for r in 0 1 2 3; do
        [ -d "$1/n$((r / 2))/rank_$r/checkpoint_$2" ] && n=$((n + 1))
    done
    [ "$n" -eq 4 ]
}

# node0_newest DIR: the newest checkpoint both ranks of node 0 committed
# (node 1 gone, what a load can take: node 0 holds node 1's parts too).
node0_newest() {
    local best=-1 d n
    for d in "$1"/n0/rank_0/checkpoint_*; do
        [ -d "$d" ] || continue
        n=${d##*_}
        [ -d "$1/n0/rank_1/checkpoint_$n" ] && [ "$n" -gt "$best" ] && best=$n
    done
    echo "$best"
}

# newest NUMBER of checkpoint_NUMBER folders in $1 (-1: none)
newest() {
    local best=-1 d n
    for d in "$1"/checkpoint_*; do
        [ -d "$d" ] || continue
        n=${d##*_}
        [ "$n" -gt "$best" ] && best=$n
    done
    echo "$best"
}

# run_until PROJECT N ARGS...: starts a job and kills it once every rank
# committed checkpoint_N locally.
run_until() {
    local proj=$1 n=$2
    shift 2
    ASAN_OPTIONS=detect_leaks=0 train "$proj" "$@" >"$WORK/job.out" 2>&1 &
    local mp=$!
    for _ in $(seq 1 6000); do
        every_rank_has "$WORK/$proj-local" "$n" && break
        kill -0 "$mp" 2>/dev/null || break
        sleep 0.01
    done
    kill -0 "$mp" 2>/dev/null || { cat "$WORK/job.out" >&2; fail "the job ended before checkpoint_$n"; }
    kill_job "$mp"
}

# the flags that need --local-dir, and a pattern the library refuses
run_rc 2 "$CKPT_BIN" train --replicas 1
grep -q "apply with --local-dir only" "$WORK/err" || fail "no usage error for --replicas alone"
run_rc 3 "$CKPT_BIN" train --project-dir "$WORK/bad" --local-dir "$WORK/x%y" --quiet
grep -q "local_dir '$WORK/x%y' has a '%' that is not %n, %r or %%" "$WORK/err" ||
    { cat "$WORK/err"; fail "no error for a bad --local-dir"; }

# The uninterrupted run saves asynchronously: ckpt train asks MPI for
# MPI_THREAD_MULTIPLE, and each rank's replica of another node's part is
# then written by its background thread (the open log's " [thread]").
CKPT_OPEN_LOG=$WORK/ref-opens run_rc 0 train ref --quiet --async
ref_final=$(latest_checkpoint "$WORK/ref")
for r in 0 1 2 3; do
    q=$(((r + 2) % 4))
    grep -Eq "^write $WORK/ref-local/n$((r / 2))/rank_$r/\.checkpoint_[0-9]+\.tmp\.[^/]*/random_states_$q\.safetensors \[thread\]$" \
        "$WORK/ref-opens" || fail "rank $r: rank $q's replica not written in the background"
    [ -f "$WORK/ref-local/n$((r / 2))/rank_$r/checkpoint_11/random_states_$q.safetensors" ] ||
        fail "rank $r: no replica of rank $q in its last save"
done
echo "ok: asynchronous saves replicate in the background thread"

# ---- one process: the last save and a preemption's go to the project folder -------
T1=(env CKPT_DATA="$CKPT_DATA" "$CKPT_BIN" train --epochs 1 --batch-size 8 --workers 0 --quiet
    --save-every 5 --persist-every 100 --project-dir "$WORK/one" --local-dir "$WORK/one-local")
"${T1[@]}" >"$WORK/one.out" 2>&1 &
pid=$!
for _ in $(seq 1 6000); do
    [ -f "$WORK/one/logs/metrics.jsonl" ] && [ "$(wc -l <"$WORK/one/logs/metrics.jsonl")" -ge 3 ] && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.01
done
kill -USR1 "$pid" || fail "the one-process run ended before the signal"
wait "$pid" || { cat "$WORK/one.out" >&2; fail "preempted run: exit $?"; }
dir=$(sed -n 's/^preempted at step [0-9]*, checkpoint saved: //p' "$WORK/one.out")
case $dir in
"$WORK"/one/checkpoints/checkpoint_*) ;;
*) cat "$WORK/one.out" >&2; fail "the preemption's save is not in the project folder: '$dir'" ;;
esac
[ "$(ls "$WORK/one/checkpoints" | wc -l)" -eq 1 ] || fail "the project folder holds more than that save"
run_rc 0 "${T1[@]}" --resume
n=$(ls "$WORK/one/checkpoints" | wc -l)
[ "$n" -eq 2 ] || fail "after the last save the project folder holds $n checkpoints, expected 2"
last=$(newest "$WORK/one-local/rank_0")
[ "$(latest_checkpoint "$WORK/one")" = "$WORK/one/checkpoints/checkpoint_$last" ] ||
    fail "the last save (checkpoint_$last) is not in the project folder"
echo "ok: --persist-every 100: the preemption's save and the last one went to the project folder"

# ---- a lost node -------------------------------------------------------------
L=$WORK/run-local
for attempt in 1 2 3; do
    run_until run 3
    mv "$L/n1" "$WORK/n1.away" # node 1 is gone, its folder with it
    k=$(node0_newest "$L")
    p=$(newest "$WORK/run/checkpoints")
    [ "$k" -gt "$p" ] && break
    # the kill came after the next persisted save (a loaded machine): again
    [ "$attempt" -lt 3 ] || fail "killed too late: local checkpoint_$k, persisted checkpoint_$p"
    rm -rf "$WORK/run" "$L" "$WORK/n1.away"
done
export CKPT_OPEN_LOG=$WORK/opens
# resumed, then killed again after newer saves of its own
ASAN_OPTIONS=detect_leaks=0 train run --resume >"$WORK/resume1.out" 2>&1 &
mp=$!
for _ in $(seq 1 6000); do
    every_rank_has "$L" $((k + 3)) && break
    kill -0 "$mp" 2>/dev/null || break
    sleep 0.05
done
kill_job "$mp"
unset CKPT_OPEN_LOG
for r in 0 1 2 3; do
    grep -q "\[rank $r\] resumed from $L/n$((r / 2))/rank_$r/checkpoint_$k at step" "$WORK/resume1.out" ||
        { cat "$WORK/resume1.out" >&2; fail "rank $r did not resume from its node's checkpoint_$k"; }
done
# no state file of the project's checkpoints (0..$p then) was opened
if grep -E "^read $WORK/run/checkpoints/checkpoint_[0-9]+/[^/]*\.safetensors( \[thread\])?$" "$WORK/opens"; then
    fail "the resume read state files of the project folder"
fi
grep -q "^read $L/n0/rank_0/checkpoint_$k/" "$WORK/opens" || fail "no read of node 0's checkpoint_$k"
echo "ok: node 1 lost: resumed from node 0's checkpoint_$k (newer than the persisted checkpoint_$p), no project state file opened"

# ---- a node back with a stale tier ---------------------------------------------
rm -rf "$L/n1"
mv "$WORK/n1.away" "$L/n1" # node 1 comes back with checkpoint_$k, its newer folder lost
m=$(node0_newest "$L")
[ "$m" -gt "$k" ] || fail "no save after the resume (newest $m)"
[ "$(newest "$L/n1/rank_2")" -eq "$k" ] || fail "node 1's folder is not the stale one"
# (a kill between a persisted save's project commit and its local commits
# leaves the project folder one save ahead of the tiers: it is loaded then)
pm=$(newest "$WORK/run/checkpoints")
run_rc 0 train run --resume
for r in 0 1 2 3; do
    want=$L/n$((r / 2))/rank_$r/checkpoint_$m
    [ "$pm" -gt "$m" ] && want=$WORK/run/checkpoints/checkpoint_$pm
    grep -q "\[rank $r\] resumed from $want at step" "$WORK/out" ||
        fail "rank $r did not resume from $want: $(grep resumed "$WORK/out")"
done
[ "$pm" -gt "$m" ] && m=$pm
# the stale folder goes at node 1's next local save (its retention); a resume
# after the run's last save makes none, and keeps it (older, and never chosen
# over the newer ones)
if [ "$(node0_newest "$L")" -gt "$m" ]; then
    [ ! -d "$L/n1/rank_2/checkpoint_$k" ] || fail "the stale checkpoint_$k was kept"
fi
echo "ok: node 1 back with its stale checkpoint_$k: resumed from checkpoint_$m"

# ---- the whole run -----------------------------------------------------------------
run_rc 0 "$CKPT_BIN" diff "$ref_final" "$(latest_checkpoint "$WORK/run")"
grep -q "bit for bit" "$WORK/out" || fail "diff did not say bit for bit"
cmp "$WORK/ref/logs/metrics.jsonl" "$WORK/run/logs/metrics.jsonl" || fail "metrics logs differ"
echo "ok: killed twice, a node lost and back stale: the run ends bit for bit as the uninterrupted one"

# ---- ckpt ls of a node's tier ---------------------------------------------------------
run_rc 0 "$CKPT_BIN" ls "$L/n0"
grep -q "node-local tier $L/n0, on the node's disk" "$WORK/out" || { cat "$WORK/out"; fail "ls: no tier line"; }
grep -Eq "^0 .* complete  0,2 .*$L/n0/rank_0/checkpoint_[0-9]+$" "$WORK/out" || { cat "$WORK/out"; fail "ls: rank 0's parts"; }
grep -Eq "^1 .* complete  1,3 .*$L/n0/rank_1/checkpoint_[0-9]+$" "$WORK/out" || { cat "$WORK/out"; fail "ls: rank 1's parts"; }
f=$(ls -d "$L"/n0/rank_1/checkpoint_*)/random_states_3.safetensors
flip_byte "$f" 40
run_rc 0 "$CKPT_BIN" ls --json "$L/n0/rank_1"
grep -q '"status":"corrupt","parts":\[1\]' "$WORK/out" || { cat "$WORK/out"; fail "ls: the corrupt replica"; }
grep -q 'random_states_3.safetensors: checksum mismatch' "$WORK/out" || fail "ls: no reason"
echo "ok: ckpt ls lists each rank's saves in a node's tier with the parts they hold"
