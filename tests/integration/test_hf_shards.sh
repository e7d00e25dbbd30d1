#!/usr/bin/env bash
# max_shard_size end to end: `ckpt train --max-shard-size` saves the model as
# Hugging Face shards plus model.safetensors.index.json inside each atomic
# checkpoint; the files are what transformers reads (checked here with a
# plain reader of the index and the safetensors bytes); a run resumed from
# them ends bit for bit where an unsharded run ends; verify, inspect, diff,
# export and ckpt_torch all read the layout; damage in a shard is named.
source "$(dirname "$0")/common.bash"

T="--epochs 2 --save-every 20 --total-limit 0 --quiet --workers 0"
run_rc 0 "$CKPT_BIN" train $T --project-dir "$WORK/plain"
run_rc 0 "$CKPT_BIN" train $T --project-dir "$WORK/hf" --max-shard-size 100KB
ck="$WORK/hf/checkpoints/checkpoint_0"
for f in model-00001-of-00003.safetensors model-00002-of-00003.safetensors \
    model-00003-of-00003.safetensors model.safetensors.index.json; do
    [ -f "$ck/$f" ] || fail "checkpoint_0 has no $f"
done
[ ! -e "$ck/model.safetensors" ] || fail "a sharded checkpoint also has model.safetensors"

# the layout as transformers reads it: the index names every tensor's file, each
# file is a plain safetensors file, total_size is the tensors' bytes
python3 - "$ck" "$WORK/plain/checkpoints/checkpoint_0/model.safetensors" <<'PY' || fail "HF layout"
import json, struct, sys, os
ck, plain = sys.argv[1], sys.argv[2]
def tensors(path):
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    h = json.loads(raw[8:8 + n]); h.pop("__metadata__", None)
    return {k: (v["dtype"], v["shape"], raw[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]]) for k, v in h.items()}
idx = json.load(open(os.path.join(ck, "model.safetensors.index.json")))
got = {}
for f in sorted(set(idx["weight_map"].values())):
    part = tensors(os.path.join(ck, f))
    assert all(idx["weight_map"][k] == f for k in part), f
    assert os.path.getsize(os.path.join(ck, f)) < 100e3 + 4096 or len(part) == 1, f
    got.update(part)
want = tensors(plain)
assert got == want, "shards differ from the unsharded model"
assert idx["metadata"]["total_size"] == sum(len(v[2]) for v in want.values())
PY

# every checkpoint verifies; the sharded run equals the plain run, checkpoint by checkpoint
run_rc 0 "$CKPT_BIN" verify "$WORK/hf"
run_rc 0 "$CKPT_BIN" diff "$WORK/hf" "$WORK/plain"
grep -q "equal: .* bit for bit" "$WORK/out" || fail "sharded and plain runs differ"
run_rc 0 "$CKPT_BIN" inspect "$ck"
grep -q "^model.safetensors (Hugging Face shards: model.safetensors.index.json): 6 entries" "$WORK/out" \
    || { cat "$WORK/out" >&2; fail "inspect does not show the sharded model"; }

# resume from a sharded checkpoint: the same end as the plain run
n=$(ls -d "$WORK"/hf/checkpoints/checkpoint_* | wc -l)
for d in "$WORK"/hf/checkpoints/checkpoint_*; do
    [ "${d##*_}" -ge 2 ] && rm -rf "$d"
done
run_rc 0 "$CKPT_BIN" train $T --project-dir "$WORK/hf" --max-shard-size 100KB --resume
run_rc 0 "$CKPT_BIN" diff "$(latest_checkpoint "$WORK/hf")" "$(latest_checkpoint "$WORK/plain")"
[ "$(ls -d "$WORK"/hf/checkpoints/checkpoint_* | wc -l)" -eq "$n" ] || fail "resume made $n checkpoints?"

# export reads the shards; ckpt_torch loads them
run_rc 0 "$CKPT_BIN" export "$ck" "$WORK/exp"
run_rc 0 "$CKPT_BIN" diff "$WORK/exp/model.safetensors" "$WORK/plain/checkpoints/checkpoint_0/model.safetensors"
PYTHONPATH="$CKPT_SOURCE_DIR/python" "${CKPT_PYTHON:-python3}" -B -c '
import sys, ckpt_torch
r = ckpt_torch.load(sys.argv[1], as_torch=False)
assert sorted(r["model"]) == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight", "fc3.bias", "fc3.weight"]
' "$ck" || fail "ckpt_torch does not load the sharded model"

# a flipped byte in a shard: named by verify and by the loader
flip_byte "$ck/model-00002-of-00003.safetensors" 300
run_rc 1 "$CKPT_BIN" verify "$ck"
grep -q "model-00002-of-00003.safetensors" "$WORK/out" || { cat "$WORK/out" >&2; fail "verify does not name the shard"; }
flip_byte "$ck/model-00002-of-00003.safetensors" 300

# a damaged index is said to be a shard index that does not parse (JSON), by
# ckpt verify and by ckpt_torch, never a bad safetensors header
flip_byte "$ck/model.safetensors.index.json" 0
run_rc 1 "$CKPT_BIN" verify "$ck"
has "model.safetensors.index.json: checksum mismatch and the shard index does not parse: .*not valid JSON" \
    <"$WORK/out" || fail "verify of a damaged index: $(cat "$WORK/out")"
! has "header" <"$WORK/out" || fail "a damaged index is called a bad header"
PYTHONPATH="$CKPT_SOURCE_DIR/python" "${CKPT_PYTHON:-python3}" -B -c '
import sys, ckpt_torch
try:
    ckpt_torch.verify(sys.argv[1])
except ckpt_torch.CorruptError as e:
    assert "model.safetensors.index.json: checksum mismatch and the shard index does not parse: not valid JSON" in str(e), e
    assert "header" not in str(e), e
else:
    raise SystemExit("verify passed a damaged index")
' "$ck" || fail "ckpt_torch.verify of a damaged index"
flip_byte "$ck/model.safetensors.index.json" 0
run_rc 0 "$CKPT_BIN" verify "$ck"
run_rc 2 "$CKPT_BIN" train --max-shard-size 0 --project-dir "$WORK/bad"
echo "ok"
