"""An independent reader of our state-dict files, written from the safetensors
specification (not from the C code) with json + numpy only.

    /usr/bin/python3 test_safetensors_independent.py <build dir>

Runs <build dir>/tests/gen_statedict, parses the file it writes, checks every
rule of the format and of our __metadata__ "ckpt" document, and every value
against the formulas documented in tests/progs/gen_statedict.c. Exits non-zero
on the first failure. PyTorch is blocked on purpose: reading our files must
never need it.
"""

import base64
import json
import math
import os
import struct
import subprocess
import sys
import tempfile

# Make any accidental `import torch` fail: the files must be readable without it.
sys.modules["torch"] = None

import numpy as np  # noqa: E402

MAX_HEADER = 100_000_000
SIZES = {  # bits per element
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32,
    "F64": 64, "I64": 64, "U64": 64, "C64": 64,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}
NUMPY = {
    "F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2",
    "I8": "i1", "U64": "<u8", "U32": "<u4", "U16": "<u2", "U8": "u1", "BOOL": "u1",
    "C64": "<c8", "BF16": "<u2",
}
N = 12


class Failure(Exception):
    pass


def check(cond, msg):
    if not cond:
        raise Failure(msg)


def no_duplicates(pairs):
    keys = [k for k, _ in pairs]
    check(len(keys) == len(set(keys)), f"duplicate JSON key among {keys}")
    return dict(pairs)  # dicts keep insertion order


