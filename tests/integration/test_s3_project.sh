#!/usr/bin/env bash
# A project in object storage (project_dir s3://bucket/prefix) on a real
# S3-compatible server on loopback (s3rver behind the test proxy):
# - ckpt train killed with -9 several times and resumed (every other run with
#   --async: the upload in the background) ends bit for bit equal to an
#   uninterrupted local run (checkpoint and metrics log), every committed
#   checkpoint verifying after each kill;
# - every CLI command on a URL: ls, verify, inspect, diff, export, prune;
# - a copy of the bucket's prefix is a local project (the same layout);
# - a flipped byte in a stored object: verify names it, a resume falls back;
# - a storm of 5xx answers during saves: retried; one longer than the
#   retries on the manifest: the save fails, nothing is committed, the
#   previous checkpoint stays, the leftover is listed and the next save
#   removes it;
# - a second writer: refused while the lock's holder lives (CKPT_EBUSY naming
#   it), the lock of a dead holder taken over; a 412 on the manifest (a
#   number committed by another writer meanwhile) moves the save on to the
#   next number;
# - wrong credentials: a clear 403 naming the key, nothing written.
source "$(dirname "$0")/common.bash"
source "$(dirname "$0")/s3_common.bash"
s3_start
export CKPT_S3_STAGING_DIR=$WORK/staging CKPT_S3_PART_SIZE=256K CKPT_S3_CONNECTIONS=4
U=s3://ckpt-test/run
# a short run: 1 epoch of 23 steps (each added epoch 23 more), a save every 2
TRAIN=("$CKPT_BIN" train --epochs 1 --batch-size 64 --save-every 2 --quiet)
staging=$WORK/staging/ckpt-test/run

# ---- kill -9 and resume, equal to a local run ------------------------------
ref=$WORK/ref
start=$(date +%s%N)
run_rc 0 "${TRAIN[@]}" --project-dir "$ref"
elapsed_ms=$(( ($(date +%s%N) - start) / 1000000 ))
ref_final=$(latest_checkpoint "$ref")

RANDOM=${KILL_SEED:-$$}
kills=0
while :; do
    args=("${TRAIN[@]}" --save-every 4 --project-dir "$U" --resume)
    # every other run saves in the background (the upload runs there too)
    [ $((kills % 2)) -eq 1 ] && args+=(--async)
    if [ "$kills" -ge 2 ]; then
        run_rc 0 "${args[@]}"
        break
    fi
    "${args[@]}" >"$WORK/train.out" 2>&1 &
    pid=$!
    delay_ms=$(( elapsed_ms * (10 + RANDOM % 30) / 100 ))
    sleep "$(printf '%d.%03d' $((delay_ms / 1000)) $((delay_ms % 1000)))"
    kill -9 "$pid" 2>/dev/null || true
    rc=0
    wait "$pid" || rc=$?
    [ "$rc" -eq 0 ] && break
    [ "$rc" -eq 137 ] || { cat "$WORK/train.out" >&2; fail "ckpt train exited $rc"; }
    kills=$((kills + 1))
    if "$CKPT_BIN" ls "$U" 2>/dev/null | has complete; then
        run_rc 0 "$CKPT_BIN" verify "$U"
    fi
done
[ "$kills" -ge 1 ] || fail "no kill landed"
run_rc 0 "$CKPT_BIN" diff "$ref_final" "$U"
grep -q "bit for bit" "$WORK/out" || fail "the resumed object-storage run differs: $(cat "$WORK/out")"
cmp "$ref/logs/metrics.jsonl" "$staging/logs/metrics.jsonl" || fail "metrics logs differ"
# nothing of a checkpoint stays on the local disk
compgen -G "$staging/checkpoints/*checkpoint_*" >/dev/null && fail "local copies left in $staging"

# ---- every command on a URL -------------------------------------------------
run_rc 0 "$CKPT_BIN" ls "$U"
[ "$(grep -c complete "$WORK/out")" = 3 ] || fail "ls (total_limit 3): $(cat "$WORK/out")"
newest=$(grep complete "$WORK/out" | grep -o 's3://[^ ]*' | tail -1)
[ -n "$newest" ] || fail "no newest checkpoint URL"
older=$(grep -o 's3://[^ ]*' "$WORK/out" | head -1)
run_rc 0 "$CKPT_BIN" verify "$newest"
run_rc 0 "$CKPT_BIN" ls "$newest"
run_rc 0 "$CKPT_BIN" inspect "$newest"
has "model.safetensors" <"$WORK/out" || fail "inspect: $(cat "$WORK/out")"
run_rc 1 "$CKPT_BIN" diff "$older" "$newest"
run_rc 0 "$CKPT_BIN" export "$newest" "$WORK/exported"
[ -f "$WORK/exported/model.safetensors" ] || fail "export wrote no model.safetensors"
run_rc 3 "$CKPT_BIN" export "$newest" "s3://ckpt-test/exported"

