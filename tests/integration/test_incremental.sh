#!/usr/bin/env bash
# Incremental saves end to end: a fine-tune with --freeze and --link-copies 1
# writes its frozen layers once and links them at every later save (same
# inode, bytes written per save printed, ckpt ls / inspect show what is
# shared); a run started with --init-from such a checkpoint links its frozen
# file too; verify of a project names every checkpoint that shares a damaged
# file; pruning the old checkpoints leaves the newest complete. With the
# default (--link-copies 2) the second save writes a second copy, later
# ones link, and one damaged copy leaves a checkpoint that loads.
source "$(dirname "$0")/common.bash"
FREEZE=(--freeze 'fc1.*' --freeze 'fc2.*')
inode() { stat -c %i "$1"; }

base=$WORK/base
run_rc 0 "$CKPT_BIN" train --epochs 1 --save-every 20 --total-limit 0 --project-dir "$base" \
    --link-copies 1 "${FREEZE[@]}"
grep -q "^bytes written per save: .* the first, then .* on average" "$WORK/out" ||
    fail "no bytes-per-save line: $(cat "$WORK/out")"
cks=$base/checkpoints
frozen=model.frozen.safetensors
for n in 0 1 2; do [ -f "$cks/checkpoint_$n/$frozen" ] || fail "checkpoint_$n has no $frozen"; done
[ "$(inode "$cks/checkpoint_0/$frozen")" = "$(inode "$cks/checkpoint_2/$frozen")" ] ||
    fail "the frozen file was written again, not linked"
[ "$(inode "$cks/checkpoint_1/model.safetensors")" != \
    "$(inode "$cks/checkpoint_2/model.safetensors")" ] || fail "the trained layers were linked"
# the saves after the first wrote a small share of the first's bytes
pct=$(sed -n 's/^bytes written per save: .* on average (\([0-9.]*\)%.*/\1/p' "$WORK/out")
[ -n "$pct" ] || fail "could not read the bytes-per-save line"
awk -v p="$pct" 'BEGIN { exit !(p < 20) }' || fail "later saves wrote $pct% of the first's bytes"

run_rc 0 "$CKPT_BIN" ls "$base"
grep "checkpoint_1" "$WORK/out" | has "KiB shared with the previous" || fail "ls shows no sharing"
run_rc 0 "$CKPT_BIN" ls --json "$base"
has '"shared_bytes":[1-9]' <"$WORK/out" || fail "ls --json has no shared_bytes"
run_rc 0 "$CKPT_BIN" inspect "$cks/checkpoint_2"
has "shared with the previous checkpoint" <"$WORK/out" || fail "inspect shows no sharing"
run_rc 0 "$CKPT_BIN" verify "$base"

# the model split over two files reads as one: export writes one
# model.safetensors, ckpt_torch loads every parameter
run_rc 0 "$CKPT_BIN" export "$cks/checkpoint_2" "$WORK/exp"
run_rc 0 "$CKPT_BIN" inspect "$WORK/exp/model.safetensors"
for k in fc1.weight fc1.bias fc2.weight fc2.bias fc3.weight fc3.bias; do
    has "^    $k " <"$WORK/out" || fail "export: $k is missing from model.safetensors"
done
PYTHONPATH="$CKPT_SOURCE_DIR/python" "${CKPT_PYTHON:-python3}" -B -c '
import sys, ckpt_torch
m = ckpt_torch.load(sys.argv[1], as_torch=False)["files"]["model"]
assert sorted(m) == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight", "fc3.bias",
                     "fc3.weight"], sorted(m)
' "$cks/checkpoint_2" || fail "ckpt_torch does not read the whole model"

for n in 0 1 2; do [ ! -e "$cks/checkpoint_$n/model-00001-of-00001.safetensors" ] ||
    fail "checkpoint_$n still has a file named as a Hugging Face shard"; done
run_rc 0 "$CKPT_BIN" inspect "$cks/checkpoint_2"
has "^  1 process, format 3," <"$WORK/out" || fail "the frozen layout is not format 3"

# a version 2 checkpoint (the frozen file named model-00001-of-00001): made
# from a copy of checkpoint_2, its manifest rewritten with its digest
old=$WORK/old
mkdir -p "$old/checkpoints"
cp -r "$cks/checkpoint_2" "$old/checkpoints/checkpoint_0"
o=$old/checkpoints/checkpoint_0
mv "$o/$frozen" "$o/model-00001-of-00001.safetensors"
"${CKPT_PYTHON:-python3}" -B - "$o/checkpoint.json" <<'PY' || fail "could not rewrite the manifest"
import sys, xxhash
path = sys.argv[1]
t = open(path, "rb").read()
t = t.replace(b'"name": "model.frozen.safetensors"', b'"name": "model-00001-of-00001.safetensors"')
t = t.replace(b'"format_version": 3,', b'"format_version": 2,')
key = b'"manifest_xxh3": "'
at = t.index(key) + len(key)
zeroed = t[:at] + b"0" * 16 + t[at + 16:]
open(path, "wb").write(t[:at] + b"%016x" % xxhash.xxh3_64_intdigest(zeroed) + t[at + 16:])
PY
run_rc 0 "$CKPT_BIN" verify "$o"
run_rc 0 "$CKPT_BIN" inspect "$o"
has "^  1 process, format 2," <"$WORK/out" || fail "the copy is not format 2"
has "^model-00001-of-00001.safetensors: .*frozen tensors of model.safetensors" <"$WORK/out" ||
    fail "inspect does not say what the version 2 frozen file holds: $(cat "$WORK/out")"