def parse(raw):
    """Validates the file and returns (header dict in file order, data bytes)."""
    check(len(raw) >= 8, "file is shorter than 8 bytes")
    (n,) = struct.unpack("<Q", raw[:8])
    check(n <= MAX_HEADER, f"header length {n} over the limit")
    check(8 + n <= len(raw), "header extends past end of file")
    text = raw[8:8 + n]
    check(text[:1] == b"{", "header does not start with '{'")
    stripped = text.rstrip(b" ")
    check(stripped.endswith(b"}"), "padding other than spaces")
    check((8 + n) % 8 == 0, f"8 + N = {8 + n} is not a multiple of 8 (reference writer pads)")
    check(len(text) - len(stripped) < 8, "more padding than needed")
    header = json.loads(stripped.decode("utf-8"), object_pairs_hook=no_duplicates)
    check(isinstance(header, dict), "header is not an object")
    keys = list(header)
    check(keys[0] == "__metadata__", f"__metadata__ is not first: {keys[:3]}")
    meta = header["__metadata__"]
    check(isinstance(meta, dict), "__metadata__ is not an object")
    for k, v in meta.items():
        check(isinstance(v, str), f"__metadata__[{k!r}] is not a string")
    check(meta.get("format") == "pt", "__metadata__ lacks format: pt")

    tensors = [(k, v) for k, v in header.items() if k != "__metadata__"]
    for name, info in tensors:
        check(set(info) == {"dtype", "shape", "data_offsets"}, f"{name}: fields {sorted(info)}")
        check(info["dtype"] in SIZES, f"{name}: unknown dtype {info['dtype']}")
        shape = info["shape"]
        check(isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape),
              f"{name}: bad shape {shape}")
        b, e = info["data_offsets"]
        check(type(b) is int and type(e) is int and 0 <= b <= e, f"{name}: bad offsets {b},{e}")
        bits = math.prod(shape) * SIZES[info["dtype"]]
        check(bits % 8 == 0, f"{name}: sub-byte size not whole bytes")
        check(e - b == bits // 8, f"{name}: {e - b} bytes for {info['dtype']} {shape}")
    by_offset = sorted(tensors, key=lambda kv: tuple(kv[1]["data_offsets"]))
    end = 0
    for name, info in by_offset:
        b, e = info["data_offsets"]
        check(b == end, f"{name}: begins at {b}, previous tensor ends at {end} (hole/overlap)")
        end = e
    check(8 + n + end == len(raw), f"file size {len(raw)} != 8 + N + last END = {8 + n + end}")

    # Reference writer's order: alignment descending, then name; the header
    # lists tensors in data order.
    def align(dt):
        return max(1, SIZES[dt] // 8)
    expect = sorted(tensors, key=lambda kv: (-align(kv[1]["dtype"]), kv[0].encode()))
    check([k for k, _ in expect] == [k for k, _ in by_offset], "tensors not in alignment/name order")
    check([k for k, _ in tensors] == [k for k, _ in by_offset], "header order differs from data order")
    for name, info in tensors:
        check((8 + n + info["data_offsets"][0]) % align(info["dtype"]) == 0, f"{name}: misaligned")
    return header, raw[8 + n:]


def tensor(header, data, name):
    info = header[name]
    b, e = info["data_offsets"]
    return info, data[b:e]


def expected_numeric(dt):
    i = np.arange(N)
    if dt in ("F64", "F32", "F16"):
        return (i * 0.5 - 3).astype(NUMPY[dt])
    if dt == "BF16":
        f = (i * 0.25 - 1).astype("<f4")
        return (f.view("<u4") >> 16).astype("<u2")
    if dt in ("I64", "I32", "I16", "I8"):
        return (np.where(i % 2 == 1, -i, i) * 3).astype(NUMPY[dt])
    if dt in ("U64", "U32", "U16", "U8"):
        return (i * 5).astype(NUMPY[dt])
    if dt == "BOOL":
        return (i % 3 == 0).astype("u1")
    if dt == "C64":
        return (i - 2j * i).astype("<c8")
    return None


def f64_bits(x):
    return struct.pack("<d", x)


def check_values(header, data):
    for dt in SIZES:
        name = f"t.{dt}"
        check(name in header, f"missing {name}")
        info, buf = tensor(header, data, name)
        check(info["dtype"] == dt and info["shape"] == [3, 4], f"{name}: {info}")
        want = expected_numeric(dt)
        if want is not None:
            got = np.frombuffer(buf, dtype=NUMPY[dt])
            check(got.tobytes() == want.tobytes(), f"{name}: values {got} != {want}")
        else:
            nbytes = N * SIZES[dt] // 8
            want_raw = bytes(((k * 37 + 11) & 0xFF) for k in range(nbytes))
            check(buf == want_raw, f"{name}: raw bytes differ")
    info, buf = tensor(header, data, "ext.i64")
    got = np.frombuffer(buf, dtype="<i8").tolist()
    check(got == [-2**63, 2**63 - 1, -1, 0], f"ext.i64: {got}")
    info, buf = tensor(header, data, "scalar.f64")
    check(info["shape"] == [] and struct.unpack("<d", buf)[0] == 2.5, "scalar.f64")
    info, buf = tensor(header, data, "empty.f32")
    check(info["shape"] == [0, 5] and buf == b"", "empty.f32")

    doc = json.loads(header["__metadata__"]["ckpt"], object_pairs_hook=no_duplicates)
    check(set(doc) == {"version", "entries"} and doc["version"] == 1, f"ckpt doc: {list(doc)}")
    entries = doc["entries"]
    keys = [e["key"] for e in entries]
    check(len(set(keys)) == len(keys), "duplicate entry keys")
    check(not set(keys) & set(header), "an entry key is also a tensor name")
    vals = {}
    for e in entries:
        check(set(e) == {"key", "type", "value"}, f"entry fields {sorted(e)}")
        t, v = e["type"], e["value"]
        if t == "i64":
            check(type(v) is int and -2**63 <= v < 2**63, f"{e['key']}: i64 {v!r}")
        elif t == "f64":
            if isinstance(v, str):
                check(v in ("nan", "inf", "-inf"), f"{e['key']}: f64 string {v!r}")
                v = float(v)
            else:
                check(isinstance(v, float), f"{e['key']}: f64 written as {type(v).__name__}")
        elif t == "str":
            check(isinstance(v, str), f"{e['key']}: str")
        elif t == "bytes":
            v = base64.b64decode(v, validate=True)
        else:
            raise Failure(f"unknown entry type {t}")
        vals[e["key"]] = (t, v)
    order = ["i64.min", "i64.max", "i64.step", "f64.tenth", "f64.negzero", "f64.denorm",
             "f64.tiny", "f64.third", "f64.one", "f64.inf", "f64.neginf", "f64.nan",
             "str.empty", "str.utf8", "bytes.empty", "bytes.all"]
    check(keys == order, f"entries not in written order: {keys}")
    check(vals["i64.min"] == ("i64", -2**63), "i64.min")
    check(vals["i64.max"] == ("i64", 2**63 - 1), "i64.max")
    check(vals["i64.step"] == ("i64", 12), "i64.step")
    for k, want in [("f64.tenth", 0.1), ("f64.negzero", -0.0), ("f64.denorm", 5e-324),
                    ("f64.tiny", 1e-308), ("f64.third", 1.0 / 3.0), ("f64.one", 1.0),
                    ("f64.inf", math.inf), ("f64.neginf", -math.inf)]:
        check(vals[k][0] == "f64" and f64_bits(vals[k][1]) == f64_bits(want),
              f"{k}: {vals[k][1]!r} != {want!r} bit for bit")
    check(math.isnan(vals["f64.nan"][1]), "f64.nan")
    check(vals["str.empty"] == ("str", ""), "str.empty")
    check(vals["str.utf8"] == ("str", "h\u00e9llo \u2603 \"quoted\" \\ tab\t"), "str.utf8")
    check(vals["bytes.empty"] == ("bytes", b""), "bytes.empty")
    check(vals["bytes.all"] == ("bytes", bytes(range(256))), "bytes.all")


def main():
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    gen = os.path.join(sys.argv[1], "tests", "gen_statedict")
    with tempfile.TemporaryDirectory(prefix="ckpt_py_") as tmp:
        path = os.path.join(tmp, "all.safetensors")
        subprocess.run([gen, path], check=True)
        with open(path, "rb") as f:
            raw = f.read()
    try:
        header, data = parse(raw)
        check_values(header, data)
        # The checker itself must reject what the spec forbids (it can fail).
        bad = bytearray(raw)
        bad += b"\0"
        try:
            parse(bytes(bad))
            raise Failure("checker accepted trailing bytes")
        except Failure as e:
            check("file size" in str(e), f"wrong rejection: {e}")
    except Failure as e:
        print(f"FAIL: {e}", file=sys.stderr)
        return 1
    check("torch" not in sys.modules or sys.modules["torch"] is None, "torch got imported")
    print(f"ok: {len(header) - 1} tensors and every scalar entry verified without torch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
