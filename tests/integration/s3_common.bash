# s3_common.bash — the object-storage tests' server, sourced after common.bash
# (whose cleanup kills it: it is one of the shell's jobs). Gives:
#   s3_start        starts tests/s3/server.js (s3rver and the proxy in front
#                   of it, both on 127.0.0.1, ephemeral ports) with a bucket
#                   ckpt-test, and points the AWS_* variables at the proxy
#   s3_faults JSON  sets the proxy's fault rules (tests/s3/server.js)
#   s3_stats        the proxy's counters (JSON)
#   s3_file KEY     the file where s3rver keeps the object KEY of ckpt-test
#   S3_TOOL         tests/progs/s3_tool
# A library built without object storage skips the test (77); a missing
# s3rver is installed (scripts/setup s3rver), and a failure to install it
# fails the test saying so.
if [ "${CKPT_HAVE_S3:-0}" != 1 ]; then
    echo "SKIP: this ckpt was built without libcurl/OpenSSL (no s3:// support)"
    exit 77
fi
S3_TOOL="$CKPT_BUILD_DIR/tests/s3_tool"
S3RVER_DIR=${CKPT_S3RVER_DIR:-$CKPT_BUILD_DIR/s3rver}

s3_start() {
    # make build-test installs it; a build folder made otherwise gets it here
    [ -f "$S3RVER_DIR/node_modules/s3rver/package.json" ] ||
        bash "$CKPT_SOURCE_DIR/scripts/setup" s3rver "$S3RVER_DIR" >&2 ||
        fail "s3rver could not be installed in $S3RVER_DIR (scripts/setup s3rver $S3RVER_DIR)"
    command -v node >/dev/null || fail "node is missing: run scripts/setup nodejs"
    mkdir -p "$WORK/s3"
    CKPT_S3RVER_DIR="$S3RVER_DIR" CKPT_S3_SERVER_LIFETIME=1200 \
        node --openssl-legacy-provider "$CKPT_SOURCE_DIR/tests/s3/server.js" "$WORK/s3/data" "$WORK/s3/ports" ckpt-test \
        >"$WORK/s3/log" 2>&1 &
    S3_PID=$!
    local i
    for i in $(seq 1 300); do
        [ -f "$WORK/s3/ports" ] && break
        kill -0 "$S3_PID" 2>/dev/null || { cat "$WORK/s3/log" >&2; fail "the S3 test server died"; }
        sleep 0.1
    done
    [ -f "$WORK/s3/ports" ] || fail "the S3 test server did not start in 30 s"
    S3_PROXY=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['proxy'])" \
        "$WORK/s3/ports")
    export AWS_ENDPOINT_URL="http://127.0.0.1:$S3_PROXY"
    export AWS_ACCESS_KEY_ID=S3RVER AWS_SECRET_ACCESS_KEY=S3RVER AWS_REGION=us-east-1
    unset AWS_SESSION_TOKEN AWS_ENDPOINT_URL_S3 AWS_DEFAULT_REGION
    # quick retries: the faults the tests inject need no real patience
    export CKPT_S3_BACKOFF_MS=${CKPT_S3_BACKOFF_MS:-10}
}

s3_faults() {
    curl -sf -X POST --data "$1" "http://127.0.0.1:$S3_PROXY/__proxy/faults" >/dev/null ||
        fail "could not set the proxy's faults"
}
s3_reset() {
    curl -sf -X POST "http://127.0.0.1:$S3_PROXY/__proxy/reset" >/dev/null ||
        fail "could not reset the proxy"
}
s3_stats() { curl -sf "http://127.0.0.1:$S3_PROXY/__proxy/stats"; }
# s3_stat NAME: one counter of the proxy (0 if none)
s3_stat() {
    s3_stats | python3 -c "import json,sys; print(json.load(sys.stdin).get(sys.argv[1], 0))" "$1"
}
s3_file() {
    local key=$1 dir base
    dir=$(dirname "$key")
    base=$(basename "$key")
    echo "$WORK/s3/data/ckpt-test/$dir/$base._S3rver_object"
}
