#!/usr/bin/env bash
# The folder tools never give a false result nor destroy the checkpoint a run
# needs: diff refuses what is not a checkpoint, a project or a state file
# (and compares projects by their newest valid checkpoints, saying which);
# prune and its dry run count only verified checkpoints, never remove the
# newest valid one, want --force for --keep 0, and clean up leftover
# temporary folders unless a save holds the lock; ls and verify show
# leftovers; a folder without manifest is "not a checkpoint"; verify names
# a PyTorch zip file; ls lists a checkpoint folder given to it; diff prints
# integer values as integers and inspect floats as the shortest round trip.
source "$(dirname "$0")/common.bash"

proj=$WORK/proj
run_rc 0 "$CKPT_BIN" train --epochs 1 --save-every 10 --total-limit 0 --quiet --project-dir "$proj"
cks=$proj/checkpoints
c0=$cks/checkpoint_0

# ---- diff: two projects are their newest valid checkpoints, said so
cp -r "$proj" "$WORK/copy"
flip_byte "$WORK/copy/checkpoints/checkpoint_4/model.safetensors" 3000
run_rc 1 "$CKPT_BIN" diff "$proj" "$WORK/copy"
grep -qx "A: $cks/checkpoint_4 (the newest valid checkpoint of $proj)" "$WORK/out" \
    || fail "diff: does not say which checkpoint of A"
grep -qx "B: $WORK/copy/checkpoints/checkpoint_3 (the newest valid checkpoint of $WORK/copy)" "$WORK/out" \
    || fail "diff: B is not the newest valid checkpoint"
grep -q "^checkpoint.json: step: 46 vs 40$" "$WORK/out" || fail "diff: projects not compared"
run_rc 0 "$CKPT_BIN" diff "$proj" "$cks/checkpoint_4"
grep -q "^equal: 29 tensors" "$WORK/out" || fail "diff: project vs its newest checkpoint"

# ---- diff: nothing is never "equal"
mkdir -p "$WORK/e1" "$WORK/e2" "$WORK/stuff/sub"
echo hello >"$WORK/stuff/a.txt"
echo hello >"$WORK/b.txt"
run_rc 2 "$CKPT_BIN" diff "$WORK/e1" "$WORK/e2"
grep -q "^ckpt diff: $WORK/e1 is not a checkpoint (no checkpoint.json) nor a project" "$WORK/err" \
    || fail "diff: empty folders"
! grep -q "equal" "$WORK/out" || fail "diff: empty folders called equal"
run_rc 2 "$CKPT_BIN" diff "$c0" "$WORK/stuff"
grep -q "$WORK/stuff is not a checkpoint" "$WORK/err" || fail "diff: B not named"
run_rc 2 "$CKPT_BIN" diff "$WORK/stuff/a.txt" "$WORK/b.txt"
grep -q "a.txt is not a checkpoint, a project or a safetensors file" "$WORK/err" || fail "diff: text files"
mkdir -p "$WORK/noval/checkpoints/checkpoint_0"
run_rc 3 "$CKPT_BIN" diff "$WORK/noval" "$proj"
grep -q "^ckpt: diff: project $WORK/noval has no valid checkpoint" "$WORK/err" || fail "diff: no valid"

