#!/usr/bin/env bash
# The command line: help and version, exit codes (0 ok, 1 differences or
# failed verification, 2 usage, 3 runtime error), messages on stderr as
# "ckpt: ...", train's refusals (existing project without --resume, a resume
# with other settings, a malformed data file), diff, prune and total-limit.
source "$(dirname "$0")/common.bash"

run_rc 0 "$CKPT_BIN" --version
grep -q "^ckpt 0\.[0-9]*\.[0-9]* (library " "$WORK/out" || fail "--version"
run_rc 0 "$CKPT_BIN" --help
cp "$WORK/out" "$WORK/help"
for c in train ls inspect verify diff prune; do
    grep -q "^  $c " "$WORK/help" || fail "--help does not list $c"
    run_rc 0 "$CKPT_BIN" "$c" --help
    grep -q "^usage: ckpt $c" "$WORK/out" || fail "$c --help"
done
run_rc 2 "$CKPT_BIN"
run_rc 2 "$CKPT_BIN" frobnicate
grep -q "^ckpt: unknown command 'frobnicate'" "$WORK/err" || fail "unknown command message"
run_rc 2 "$CKPT_BIN" train --epochs abc
grep -q "bad value for '--epochs'" "$WORK/err" || fail "bad value message"
run_rc 2 "$CKPT_BIN" train --no-such-option
run_rc 2 "$CKPT_BIN" train --epochs
run_rc 2 "$CKPT_BIN" verify
run_rc 2 "$CKPT_BIN" diff only-one
run_rc 2 "$CKPT_BIN" prune "$WORK"
run_rc 2 "$CKPT_BIN" ls --bogus "$WORK"
run_rc 3 "$CKPT_BIN" ls "$WORK/missing"
grep -q "^ckpt: " "$WORK/err" || fail "ls: no 'ckpt: ' message"

# a malformed data file is named with its line
printf '0,1,2\n' >"$WORK/bad.csv"
run_rc 3 "$CKPT_BIN" train --data "$WORK/bad.csv" --project-dir "$WORK/x" --quiet
grep -q "^ckpt: data: .*bad.csv:1: " "$WORK/err" || fail "bad data message"

# a run with every checkpoint kept: steps 10, 20, 30, 40 and the end (46);
# 2 loader threads by default
proj=$WORK/proj
run_rc 0 "$CKPT_BIN" train --epochs 1 --save-every 10 --total-limit 0 --quiet --project-dir "$proj"
[ "$(ls "$proj/checkpoints" | grep -c '^checkpoint_')" -eq 5 ] || fail "expected 5 checkpoints"
acc=$(grep "test accuracy" "$WORK/out")
[ "$(wc -l <"$proj/logs/metrics.jsonl")" -eq 46 ] || fail "metrics: expected 46 lines"
head -1 "$proj/logs/metrics.jsonl" | has '^{"step":1,"epoch":0,"loss":[0-9.e+-]*,"lr":[0-9.e+-]*,"scale":1024}$' \
    || fail "metrics line format"

# the same run with the data loaded in the training thread: the same bits
run_rc 0 "$CKPT_BIN" train --epochs 1 --save-every 10 --workers 0 --quiet --project-dir "$WORK/w0"
run_rc 0 "$CKPT_BIN" diff "$(latest_checkpoint "$proj")" "$(latest_checkpoint "$WORK/w0")"
cmp "$proj/logs/metrics.jsonl" "$WORK/w0/logs/metrics.jsonl" || fail "--workers 0: metrics differ"

# the same project again: refused without --resume; a different setting refused
run_rc 2 "$CKPT_BIN" train --epochs 1 --quiet --project-dir "$proj"
grep -q "already has checkpoints" "$WORK/err" || fail "no 'already has checkpoints'"
run_rc 2 "$CKPT_BIN" train --epochs 1 --lr 0.01 --resume --quiet --project-dir "$proj"
grep -q "^ckpt: resume: .*--lr" "$WORK/err" || fail "no --lr mismatch message"
# resuming a finished run changes nothing and reports the same accuracy
run_rc 0 "$CKPT_BIN" train --epochs 1 --resume --quiet --project-dir "$proj"
[ "$(grep "test accuracy" "$WORK/out")" = "$acc" ] || fail "finished run: accuracy changed"
[ "$(ls "$proj/checkpoints" | grep -c '^checkpoint_')" -eq 5 ] || fail "finished run saved again"
# --async polls every step (ckpt_save_poll): a background save is committed
# as soon as its files are written, and its failure ends the run at the next
# step, not at the next save (80 here; the first save's first fsync fails)
run_rc 3 env CKPT_FAULT=fsync:1:EIO "$CKPT_BIN" train --async --save-every 40 --epochs 2 \
    --workers 0 --quiet --project-dir "$WORK/poll"
