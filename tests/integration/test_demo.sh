#!/usr/bin/env bash
# The README's first command works: scripts/demo (what `make demo` runs) trains,
# is killed with SIGKILL, resumes, and reports the final checkpoints equal bit
# for bit, with the accuracy of both runs. Here on the test build, into a
# scratch folder (gnuplot may be absent: the demo then says where the data is).
# The GPT-2 part (scripts/demo-gpt2) is left to test_gpt2_example, so that it
# runs once in the suite (CKPT_DEMO_GPT2=0).
source "$(dirname "$0")/common.bash"

build=${CKPT_BUILD_DIR:?set CKPT_BUILD_DIR}
# the first kill of each run lands at once, before any save: the demo must
# kill again rather than claim a resume there was not
CKPT_DEMO_GPT2=0 CKPT_DEMO_FIRST_KILL_PCT=0 CKPT_DEMO_OUT=$WORK/demo run_rc 0 \
    bash "$CKPT_SOURCE_DIR/scripts/demo" "$build"
has "^equal: .* bit for bit$" <"$WORK/out" || fail "no bit-for-bit line: $(cat "$WORK/out")"
has "ended bit for bit" <"$WORK/out" || fail "no final verdict: $(cat "$WORK/out")"
[ "$(grep -c "test accuracy: " "$WORK/out")" -ge 2 ] || fail "accuracy of both runs not shown"
has "^kill -9 after " <"$WORK/out" || fail "the run was not killed"
[ -d "$WORK/demo/interrupted/checkpoints" ] || fail "the demo did not write into CKPT_DEMO_OUT"
has "^(the kill landed before the first save or after the last step: again" <"$WORK/out" ||
    fail "a kill before the first save was not retried: $(cat "$WORK/out")"
# the single-process resume started mid-run
has "^resumed from .* at step [1-9]" <"$WORK/out" || fail "no resume from a saved step"
if has "^== 6. many processes" <"$WORK/out"; then
    has "^(kill 1 landed before the first save or after the last step: again" <"$WORK/out" ||
        fail "the MPI section did not retry a kill before the first save"
    if has "So did the 2-process MPI job, killed whole and resumed on 2 processes from step" \
        <"$WORK/out"; then
        from=$(sed -n 's/.*resumed on 2 processes from step \([0-9]*\),$/\1/p' "$WORK/out")
        has "^\[rank 0\] resumed from .* at step $from$" <"$WORK/out" ||
            fail "the MPI section claims a resume from step $from that did not happen"
    fi
fi
echo "ok: the demo's interrupted run ends bit for bit where the uninterrupted one does"