# ---- diff prints integers as integers, exactly (2^53+1 vs 2^53)
# safetensors_i64 FILE V0 V1: a state file with one I64 tensor "x" of 2 elements
le64() {
    local v=$1 i out=
    for i in 0 1 2 3 4 5 6 7; do
        out+=$(printf '\\%03o' $(((v >> (8 * i)) & 255)))
    done
    printf "$out"
}
safetensors_i64() {
    local hdr='{"x":{"dtype":"I64","shape":[2],"data_offsets":[0,16]}}'
    { le64 ${#hdr}; printf '%s' "$hdr"; le64 "$2"; le64 "$3"; } >"$1"
}
safetensors_i64 "$WORK/i1.safetensors" 1 9007199254740993
safetensors_i64 "$WORK/i2.safetensors" 1 9007199254740992
run_rc 1 "$CKPT_BIN" diff "$WORK/i1.safetensors" "$WORK/i2.safetensors"
grep -qx "file: x: max |a-b| = 1, 1 of 2 elements differ (first at flat index 1: 9007199254740993 vs 9007199254740992)" \
    "$WORK/out" || fail "diff: integers not exact"
run_rc 1 "$CKPT_BIN" diff "$c0" "$cks/checkpoint_4"
grep -q "^random_states_0.safetensors: block: max |a-b| = [0-9]*, 4 of 4 elements differ (first at flat index 0: [0-9]* vs [0-9]*)$" \
    "$WORK/out" || fail "diff: u32 tensor not printed as integers"

# ---- inspect: shortest round-trip floats; a PyTorch zip file named as such
run_rc 0 "$CKPT_BIN" inspect "$c0"
grep -q "^    param_groups.0.betas.0 *= 0.9$" "$WORK/out" || fail "inspect: 0.9 not shortest"
grep -q "^    param_groups.0.eps *= 1e-08$" "$WORK/out" || fail "inspect: 1e-08 not shortest"
run_rc 0 "$CKPT_BIN" inspect --json "$c0"
has '"key":"param_groups.0.betas.1","kind":"f64","value":0.999}' <"$WORK/out" || fail "inspect --json: 0.999"
printf 'PK\003\004\024\000\000\000\000\000archive/data.pkl' >"$WORK/model.pt"
run_rc 2 "$CKPT_BIN" verify "$WORK/model.pt"
grep -q "model.pt is a PyTorch file (a zip archive, as torch.save writes), not safetensors" "$WORK/err" \
    || fail "verify: zip not recognised"
grep -q "save_file(torch.load(" "$WORK/err" || fail "verify: no advice for a zip"
grep -q "'ckpt inspect $WORK/model.pt' shows what it holds and the 'ckpt import' command" "$WORK/err" \
    || fail "verify: a zip does not point to ckpt inspect"
# inspect reads torch files (test_cli_hostile); a broken one is a clear error
run_rc 3 "$CKPT_BIN" inspect "$WORK/model.pt"
grep -q "^ckpt: inspect: .*model.pt" "$WORK/err" || fail "inspect: a broken zip not named"
run_rc 2 "$CKPT_BIN" inspect "$WORK/e1"
run_rc 2 "$CKPT_BIN" inspect "$proj"
grep -q "is a project folder" "$WORK/err" || fail "inspect: project"

# ---- a folder without manifest is not a checkpoint, not "an interrupted save"
mkdir "$WORK/notck"
cp "$c0/model.safetensors" "$WORK/notck/"
run_rc 1 "$CKPT_BIN" verify "$WORK/notck"
grep -q "$WORK/notck: not a checkpoint (no checkpoint.json)" "$WORK/out" || fail "verify: not a checkpoint"
! grep -q "interrupted" "$WORK/out" || fail "verify: 'interrupted save'"
run_rc 0 "$CKPT_BIN" inspect "$WORK/notck"
grep -q "^folder $WORK/notck$" "$WORK/out" || fail "inspect: folder header"
# an unrelated folder (no manifest, no state file, no checkpoint name) is a
# usage error naming it, not a "partial" checkpoint
mkdir "$WORK/unrelated"
run_rc 2 "$CKPT_BIN" verify "$WORK/unrelated"
grep -q "^ckpt verify: $WORK/unrelated is not a checkpoint (no checkpoint.json) nor a project" \
    "$WORK/err" || fail "verify: unrelated folder"

# ---- ls of a checkpoint folder lists it
run_rc 0 "$CKPT_BIN" ls "$cks/checkpoint_2"
[ "$(wc -l <"$WORK/out")" -eq 3 ] || fail "ls checkpoint: expected a header, one row and its objects"
grep -q "^         objects: model, optimizer, .*random_states_0$" "$WORK/out" \
    || fail "ls checkpoint: the objects it holds, by name"
# (the files unchanged since the previous checkpoint, such as the run's
# settings, are linked: the row says how many bytes it shares)
shared="\(([0-9.]* [KMG]\?i\?B shared with the previous)  \)\?"
grep -q "^2  *30  .*  complete  $cks/checkpoint_2  ${shared}test_loss=[0-9.e-]* test_acc=[0-9.e-]*$" \
    "$WORK/out" || fail "ls checkpoint: row (with the metrics ckpt train records)"

# ---- prune: valid checkpoints only; the newest valid one stays
left() { ls -A "$1/checkpoints" | grep -v '^\.lock$' | sort | tr '\n' ' '; }
cp -r "$proj" "$WORK/p"
p=$WORK/p
flip_byte "$p/checkpoints/checkpoint_4/model.safetensors" 3000   # the newest is corrupt
mkdir "$p/checkpoints/.checkpoint_5.tmp.999999999"              # a killed save's leftover
run_rc 0 "$CKPT_BIN" ls "$p"
grep -qx "leftover $p/checkpoints/.checkpoint_5.tmp.999999999  (temporary folder of an interrupted save; 'ckpt prune $p --keep N' removes it)" \
    "$WORK/out" || fail "ls: leftover not shown"
run_rc 0 "$CKPT_BIN" ls --json "$p"
has '"leftovers":\[{"path":".*/.checkpoint_5.tmp.999999999","pid":999999999,"running":false}\]}$' \
    <"$WORK/out" || fail "ls --json: leftovers"
run_rc 1 "$CKPT_BIN" verify "$p"
grep -q "^leftover $p/checkpoints/.checkpoint_5.tmp.999999999 " "$WORK/out" || fail "verify: leftover not shown"

run_rc 2 "$CKPT_BIN" prune "$p" --keep 0
grep -q "add --force" "$WORK/err" || fail "prune --keep 0 without --force"
run_rc 0 "$CKPT_BIN" prune "$p" --keep 1 --dry-run
cat >"$WORK/want" <<EOF
would remove $p/checkpoints/.checkpoint_5.tmp.999999999  (temporary folder of an interrupted save)
would remove $p/checkpoints/checkpoint_0  (valid, older than the newest 1 valid)
would remove $p/checkpoints/checkpoint_1  (valid, older than the newest 1 valid)
would remove $p/checkpoints/checkpoint_2  (valid, older than the newest 1 valid)
would remove 3 checkpoints and 1 leftover folder from $p, would keep 1 valid checkpoint: the newest 1
EOF
diff "$WORK/want" "$WORK/out" || fail "prune --dry-run output"
[ "$(left "$p")" = ".checkpoint_5.tmp.999999999 checkpoint_0 checkpoint_1 checkpoint_2 checkpoint_3 checkpoint_4 " ] \
    || fail "prune --dry-run removed something"

# while a save holds the lock, prune removes nothing and says so
exec 9>"$p/checkpoints/.lock"
flock 9
run_rc 3 "$CKPT_BIN" prune "$p" --keep 1
grep -q "is held by another process.*nothing removed" "$WORK/err" || fail "prune: busy not said"
[ -d "$p/checkpoints/.checkpoint_5.tmp.999999999" ] || fail "prune: removed a leftover under a held lock"
exec 9>&-

run_rc 0 "$CKPT_BIN" prune "$p" --keep 1
grep -q "^removed 3 checkpoints and 1 leftover folder from $p, kept 1 valid checkpoint: the newest 1$" "$WORK/out" \
    || fail "prune: summary"
[ "$(left "$p")" = "checkpoint_3 checkpoint_4 " ] || fail "prune: wrong folders left: $(left "$p")"
# the run still resumes (from checkpoint_3, the corrupt newest is skipped)
run_rc 0 "$CKPT_BIN" diff "$p" "$proj/checkpoints/checkpoint_3"

# a partial or corrupt checkpoint older than the newest valid one goes
mkdir "$p/checkpoints/checkpoint_9"
flip_byte "$p/checkpoints/checkpoint_3/model.safetensors" 3000
cp -r "$proj/checkpoints/checkpoint_2" "$p/checkpoints/checkpoint_2"
run_rc 0 "$CKPT_BIN" prune "$p" --keep 5
[ "$(left "$p")" = "checkpoint_2 checkpoint_3 checkpoint_4 checkpoint_9 " ] \
    || fail "prune: removed an invalid checkpoint newer than the newest valid"
cp -r "$proj/checkpoints/checkpoint_4" "$p/checkpoints/checkpoint_10"
run_rc 0 "$CKPT_BIN" prune "$p" --keep 5
grep -q "^removing $p/checkpoints/checkpoint_3  (not valid, older than the newest valid checkpoint: .*checksum mismatch)$" \
    "$WORK/out" || fail "prune: reason for a corrupt one"
[ "$(left "$p")" = "checkpoint_10 checkpoint_2 " ] || fail "prune: invalid ones kept: $(left "$p")"
# none valid: nothing goes, and the summary does not claim a valid one
flip_byte "$p/checkpoints/checkpoint_10/model.safetensors" 3000
flip_byte "$p/checkpoints/checkpoint_2/model.safetensors" 3000
run_rc 0 "$CKPT_BIN" prune "$p" --keep 1
grep -q "^removed 0 checkpoints and 0 leftover folders from $p, kept every checkpoint: none is valid" \
    "$WORK/out" || fail "prune: summary with no valid checkpoint: $(cat "$WORK/out")"
[ "$(left "$p")" = "checkpoint_10 checkpoint_2 " ] || fail "prune removed with none valid"
run_rc 0 "$CKPT_BIN" prune "$p" --keep 0 --force
grep -q "kept none (--keep 0)$" "$WORK/out" || fail "prune --keep 0: summary"
[ "$(left "$p")" = "" ] || fail "prune --keep 0 --force"
echo "ok: diff, prune, ls, verify and inspect are exact about what they were given"
