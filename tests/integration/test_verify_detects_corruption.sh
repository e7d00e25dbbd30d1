#!/usr/bin/env bash
# ckpt verify catches a single flipped byte anywhere in any file of a
# checkpoint (safetensors header, tensor data, metadata, the manifest) and
# names the file; ckpt ls shows partial and corrupt checkpoints as such;
# ckpt inspect on malformed files fails cleanly with exit 3 and a message.
source "$(dirname "$0")/common.bash"

proj=$WORK/proj
run_rc 0 "$CKPT_BIN" train --epochs 1 --save-every 20 --total-limit 0 --quiet --project-dir "$proj"
good=$proj/checkpoints/checkpoint_1
run_rc 0 "$CKPT_BIN" verify "$good"
run_rc 0 "$CKPT_BIN" verify "$proj"

nfiles=0 nflips=0
for f in "$good"/*; do
    name=$(basename "$f")
    size=$(stat -c %s "$f")
    nfiles=$((nfiles + 1))
    # first byte, inside the 8-byte length or JSON header, the middle, the end
    for off in 0 5 9 40 $((size / 2)) $((size - 9)) $((size - 1)); do
        [ "$off" -ge 0 ] && [ "$off" -lt "$size" ] || continue
        bad=$WORK/bad
        rm -rf "$bad"
        cp -r "$good" "$bad"
        flip_byte "$bad/$name" "$off"
        run_rc 1 "$CKPT_BIN" verify "$bad"
        grep -q "$name" "$WORK/out" || { cat "$WORK/out" >&2; fail "verify did not name $name (byte $off)"; }
        nflips=$((nflips + 1))
    done
done
[ "$nfiles" -ge 8 ] || fail "expected at least 8 files in a checkpoint, found $nfiles"

# a flipped tensor byte: the message names the tensor
rm -rf "$bad"; cp -r "$good" "$bad"
flip_byte "$bad/model.safetensors" $(( $(stat -c %s "$bad/model.safetensors") - 100 ))
run_rc 1 "$CKPT_BIN" verify "$bad"
grep -q "fc3" "$WORK/out" || { cat "$WORK/out" >&2; fail "verify did not name the tensor"; }

# edits that keep the manifest valid JSON (the step; one digit of a file's
# checksum) are caught by the manifest's own checksum
edit_manifest() { # PYTHON-EXPR on the text t
    /usr/bin/python3 -c 'import re,sys; p=sys.argv[1]; t=open(p).read(); n=eval(sys.argv[2]); assert n!=t; open(p,"w").write(n)' \
        "$bad/checkpoint.json" "$1" || fail "could not edit the manifest with $1"
}
for expr in 't.replace("\"step\": 40", "\"step\": 41", 1)' \
            're.sub(r"(\"xxh3\": \")(.)", lambda m: m.group(1) + ("1" if m.group(2) == "0" else "0"), t, count=1)'; do
    rm -rf "$bad"; cp -r "$good" "$bad"
    edit_manifest "$expr"
    run_rc 1 "$CKPT_BIN" verify "$bad"
    grep -q "checkpoint.json.*changed after it was written" "$WORK/out" \
        || { cat "$WORK/out" >&2; fail "verify did not catch the manifest edit $expr"; }
done

# ls: a folder without a manifest is partial; a damaged one corrupt
cp -r "$good" "$proj/checkpoints/checkpoint_7"
rm "$proj/checkpoints/checkpoint_7/checkpoint.json"
flip_byte "$proj/checkpoints/checkpoint_0/optimizer.safetensors" 5000
run_rc 0 "$CKPT_BIN" ls "$proj"
grep -Eq "^0 .* corrupt " "$WORK/out" || { cat "$WORK/out" >&2; fail "ls: checkpoint_0 not corrupt"; }
grep -q "optimizer.safetensors" "$WORK/out" || fail "ls: no reason for the corruption"
grep -Eq "^1 .* complete " "$WORK/out" || fail "ls: checkpoint_1 not complete"
grep -Eq "^7 .* partial " "$WORK/out" || fail "ls: checkpoint_7 not partial"
run_rc 0 "$CKPT_BIN" ls --json "$proj"
/usr/bin/python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); s={c["number"]: c["status"] for c in d["checkpoints"]}; assert s[0]=="corrupt" and s[1]=="complete" and s[7]=="partial", s' "$WORK/out" \
    || fail "ls --json: wrong statuses"
run_rc 1 "$CKPT_BIN" verify "$proj"

# inspect: a good file works; malformed ones fail with exit 3, never a crash
run_rc 0 "$CKPT_BIN" inspect "$good/model.safetensors"
grep -q "fc1.weight .*F32 *\[256, 64\]" "$WORK/out" || fail "inspect: no fc1.weight line"
run_rc 0 "$CKPT_BIN" inspect --json "$good"
/usr/bin/python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); assert d["manifest"]["step"]==40; assert len(d["objects"])==7' "$WORK/out" \
    || fail "inspect --json: not the expected document"
m=$good/model.safetensors
printf 'not a safetensors file at all' >"$WORK/garbage.safetensors"
head -c 100 "$m" >"$WORK/truncated.safetensors"
head -c 1000 "$m" >"$WORK/short-data.safetensors"
printf '\xff\xff\xff\xff\xff\xff\xff\x7f{}' >"$WORK/huge-header.safetensors"
: >"$WORK/empty.safetensors"
{ printf '\x10\x00\x00\x00\x00\x00\x00\x00'; printf '{"a":{"dtype":1}'; } >"$WORK/bad-json.safetensors"
for f in garbage truncated short-data huge-header empty bad-json; do
    run_rc 3 "$CKPT_BIN" inspect "$WORK/$f.safetensors"
    grep -q "^ckpt: " "$WORK/err" || { cat "$WORK/err" >&2; fail "inspect $f: no 'ckpt: ' message"; }
done
run_rc 3 "$CKPT_BIN" inspect "$WORK/no-such-file"
run_rc 1 "$CKPT_BIN" verify "$WORK/short-data.safetensors"
run_rc 0 "$CKPT_BIN" verify "$good/model.safetensors"
echo "ok: $nflips flipped bytes in $nfiles files caught; ls and inspect behave"
