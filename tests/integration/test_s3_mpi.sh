#!/usr/bin/env bash
# A project in object storage under mpirun (2 processes), on the loopback S3
# server of the other s3 tests:
# - each rank uploads its own files (its shard of the optimizer, its RNG
#   state) straight into their objects, rank 0 the manifest last; no
#   checkpoint file is written to the local disk;
# - an upload of rank 1's own object failing for good (the job's second
#   save): the save fails on every rank naming rank 1 and the object's key,
#   nothing is committed, the first checkpoint stays, the leftover is
#   listed; the resumed job removes it and ends bit for bit equal to the
#   same job saving to a local folder.
source "$(dirname "$0")/common.bash"
source "$(dirname "$0")/s3_common.bash"
mpi_setup
s3_start
export CKPT_S3_STAGING_DIR=$WORK/staging
U=s3://ckpt-test/mpi

mpi() { mpirun --oversubscribe -np 2 "$CKPT_BIN" train "$@"; }
# 400 training rows: 25 global batches of 16, a save every 8
zcat "$CKPT_DATA" >"$WORK/all.csv"
head -n 480 "$WORK/all.csv" | gzip >"$WORK/small.csv.gz"
export CKPT_DATA=$WORK/small.csv.gz
ARGS=(--epochs 1 --batch-size 8 --quiet --workers 0 --save-every 8)
run_rc 0 mpi "${ARGS[@]}" --project-dir "$WORK/ref"

# ---- rank 1's own upload fails at the second save ------------------------------
s3_faults '[{"method":"PUT","key":"random_states_1\\.safetensors$","action":"status","status":500,"after":1}]'
CKPT_S3_RETRIES=1 run_rc 3 mpi "${ARGS[@]}" --project-dir "$U"
has "rank 1" <"$WORK/err" && has "random_states_1.safetensors" <"$WORK/err" &&
    has "HTTP 500" <"$WORK/err" || fail "rank 1's failed upload: $(cat "$WORK/err")"
s3_reset
run_rc 0 "$CKPT_BIN" ls "$U"
[ "$(grep -c complete "$WORK/out")" = 1 ] || fail "one checkpoint expected: $(cat "$WORK/out")"
has "leftover" <"$WORK/out" || fail "ls does not show the leftover: $(cat "$WORK/out")"
first=$(grep complete "$WORK/out" | grep -o 's3://[^ ]*')
run_rc 0 "$CKPT_BIN" verify "$first"
"$S3_TOOL" cat ckpt-test "${first#s3://ckpt-test/}/checkpoint.json" >"$WORK/m.json"
grep -q '"num_processes": 2,' "$WORK/m.json" || fail "the manifest does not record 2 processes"

# ---- resumed: the leftover removed, the end equal to the local run ---------------
run_rc 0 mpi "${ARGS[@]}" --project-dir "$U" --resume
has "removing s3://ckpt-test/mpi/checkpoints/checkpoint_" <"$WORK/err" ||
    fail "the resumed job did not remove the leftover: $(cat "$WORK/err")"
run_rc 0 "$CKPT_BIN" ls "$U"
has "leftover" <"$WORK/out" && fail "a leftover stayed: $(cat "$WORK/out")"
final=$(grep complete "$WORK/out" | grep -o 's3://[^ ]*' | tail -1)
run_rc 0 "$CKPT_BIN" diff "$(latest_checkpoint "$WORK/ref")" "$final"
grep -q "bit for bit" "$WORK/out" || fail "the resumed job differs: $(cat "$WORK/out")"
cmp "$WORK/ref/logs/metrics.jsonl" "$WORK/staging/ckpt-test/mpi/logs/metrics.jsonl" ||
    fail "metrics logs differ"
compgen -G "$WORK/staging/ckpt-test/mpi/checkpoints/*checkpoint_*" >/dev/null &&
    fail "checkpoint files were written to the local disk"
echo "s3 mpi: ok"
