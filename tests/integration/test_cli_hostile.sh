#!/usr/bin/env bash
# What files say never takes over the terminal, and the smaller promises of
# the tools:
#  - a tensor name with ESC sequences and newlines reaches inspect, diff,
#    verify and error messages only escaped (\x1b, \n), never raw; --json
#    stays valid JSON with the name intact;
#  - a 2 KB torch file whose one deflated storage 64 keys share would import
#    as 64 MiB: refused before anything is written, sizes printed, and
#    imported once --max-output-size allows it;
#  - prune --keep-best with a metric no checkpoint records: exit 2, nothing
#    removed; --dry-run names only the policies given;
#  - 'ckpt help train' is train's help; diff prints step 20 as 20;
#  - inspect reads torch files through the allow-list reader, and its import
#    advice works.
source "$(dirname "$0")/common.bash"

# raw_ctl FILE: fails if FILE holds an ESC byte or a line that a name's
# newline started
raw_ctl() {
    python3 - "$1" <<'PY'
import sys
d = open(sys.argv[1], "rb").read()
bad = b"\x1b" in d or b"\nINJECTED" in d or b"\x9b" in d
sys.exit(1 if bad else 0)
PY
}

# ---- crafted safetensors: names with ESC sequences, a newline, a C1 CSI
python3 - "$WORK" <<'PY'
import json, struct, sys
def st(path, entries):
    hdr, data = {}, b""
    for k, v in entries:
        raw = struct.pack("<2f", *v)
        hdr[k] = {"dtype": "F32", "shape": [2], "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    h = json.dumps(hdr).encode()
    open(path, "wb").write(struct.pack("<Q", len(h)) + h + data)
evil = "\x1b[2J\x1b]0;pwned\x07red\nINJECTED line\u009b31m"
st(sys.argv[1] + "/a.safetensors", [(evil, (1, 2)), ("ok", (0, 0))])
st(sys.argv[1] + "/b.safetensors", [(evil, (1, 3)), ("ok", (0, 0))])
# a malformed one whose error message quotes the name
h = json.dumps({evil: {"dtype": "Q9", "shape": [2], "data_offsets": [0, 8]}}).encode()
open(sys.argv[1] + "/bad.safetensors", "wb").write(struct.pack("<Q", len(h)) + h + b"\0" * 8)
PY
run_rc 0 "$CKPT_BIN" inspect "$WORK/a.safetensors"
raw_ctl "$WORK/out" || fail "inspect prints raw control characters"
grep -qF '\x1b[2J\x1b]0;pwned\x07red\nINJECTED line\xc2\x9b31m' "$WORK/out" \
    || { cat -v "$WORK/out" >&2; fail "inspect: the name is not shown escaped"; }
run_rc 0 "$CKPT_BIN" inspect --json "$WORK/a.safetensors"
raw_ctl "$WORK/out" || fail "inspect --json prints raw control characters"
python3 -c '
import json, sys
d = json.load(open(sys.argv[1]))
keys = [e["key"] for e in d["objects"][0]["entries"]]
assert keys[0] == "\x1b[2J\x1b]0;pwned\x07red\nINJECTED line\u009b31m", keys' "$WORK/out" \
    || fail "inspect --json: the name does not round-trip"
run_rc 1 "$CKPT_BIN" diff "$WORK/a.safetensors" "$WORK/b.safetensors"
raw_ctl "$WORK/out" || fail "diff prints raw control characters"
grep -qF 'file: \x1b[2J' "$WORK/out" || fail "diff: the name is not shown escaped"
run_rc 0 "$CKPT_BIN" verify "$WORK/a.safetensors"
run_rc 1 "$CKPT_BIN" verify "$WORK/bad.safetensors"
raw_ctl "$WORK/out" || fail "verify prints raw control characters"
run_rc 3 "$CKPT_BIN" inspect "$WORK/bad.safetensors"
raw_ctl "$WORK/err" || fail "an error message prints raw control characters"
grep -q '^ckpt: inspect: ' "$WORK/err" || fail "inspect: no error for a bad dtype"

# ---- import amplification: 64 keys share one deflated storage of 1 MiB (each
# one element further in, so that they are views of their own, not tied weights)
python3 - "$WORK/amp.bin" <<'PY'
import io, struct, sys, zipfile
def uni(s):
    b = s.encode()
    return b"X" + struct.pack("<I", len(b)) + b
numel = 1 << 18  # 1 MiB of float32 zeros
def tensor(i):
    p = b"ctorch._utils\n_rebuild_tensor_v2\n(("
    p += uni("storage") + b"ctorch\nFloatStorage\n" + uni("0") + uni("cpu")
    p += b"J" + struct.pack("<i", numel + 64) + b"tQ" + b"J" + struct.pack("<i", i)
    p += b"(J" + struct.pack("<i", numel) + b"t(J" + struct.pack("<i", 1) + b"t"
    p += b"\x89ccollections\nOrderedDict\n)RtR"
    return p
pkl = b"\x80\x02}(" + b"".join(uni("w%d" % i) + tensor(i) for i in range(64)) + b"u."
buf = io.BytesIO()
with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
    z.writestr("archive/data.pkl", pkl)
    z.writestr("archive/data/0", b"\0" * (4 * (numel + 64)))
    z.writestr("archive/version", "3\n")
open(sys.argv[1], "wb").write(buf.getvalue())
PY
[ "$(stat -c %s "$WORK/amp.bin")" -lt 4096 ] || fail "the crafted file is not small"
run_rc 3 "$CKPT_BIN" import "$WORK/amp.bin" "$WORK/amp_ck"
grep -q "^read 1.[0-9] KiB ([0-9]* bytes); the checkpoint will hold 64.0 MiB (671089[0-9][0-9] bytes) of tensors$" "$WORK/out" \
    || { cat "$WORK/out" "$WORK/err" >&2; fail "import: the size is not printed first"; }
grep -q "over the limit of 1048576 (64 times the input, at least 1 MiB)" "$WORK/err" \
    || { cat "$WORK/err" >&2; fail "import: the cap is not explained"; }
grep -q -- "--max-output-size" "$WORK/err" || fail "import: the flag is not named"
[ ! -e "$WORK/amp_ck" ] || fail "import: a refused import left a checkpoint"
[ -z "$(ls -A "$WORK" | grep amp_ck)" ] || fail "import: a refused import left a temporary folder"
run_rc 0 "$CKPT_BIN" import --max-output-size 70MB "$WORK/amp.bin" "$WORK/amp_ck"
run_rc 0 "$CKPT_BIN" verify "$WORK/amp_ck"
run_rc 2 "$CKPT_BIN" import --max-output-size lots "$WORK/amp.bin" "$WORK/amp_ck2"

# ---- a real run for the rest
proj=$WORK/proj
run_rc 0 "$CKPT_BIN" train --epochs 1 --save-every 20 --total-limit 0 --quiet --project-dir "$proj"
cks=$proj/checkpoints

# prune --keep-best with a metric nothing records: exit 2, nothing removed
before=$(ls "$cks")
run_rc 2 "$CKPT_BIN" prune "$proj" --keep-best test_los:min:2
grep -q "no checkpoint of $proj records the metric 'test_los' (they record: test_loss, test_acc)" \
    "$WORK/err" || { cat "$WORK/err" >&2; fail "prune: an unrecorded metric not refused"; }
[ "$(ls "$cks")" = "$before" ] || fail "prune: a refused --keep-best removed checkpoints"
# --dry-run names only the policies given
run_rc 0 "$CKPT_BIN" prune "$proj" --keep-best test_loss:min:1 --dry-run
grep -q "not kept by --keep-best test_loss:min:1)$" "$WORK/out" || { cat "$WORK/out" >&2; fail "prune --dry-run: policies"; }
! grep -q "keep-every" "$WORK/out" || fail "prune --dry-run names --keep-every, which was not given"
run_rc 0 "$CKPT_BIN" prune "$proj" --keep 2 --keep-every 40 --dry-run
grep -q "not kept by --keep 2 or --keep-every 40)$" "$WORK/out" || { cat "$WORK/out" >&2; fail "prune --dry-run: two policies"; }
! grep -q "keep-best" "$WORK/out" || fail "prune --dry-run names --keep-best, which was not given"

# help CMD
run_rc 0 "$CKPT_BIN" help train
head -1 "$WORK/out" | has "^usage: ckpt train" || fail "'ckpt help train' is not train's help"
run_rc 2 "$CKPT_BIN" help nothing

# diff: steps as integers, never 2e+01
run_rc 1 "$CKPT_BIN" diff "$cks/checkpoint_0" "$cks/checkpoint_1"
grep -q "^optimizer.safetensors: state.0.step: max |a-b| = 20, 1 of 1 elements differ (first at flat index 0: 20 vs 40)$" \
    "$WORK/out" || { cat "$WORK/out" >&2; fail "diff: step not printed as an integer"; }
! grep -q "e+0" "$WORK/out" || fail "diff: a number in exponent form"

# inspect of torch files: tensors through the safe reader, advice that works
run_rc 0 "$CKPT_BIN" export "$cks/checkpoint_1" "$WORK/exp"
run_rc 0 "$CKPT_BIN" inspect "$WORK/exp/optimizer.bin"
grep -q "^    state.0.exp_avg *F32   \[256, 64\]  65536 bytes$" "$WORK/out" || fail "inspect: torch tensors"
grep -q "'ckpt import --optimizer adamw $WORK/exp CHECKPOINT_DIR'" "$WORK/out" \
    || { cat "$WORK/out" >&2; fail "inspect: no working import advice for optimizer.bin"; }
run_rc 0 "$CKPT_BIN" import --optimizer adamw "$WORK/exp" "$WORK/reimp"
run_rc 0 "$CKPT_BIN" export --bin --weights-only "$cks/checkpoint_1" "$WORK/expbin"
run_rc 0 "$CKPT_BIN" inspect --json "$WORK/expbin/pytorch_model.bin"
python3 -c '
import json, sys
d = json.load(open(sys.argv[1]))
assert d["format"] == "torch" and d["tensors"] == 6, d
assert {"key": "fc3.bias", "kind": "tensor", "dtype": "F32", "shape": [10], "bytes": 40} in d["entries"]
' "$WORK/out" || fail "inspect --json of a torch file"
run_rc 0 "$CKPT_BIN" inspect "$WORK/expbin/pytorch_model.bin"
grep -q "'ckpt import $WORK/expbin/pytorch_model.bin CHECKPOINT_DIR'" "$WORK/out" || fail "inspect: model advice"
run_rc 0 "$CKPT_BIN" import "$WORK/expbin/pytorch_model.bin" "$WORK/reimp2"
run_rc 0 "$CKPT_BIN" diff "$WORK/reimp2/model.safetensors" "$cks/checkpoint_1/model.safetensors"
echo "ok"