run_rc 0 "$CKPT_BIN" export "$o" "$WORK/exp2"
run_rc 0 "$CKPT_BIN" diff "$WORK/exp2/model.safetensors" "$WORK/exp/model.safetensors"
PYTHONPATH="$CKPT_SOURCE_DIR/python" "${CKPT_PYTHON:-python3}" -B -c '
import sys, ckpt_torch
m = ckpt_torch.load(sys.argv[1], as_torch=False)["files"]["model"]
assert len(m) == 6, sorted(m)
' "$o" || fail "ckpt_torch does not read a version 2 frozen file"
run_rc 0 "$CKPT_BIN" train --epochs 2 --save-every 20 --project-dir "$old" --resume \
    "${FREEZE[@]}" --quiet
n=$(latest_checkpoint "$old")
[ -f "$n/$frozen" ] || fail "the save after a version 2 resume did not write $frozen"

# --init-from: the fine-tune's first save links the frozen file of the
# checkpoint it started from
ft=$WORK/ft
run_rc 0 "$CKPT_BIN" train --epochs 1 --save-every 20 --project-dir "$ft" --init-from "$base" \
    --link-copies 1 "${FREEZE[@]}" --quiet
[ "$(inode "$ft/checkpoints/checkpoint_0/$frozen")" = "$(inode "$cks/checkpoint_2/$frozen")" ] ||
    fail "--init-from did not link the base's frozen file"

# one damaged copy: verify fails and names every checkpoint that holds it
flip_byte "$cks/checkpoint_1/$frozen" 100
run_rc 1 "$CKPT_BIN" verify "$base"
has "$frozen is one copy on disk shared by: checkpoint_0 checkpoint_1 checkpoint_2" <"$WORK/out" ||
    fail "verify does not name the checkpoints sharing the damaged file: $(cat "$WORK/out")"
flip_byte "$cks/checkpoint_1/$frozen" 100
run_rc 0 "$CKPT_BIN" verify "$base"

# deleting the old checkpoints (prune) never breaks the newest
run_rc 0 "$CKPT_BIN" prune "$base" --keep 1
[ ! -e "$cks/checkpoint_0" ] && [ ! -e "$cks/checkpoint_1" ] || fail "prune kept old checkpoints"
run_rc 0 "$CKPT_BIN" verify "$cks/checkpoint_2"
run_rc 0 "$CKPT_BIN" train --epochs 2 --save-every 20 --project-dir "$base" --resume \
    --link-copies 1 "${FREEZE[@]}" --quiet
run_rc 0 "$CKPT_BIN" verify "$base"

# the default: retained checkpoints are independent copies. The second save
# writes the frozen file again, the third links it; a flipped byte in the
# copy the newest two share leaves checkpoint_0, and a resume loads it.
two=$WORK/two
run_rc 0 "$CKPT_BIN" train --epochs 1 --save-every 20 --total-limit 0 --project-dir "$two" \
    "${FREEZE[@]}" --quiet
c2=$two/checkpoints
[ "$(inode "$c2/checkpoint_0/$frozen")" != "$(inode "$c2/checkpoint_1/$frozen")" ] ||
    fail "--link-copies 2: the second save linked the frozen file"
[ "$(inode "$c2/checkpoint_1/$frozen")" = "$(inode "$c2/checkpoint_2/$frozen")" ] ||
    fail "--link-copies 2: the third save wrote the frozen file again"
flip_byte "$c2/checkpoint_2/$frozen" 100
run_rc 1 "$CKPT_BIN" verify "$two"
has "$frozen is one copy on disk shared by: checkpoint_1 checkpoint_2" <"$WORK/out" ||
    fail "verify does not name the two sharing the damaged copy: $(cat "$WORK/out")"
run_rc 0 "$CKPT_BIN" train --epochs 2 --save-every 20 --total-limit 0 --project-dir "$two" \
    --resume "${FREEZE[@]}"
grep -q "^resumed from $c2/checkpoint_0 at step 20$" "$WORK/out" ||
    fail "no resume from the other copy: $(cat "$WORK/out" "$WORK/err")"
echo "ok: frozen layers linked across saves and --init-from, sharing shown, damage named, two copies by default"
