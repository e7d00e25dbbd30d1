#!/usr/bin/env bash
# Collective deadlines under real mpirun (-np 2 and 3): one rank is held in
# a save pre-hook, then in a load pre-hook, until the others have returned
# (tests/progs/mpi/deadline_run.c; the others can only return by their
# 2 s deadline, so nothing here depends on timing). Checked:
#  - every rank returns CKPT_ETIMEDOUT from that save and that load, the
#    present ranks naming the missing rank and the phase; rank 0 held back
#    is named by the others, and rank 0 says who gave up on it;
#  - nothing changed: the failed load left the object as it was, the failed
#    save committed nothing and left no temporary folder;
#  - once the rank is back, the next save, load and save all succeed, and
#    every checkpoint verifies;
#  - a job whose ranks end right after a timed-out save or load (free the
#    accelerator and the communicator, MPI_Finalize) exits cleanly on every
#    rank: no segfault in MPI_Finalize over abandoned requests, no leak.
source "$(dirname "$0")/common.bash"

mpi_setup
PROG=$CKPT_BUILD_DIR/tests/deadline_run
[ -x "$PROG" ] || fail "$PROG is not built"

# expect OUT RANK WHAT TEXT: the line of RANK for WHAT is exactly TEXT.
expect() {
    local got
    got=$(grep "^rank $2 $3 " "$1" | head -n 1)
    [ "$got" = "rank $2 $3 $4" ] || fail "rank $2 $3: expected '$4', got '${got#rank $2 $3 }'"
}

run_case() { # run_case P SLEEPER
    local p=$1 s=$2 dir=$WORK/p$1s$2 out=$WORK/p$1s$2.out r
    mkdir -p "$dir"
    mpirun --oversubscribe -np "$p" "$PROG" "$dir" "$s" 2 >"$out" 2>"$WORK/err" ||
        { cat "$out" "$WORK/err" >&2; fail "P=$p sleeper $s: the job failed"; }
    for ((r = 0; r < p; r++)); do
        for what in save1 save3 load3 save4; do expect "$out" "$r" "$what" "CKPT_OK "; done
        expect "$out" "$r" value2 -1
        expect "$out" "$r" value3 7
        local save="save: agree on the commit" load="load: agree on the verdict" why
        if [ "$s" -eq 0 ] && [ "$r" -eq 0 ]; then
            for what in "save2 $save" "load2 $load"; do
                local w=${what%% *} re
                re="^rank 0 $w CKPT_ETIMEDOUT ${what#* }: rank [12] gave up waiting for rank 0 after 2 s$"
                grep -q "$re" "$out" || fail "rank 0 $w: $(grep "^rank 0 $w " "$out")"
            done
            continue
        fi
        why="rank $s did not arrive within 2 s"
        expect "$out" "$r" save2 "CKPT_ETIMEDOUT $save: $why"
        expect "$out" "$r" load2 "CKPT_ETIMEDOUT $load: $why"
    done
    # save1, save3, save4 committed; the failed save2 left nothing behind
    run_rc 0 "$CKPT_BIN" verify "$dir"
    has "3 of 3 checkpoints verified" <"$WORK/out" || { cat "$WORK/out"; fail "P=$p: verify"; }
    if compgen -G "$dir/checkpoints/.checkpoint_*" >/dev/null; then
        fail "P=$p sleeper $s: a temporary folder was left: $(ls -a "$dir/checkpoints")"
    fi
}

# run_exit P SLEEPER WHAT: the job ends after the timed-out WHAT (save2 or
# load2); every rank reports CKPT_ETIMEDOUT and exits 0.
run_exit() {
    local p=$1 s=$2 what=$3 dir=$WORK/x$1s$2$3 out=$WORK/x$1s$2$3.out r
    mkdir -p "$dir"
    mpirun --oversubscribe -np "$p" "$PROG" "$dir" "$s" 2 "$what" >"$out" 2>"$WORK/err" ||
        { cat "$out" "$WORK/err" >&2; fail "P=$p sleeper $s: the job did not exit cleanly after $what"; }
    for ((r = 0; r < p; r++)); do
        grep -q "^rank $r $what CKPT_ETIMEDOUT " "$out" || { cat "$out" >&2; fail "rank $r $what"; }
    done
    [ "$what" != load2 ] || for ((r = 0; r < p; r++)); do expect "$out" "$r" value2 -1; done
    # save1 (and before load2, save3) committed; the timed-out save nothing
    local n=1
    [ "$what" = save2 ] || n=2
    run_rc 0 "$CKPT_BIN" verify "$dir"
    has "$n of $n checkpoints verified" <"$WORK/out" || { cat "$WORK/out"; fail "P=$p: verify after $what"; }
}

# ckpt train --collective-timeout: bad values are usage errors; a run with a
# deadline trains and saves under mpirun as one without.
for bad in -1 abc nan 1e10; do
    run_rc 2 "$CKPT_BIN" train --collective-timeout "$bad" --project-dir "$WORK/bad"
    grep -q "collective-timeout" "$WORK/err" || fail "no message naming --collective-timeout"
done
zcat "$CKPT_DATA" >"$WORK/all.csv"
head -n 200 "$WORK/all.csv" | gzip >"$WORK/small.csv.gz"
for t in 30 0; do
    run_rc 0 mpirun --oversubscribe -np 2 "$CKPT_BIN" train --epochs 1 --batch-size 8 --quiet \
        --workers 0 --save-every 5 --collective-timeout "$t" --data "$WORK/small.csv.gz" \
        --project-dir "$WORK/train$t"
    run_rc 0 "$CKPT_BIN" verify "$WORK/train$t"
done

run_case 2 1
run_case 3 2
run_case 3 0
run_exit 3 1 load2
run_exit 3 0 load2
run_exit 2 1 save2
run_exit 3 2 save2
echo "ok: deadlines under mpirun -np 2 and 3"
