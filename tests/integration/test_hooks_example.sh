#!/usr/bin/env bash
# examples/hooks.c: the file a save pre-hook writes is part of the checkpoint
# (ckpt inspect lists it with its checksum, ckpt verify checks it, a changed
# byte makes the checkpoint corrupt and a resume falls back past it), and the
# post-save hook gets the final folder.
source "$(dirname "$0")/common.bash"

ex=${CKPT_BUILD_DIR:?set CKPT_BUILD_DIR}/example_hooks
[ -x "$ex" ] || fail "$ex not built"
run_rc 0 "$ex" "$WORK/p"
has "^step 10 saved: $WORK/p/checkpoints/checkpoint_0\$" <"$WORK/out" || fail "post-hook: $(cat "$WORK/out")"
has "^step 20 saved: $WORK/p/checkpoints/checkpoint_1\$" <"$WORK/out" || fail "post-hook: $(cat "$WORK/out")"
c1=$WORK/p/checkpoints/checkpoint_1
[ "$(cat "$c1/notes.txt")" = "step 20, written by a save_state pre-hook" ] || fail "notes.txt: $(cat "$c1/notes.txt")"

run_rc 0 "$CKPT_BIN" inspect "$c1"
has "^extra files (added by a save pre-hook, verified with the rest):\$" <"$WORK/out" || fail "inspect: $(cat "$WORK/out")"
has "^  notes.txt  42 B  xxh3 [0-9a-f]\{16\}\$" <"$WORK/out" || fail "inspect: $(cat "$WORK/out")"
run_rc 0 "$CKPT_BIN" inspect --json "$c1"
has '"extra_files":\[{"name":"notes.txt","size":42,"xxh3":"[0-9a-f]\{16\}"}\]}$' <"$WORK/out" ||
    fail "inspect --json: $(cat "$WORK/out")"
python3 -c 'import json,sys; json.load(open(sys.argv[1]))' "$WORK/out" || fail "inspect --json is not JSON"
run_rc 0 "$CKPT_BIN" verify "$WORK/p"

flip_byte "$c1/notes.txt" 0
run_rc 1 "$CKPT_BIN" verify "$WORK/p"
has "notes.txt: checksum mismatch" <<<"$(cat "$WORK/out" "$WORK/err")" || fail "verify: $(cat "$WORK/out" "$WORK/err")"
# the next run resumes from checkpoint_0, skipping the corrupt one
run_rc 0 "$ex" "$WORK/p"
has "skipping $c1: notes.txt: checksum mismatch" <"$WORK/err" || fail "no fallback warning: $(cat "$WORK/err")"
has "^step 20 saved: $WORK/p/checkpoints/checkpoint_2\$" <"$WORK/out" || fail "resume: $(cat "$WORK/out")"
echo "ok: a pre-hook's file is saved, listed, verified and inspected with the checkpoint"
