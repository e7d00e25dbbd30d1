#!/usr/bin/env bash
# Asynchronous saves to a project in object storage upload in the
# background (tests/progs/s3_async drives one save step by step):
# - the test proxy holds the upload of the state file: ckpt_save_state_async
#   returns all the same, nothing is committed while the upload is held, the
#   caller changes its state; once released, ckpt_save_wait commits the
#   checkpoint, which verifies and loads the state as it was at the call;
# - an upload failing for good in the background: the call returned, the
#   failure is logged at once and returned by ckpt_save_wait naming the key;
#   nothing is committed;
# - a node-local tier (local_dir) over a bucket project: refused, saying so.
source "$(dirname "$0")/common.bash"
source "$(dirname "$0")/s3_common.bash"
s3_start
export CKPT_S3_STAGING_DIR=$WORK/staging
PROG="$CKPT_BUILD_DIR/tests/s3_async"
U=s3://ckpt-test/async

# wait_for FILE PATTERN PID: until FILE has a line matching PATTERN (60 s)
wait_for() {
    local i
    for i in $(seq 1 600); do
        grep -q "$2" "$1" 2>/dev/null && return 0
        kill -0 "$3" 2>/dev/null || { cat "$WORK/a.err" >&2; fail "s3_async ended early: $(cat "$1")"; }
        sleep 0.1
    done
    fail "no '$2' in 60 s: $(cat "$1")"
}

# ---- the upload runs while the caller goes on --------------------------------
s3_faults '[{"method":"PUT","key":"custom_checkpoint_0\\.safetensors$","action":"hold","count":1}]'
mkfifo "$WORK/in"
"$PROG" "$U" <"$WORK/in" >"$WORK/a.out" 2>"$WORK/a.err" &
pid=$!
exec 3>"$WORK/in"
wait_for "$WORK/a.out" "^returned 0$" "$pid"
for i in $(seq 1 600); do
    [ "$(s3_stat fault_hold)" -ge 1 ] && break
    sleep 0.1
done
[ "$(s3_stat fault_hold)" -ge 1 ] || fail "the upload never reached the server: $(s3_stats)"
run_rc 0 "$CKPT_BIN" ls "$U"
has complete <"$WORK/out" && fail "committed while its upload was held: $(cat "$WORK/out")"
curl -sf -X POST "http://127.0.0.1:$S3_PROXY/__proxy/release" >/dev/null || fail "release"
echo go >&3
exec 3>&-
rc=0
wait "$pid" || rc=$?
[ "$rc" -eq 0 ] || { cat "$WORK/a.out" "$WORK/a.err" >&2; fail "s3_async exited $rc"; }
has "^waited 0 $U/checkpoints/checkpoint_0$" <"$WORK/a.out" || fail "wait: $(cat "$WORK/a.out")"
has "^loaded 0 1$" <"$WORK/a.out" || fail "the state at the call was not saved: $(cat "$WORK/a.out")"
run_rc 0 "$CKPT_BIN" verify "$U"
s3_reset

# ---- a background upload fails ----------------------------------------------
s3_faults '[{"method":"PUT","key":"custom_checkpoint_0\\.safetensors$","action":"status","status":500}]'
echo go | CKPT_S3_RETRIES=1 "$PROG" "$U/failing" >"$WORK/a.out" 2>"$WORK/a.err" && fail "a failed save went unnoticed"
has "^returned 0$" <"$WORK/a.out" || fail "the call itself failed: $(cat "$WORK/a.out" "$WORK/a.err")"
has "^waited -" <"$WORK/a.out" || fail "ckpt_save_wait did not fail: $(cat "$WORK/a.out")"
has "ckpt: error: .*custom_checkpoint_0.safetensors: PUT: HTTP 500" <"$WORK/a.err" &&
    has "s3_async: .*checkpoint_0/custom_checkpoint_0.safetensors: PUT: HTTP 500" <"$WORK/a.err" ||
    fail "the background failure: $(cat "$WORK/a.err")"
s3_reset
run_rc 0 "$CKPT_BIN" ls "$U/failing"
has complete <"$WORK/out" && fail "a failed save was committed: $(cat "$WORK/out")"
# a node-local tier over a bucket project is refused, saying so
run_rc 3 "$CKPT_BIN" train --epochs 1 --quiet --project-dir "$U/tier" --local-dir "$WORK/local"
has "node-local tier (local_dir) over a project in object storage is not supported" <"$WORK/err" ||
    fail "a tier over a bucket: $(cat "$WORK/err")"
echo "s3 async: ok"