grep -q "^ckpt: save: .*fsync: Input/output error" "$WORK/err" || fail "--async: no failure message"
last=$(tail -n 1 "$WORK/poll/logs/metrics.jsonl" | sed -n 's/^{"step":\([0-9]*\),.*/\1/p')
[ -n "$last" ] && [ "$last" -gt 40 ] && [ "$last" -lt 80 ] ||
    fail "--async: the run stopped at step ${last:-?}, expected between the two saves"

# --resume-from a checkpoint that is not there (a typo): a usage error naming
# the checkpoints there are, nothing saved or rotated
run_rc 2 "$CKPT_BIN" train --epochs 1 --resume-from "$proj/checkpoints/checkpoint_01" --quiet \
    --total-limit 1 --project-dir "$proj"
grep -q "checkpoint_01: no such checkpoint folder; .* holds checkpoint_0, checkpoint_1, .* and checkpoint_4" \
    "$WORK/err" || { cat "$WORK/err" >&2; fail "--resume-from a typo: message"; }
[ "$(ls "$proj/checkpoints" | grep -c '^checkpoint_')" -eq 5 ] || fail "--resume-from a typo rotated"
# --resume-from an existing one resumes from there (in a copy of the project)
cp -r "$proj" "$WORK/rf"
run_rc 0 "$CKPT_BIN" train --epochs 1 --resume-from "$WORK/rf/checkpoints/checkpoint_3" \
    --project-dir "$WORK/rf"
grep -q "^resumed from $WORK/rf/checkpoints/checkpoint_3 at step 40$" "$WORK/out" ||
    fail "--resume-from: no 'resumed from' line"
[ "$(grep "test accuracy" "$WORK/out")" = "$acc" ] || fail "--resume-from: another accuracy"

# diff: equal to itself; two steps differ in tensors and the manifest step
c0=$proj/checkpoints/checkpoint_0
c1=$proj/checkpoints/checkpoint_1
run_rc 0 "$CKPT_BIN" diff "$c0" "$c0"
grep -q "bit for bit" "$WORK/out" || fail "diff: not bit for bit"
run_rc 1 "$CKPT_BIN" diff "$c0" "$c1"
grep -q "^checkpoint.json: step: 10 vs 20" "$WORK/out" || fail "diff: no step difference"
grep -q "^model.safetensors: fc1.weight: max |a-b| = " "$WORK/out" || fail "diff: no fc1.weight line"
grep -q "^dataloader.safetensors: batches_yielded: 10 vs 20" "$WORK/out" || fail "diff: no loader line"
run_rc 1 "$CKPT_BIN" diff "$c0/model.safetensors" "$c1/model.safetensors"
run_rc 0 "$CKPT_BIN" diff --atol 100 "$c0/model.safetensors" "$c1/model.safetensors"
grep -q "within --atol" "$WORK/out" || fail "diff --atol"
run_rc 2 "$CKPT_BIN" diff "$c0" "$c1/model.safetensors"
run_rc 3 "$CKPT_BIN" diff "$c0/model.safetensors" "$WORK/missing.safetensors"
cp -r "$c0" "$WORK/c0-extra"
cp "$c0/model.safetensors" "$WORK/c0-extra/model_1.safetensors"
run_rc 1 "$CKPT_BIN" diff "$c0" "$WORK/c0-extra"
grep -q "^model_1.safetensors: only in B" "$WORK/out" || fail "diff: extra file not reported"

# prune keeps the newest N
run_rc 0 "$CKPT_BIN" prune "$proj" --keep 2
grep -q "^removed 3 checkpoints" "$WORK/out" || fail "prune: expected 3 removed"
[ "$(ls "$proj/checkpoints" | grep '^checkpoint_' | sort | tr '\n' ' ')" = "checkpoint_3 checkpoint_4 " ] \
    || fail "prune: wrong checkpoints left"

# --total-limit keeps the newest N during training
run_rc 0 "$CKPT_BIN" train --epochs 1 --save-every 10 --total-limit 2 --quiet --project-dir "$WORK/lim"
[ "$(ls "$WORK/lim/checkpoints" | grep '^checkpoint_' | sort | tr '\n' ' ')" = "checkpoint_3 checkpoint_4 " ] \
    || fail "total-limit: wrong checkpoints left"
echo "ok: command line behaves as documented"
