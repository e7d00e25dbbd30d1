#!/usr/bin/env bash
# The README's first command works: scripts/demo (what `make demo` runs) trains,
# is killed with SIGKILL, resumes, and reports the final checkpoints equal bit
# for bit, with the accuracy of both runs. Here on the test build, into a
# scratch folder (gnuplot may be absent: the demo then says where the data is).
# The GPT-2 part (scripts/demo-gpt2) is left to test_gpt2_example, so that it
# runs once in the suite (CKPT_DEMO_GPT2=0).
source "$(dirname "$0")/common.bash"

build=${CKPT_BUILD_DIR:?set CKPT_BUILD_DIR}
CKPT_DEMO_GPT2=0 CKPT_DEMO_OUT=$WORK/demo run_rc 0 bash "$CKPT_SOURCE_DIR/scripts/demo" "$build"
has "^equal: .* bit for bit$" <"$WORK/out" || fail "no bit-for-bit line: $(cat "$WORK/out")"
has "ended bit for bit" <"$WORK/out" || fail "no final verdict: $(cat "$WORK/out")"
[ "$(grep -c "test accuracy: " "$WORK/out")" -ge 2 ] || fail "accuracy of both runs not shown"
has "^kill -9 after " <"$WORK/out" || fail "the run was not killed"
[ -d "$WORK/demo/interrupted/checkpoints" ] || fail "the demo did not write into CKPT_DEMO_OUT"
echo "ok: the demo's interrupted run ends bit for bit where the uninterrupted one does"