# a copy of the prefix with any client is a local project, bit for bit
mkdir -p "$WORK/copy/checkpoints"
base=$(basename "$newest")
"$S3_TOOL" list ckpt-test "run/checkpoints/$base/" >"$WORK/keys"
while read -r kind key _; do
    [ "$kind" = key ] || continue
    mkdir -p "$WORK/copy/$(dirname "${key#run/}")"
    "$S3_TOOL" cat ckpt-test "$key" >"$WORK/copy/${key#run/}" 2>/dev/null ||
        fail "copy of $key"
    # cat prints the request counts last: cut that line
    python3 - "$WORK/copy/${key#run/}" <<'PY'
import sys
p = sys.argv[1]
b = open(p, 'rb').read()
i = b.rfind(b'requests=')
open(p, 'wb').write(b[:i])
PY
done <"$WORK/keys"
run_rc 0 "$CKPT_BIN" verify "$WORK/copy/checkpoints/$base"
run_rc 0 "$CKPT_BIN" diff "$WORK/copy/checkpoints/$base" "$ref_final"

# ---- a flipped byte in a stored object ---------------------------------------
f=$(s3_file "run/checkpoints/$base/model.safetensors")
[ -f "$f" ] || fail "no stored object at $f"
flip_byte "$f" 200
run_rc 1 "$CKPT_BIN" verify "$U"
has "$base/model.safetensors" <"$WORK/out" || fail "verify does not name the object: $(cat "$WORK/out")"
run_rc 0 "${TRAIN[@]}" --epochs 2 --project-dir "$U" --resume
has "skipping" <"$WORK/err" && has "falling back" <"$WORK/err" ||
    fail "the resume did not fall back: $(cat "$WORK/err")"

# ---- prune on a URL ------------------------------------------------------------
run_rc 0 "$CKPT_BIN" prune "$U" --keep 1
run_rc 0 "$CKPT_BIN" ls "$U"
[ "$(grep -c complete "$WORK/out")" = 1 ] || fail "prune --keep 1: $(cat "$WORK/out")"

# ---- 5xx storms ------------------------------------------------------------------
s3_reset
s3_faults '[{"method":"PUT","action":"status","status":503,"count":4}]'
run_rc 0 "${TRAIN[@]}" --epochs 3 --project-dir "$U" --resume
[ "$(s3_stat fault_status)" = 4 ] || fail "the storm did not happen: $(s3_stats)"
run_rc 0 "$CKPT_BIN" verify "$U"
run_rc 0 "$CKPT_BIN" ls "$U"
before=$(grep -c complete "$WORK/out")
newest_before=$(grep complete "$WORK/out" | grep -o 's3://[^ ]*' | tail -1)
# the manifest's PUT fails for good: the save fails, nothing is committed
s3_faults '[{"method":"PUT","key":"checkpoint\\.json$","action":"status","status":500}]'
CKPT_S3_RETRIES=2 run_rc 3 "${TRAIN[@]}" --epochs 4 --project-dir "$U" --resume
has "checkpoint.json: PUT: HTTP 500" <"$WORK/err" || fail "manifest storm: $(cat "$WORK/err")"
s3_reset
run_rc 0 "$CKPT_BIN" ls "$U"
[ "$(grep -c complete "$WORK/out")" = "$before" ] || fail "a failed save changed the checkpoints"
grep complete "$WORK/out" | grep -o 's3://[^ ]*' | tail -1 | grep -qx "$newest_before" ||
    fail "the newest checkpoint changed after a failed save"
has "leftover" <"$WORK/out" || fail "ls does not show the leftover: $(cat "$WORK/out")"
run_rc 0 "$CKPT_BIN" verify "$newest_before"
run_rc 0 "${TRAIN[@]}" --epochs 4 --project-dir "$U" --resume
has "removing s3://ckpt-test/run/checkpoints/checkpoint_" <"$WORK/err" ||
    fail "the next save did not remove the leftover: $(cat "$WORK/err")"
run_rc 0 "$CKPT_BIN" ls "$U"
has "leftover" <"$WORK/out" && fail "a leftover stayed: $(cat "$WORK/out")"

# ---- a second writer -----------------------------------------------------------
sleep 600 &
holder=$!
printf '%s %s test\n' "$(hostname | tr ' ' _)" "$holder" >"$WORK/lock"
"$S3_TOOL" put ckpt-test run/checkpoints/.lock "$WORK/lock" >/dev/null
run_rc 3 "${TRAIN[@]}" --epochs 5 --project-dir "$U" --resume
has "CKPT_EBUSY\|held by another process" <"$WORK/err" && has "$holder" <"$WORK/err" ||
    fail "a second writer was not refused: $(cat "$WORK/err")"
kill "$holder"
wait "$holder" 2>/dev/null || true
# the holder is gone: its lock is taken over; a manifest PUT answered 412
# (another writer committed that number meanwhile) makes the save take the
# next number
s3_faults '[{"method":"PUT","key":"checkpoint\\.json$","action":"status","status":412,"count":1}]'
run_rc 0 "${TRAIN[@]}" --epochs 5 --save-every 1000 --project-dir "$U" --resume
has "taking over" <"$WORK/err" || fail "the dead holder's lock was not taken over: $(cat "$WORK/err")"
has "committed by another writer during this save; saving as checkpoint_" <"$WORK/err" ||
    fail "a 412 on the manifest did not move the save on: $(cat "$WORK/err")"
s3_reset
run_rc 0 "$CKPT_BIN" verify "$U"

# ---- wrong credentials ----------------------------------------------------------
AWS_SECRET_ACCESS_KEY=wrong run_rc 3 "${TRAIN[@]}" --project-dir s3://ckpt-test/other
has "access denied (HTTP 403)" <"$WORK/err" && has "s3://ckpt-test/other/" <"$WORK/err" ||
    fail "wrong credentials: $(cat "$WORK/err")"
"$S3_TOOL" list ckpt-test other/ | has "^key " && fail "objects were written with wrong credentials"
AWS_SECRET_ACCESS_KEY=wrong run_rc 3 "$CKPT_BIN" ls "$U"
has "access denied" <"$WORK/err" || fail "ls with wrong credentials: $(cat "$WORK/err")"
echo "s3 project: ok ($kills kills)"
