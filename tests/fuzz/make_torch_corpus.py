#!/usr/bin/python3
"""Writes the seed corpus of fuzz_torch (tests/fuzz/corpus/fuzz_torch/).

Run once with Debian's python3-torch (`/usr/bin/python3 tests/fuzz/make_torch_corpus.py`);
the outputs are committed. ok_* are real torch.save files (they must load); bad_* are
hostile or broken files (they must be rejected: tests/python/test_torch_bridge.py checks
each one's error). Deterministic: the same torch gives the same bytes.
"""
import collections
import io
import os
import struct
import sys
import warnings
import zipfile

import torch

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus", "fuzz_torch")


def save(name, obj, **kw):
    buf = io.BytesIO()
    torch.save(obj, buf, **kw)
    write(name, buf.getvalue())


def write(name, data):
    with open(os.path.join(OUT, name), "wb") as f:
        f.write(data)


def archive(pkl, records=(), folder="archive", compression=zipfile.ZIP_STORED):
    """A torch-layout zip around a hand-written pickle."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression) as z:
        z.writestr(f"{folder}/data.pkl", pkl)
        for name, data in records:
            z.writestr(f"{folder}/{name}", data)
        z.writestr(f"{folder}/version", "3\n")
    return buf.getvalue()


def binunicode(s):
    b = s.encode()
    return b"X" + struct.pack("<I", len(b)) + b


def tensor_pkl(numel, size, stride, key="0", offset=0):
    """_rebuild_tensor_v2 of a FloatStorage, as torch pickles it (protocol 2)."""
    p = b"ctorch._utils\n_rebuild_tensor_v2\n(("
    p += binunicode("storage") + b"ctorch\nFloatStorage\n" + binunicode(key) + binunicode("cpu")
    p += b"J" + struct.pack("<i", numel) + b"tQ"
    p += b"J" + struct.pack("<i", offset)
    p += b"(" + b"".join(b"J" + struct.pack("<i", s) for s in size) + b"t"
    p += b"(" + b"".join(b"J" + struct.pack("<i", s) for s in stride) + b"t"
    p += b"\x89ccollections\nOrderedDict\n)RtR"
    return p


def main():
    os.makedirs(OUT, exist_ok=True)
    warnings.simplefilter("ignore")  # the duplicate record below is on purpose
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 2))
    save("ok_model_state_dict", model.state_dict())  # OrderedDict + BUILD of _metadata
    for name, opt in [
        ("sgd", torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)),
        ("adam", torch.optim.Adam(model.parameters(), lr=1e-3, amsgrad=True)),
        ("adamw", torch.optim.AdamW(model.parameters(), lr=1e-3)),
    ]:
        model(torch.randn(5, 4)).sum().backward()
        opt.step()
        save(f"ok_optimizer_{name}", opt.state_dict())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0)
    save("ok_scheduler_lambdalr", sched.state_dict())
    save("ok_scheduler_steplr", torch.optim.lr_scheduler.StepLR(opt, 3, 0.5).state_dict())
    save("ok_scaler", {"scale": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                       "growth_interval": 2000, "_growth_tracker": 0})
    x = torch.arange(12, dtype=torch.float64).reshape(3, 4)
    save("ok_values", {
        "strided": x.t(), "row": x[1], "shared": [x, x], "param": torch.nn.Parameter(torch.ones(2)),
        "dtypes": [torch.ones(2, dtype=d) for d in (torch.float16, torch.bfloat16, torch.int64,
                   torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)],
        "empty": torch.zeros(0, 3), "scalar": torch.tensor(2.5),
        "ints": [0, 255, 256, 65535, 65536, -1, -2**31, 2**31, 2**62, -2**63, 2**63 - 1],
        "floats": [0.1, -0.0, float("inf")], "set": {1, 2}, "none": None, "flags": (True, False),
        "text": "gr\u00fc\u00dfe", 7: "int key",
    })
    save("ok_protocol4", {"w": torch.ones(2, 2), "n": 3}, pickle_protocol=4)
    buf = io.BytesIO()
    torch.save({"w": torch.ones(3)}, buf, _use_new_zipfile_serialization=False)
    write("bad_legacy_format", buf.getvalue())
    # a real file, re-zipped with deflate (other zip tools do this): must load
    good = io.BytesIO()
    torch.save({"w": torch.arange(6.0)}, good)
    src = zipfile.ZipFile(io.BytesIO(good.getvalue()))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for info in src.infolist():
            z.writestr(info.filename, src.read(info.filename))
    write("ok_deflated", buf.getvalue())

    floats = struct.pack("<6f", *range(6))
    # code execution attempts and what weights_only refuses
    write("bad_global_os_system", archive(b"\x80\x02cos\nsystem\n" + binunicode("id") + b"\x85R."))
    write("bad_global_builtins_eval", archive(b"\x80\x02cbuiltins\neval\n" + binunicode("1") + b"\x85R."))
    write("bad_reduce_storage_class", archive(b"\x80\x02ctorch\nFloatStorage\n)R."))
    write("bad_reduce_non_callable", archive(b"\x80\x02])R."))
    write("bad_build_on_dict", archive(b"\x80\x02}}b."))
    write("bad_newobj", archive(b"\x80\x02ccollections\nOrderedDict\n)\x81."))
    write("bad_persid_not_storage", archive(b"\x80\x02(" + binunicode("module") + b"tQ."))
    # resource exhaustion
    write("bad_recursion_bomb", archive(b"\x80\x02" + b"]" * 100000 + b"a" * 99999 + b"."))
    write("bad_mark_bomb", archive(b"\x80\x02" + b"(" * 100000 + b"."))
    write("bad_self_containing_list", archive(b"\x80\x02]q\x00h\x00a."))
    # memory amplification: 2 million one-byte lists (~160 bytes each), and a
    # set() of a 100,000-item list made again every 5 bytes (deflated, the
    # files stay small; the limit is set by the pickle's own length)
    write("bad_object_bomb", archive(b"\x80\x02" + b"]" * 2000000 + b".",
                                     compression=zipfile.ZIP_DEFLATED))
    copies = b"\x80\x02cbuiltins\nset\nq\x00]q\x01(" + b"K\x07" * 100000 + b"e"
    write("bad_set_copy_bomb", archive(copies + b"h\x00h\x01\x85R" * 20000 + b".",
                                       compression=zipfile.ZIP_DEFLATED))
    laughs = b"\x80\x02(]q\x00"  # 60 tuples, each of two of the one before: opens (a DAG), flattening stops
    for i in range(1, 60):
        laughs += b"(h" + bytes([i - 1]) + b"h" + bytes([i - 1]) + b"lq" + bytes([i])
    write("dag_billion_laughs", archive(laughs.replace(b"l", b"t") + b"t."))
    write("bad_huge_memo_index", archive(b"\x80\x02]r\xff\xff\xff\xff."))
    write("bad_memo_get_unset", archive(b"\x80\x02h\x05."))
    write("bad_long_too_wide", archive(b"\x80\x02\x8a\x09" + b"\x00" * 8 + b"\x01."))
    # tensors and storages that lie
    write("bad_storage_too_short", archive(b"\x80\x02" + tensor_pkl(6, [6], [1]) + b".",
                                           [("data/0", floats[:8])]))
    write("bad_tensor_past_storage", archive(b"\x80\x02" + tensor_pkl(6, [10], [1]) + b".",
                                             [("data/0", floats)]))
    write("bad_tensor_stride_past_storage", archive(b"\x80\x02" + tensor_pkl(6, [2, 3], [4, 1]) + b".",
                                                    [("data/0", floats)]))
    write("bad_storage_missing", archive(b"\x80\x02" + tensor_pkl(6, [6], [1], key="9") + b".",
                                         [("data/0", floats)]))
    write("ok_tensor_handmade", archive(b"\x80\x02" + tensor_pkl(6, [2, 2], [1, 2], offset=1) + b".",
                                        [("data/0", floats)]))
    # broken containers
    base = archive(b"\x80\x02" + tensor_pkl(6, [6], [1]) + b".", [("data/0", floats)])
    write("bad_truncated_zip", base[: len(base) - 30])
    write("bad_not_zip", b"\x80\x02}q\x00.")
    corrupt = bytearray(base)
    corrupt[base.index(floats) + 3] ^= 0x40
    write("bad_crc_mismatch", bytes(corrupt))
    # the first record's directory entry claims bytes that belong to the next record
    over = bytearray(base)
    cd = over.rindex(b"PK\x01\x02", 0, len(over) - 22)
    first = over.index(b"PK\x01\x02")
    assert first <= cd
    struct.pack_into("<II", over, first + 20, 200, 200)
    write("bad_overlapping_records", bytes(over))
    badcd = bytearray(base)
    struct.pack_into("<I", badcd, len(badcd) - 6, len(badcd) + 100)  # directory offset past the end
    write("bad_central_directory_offset", bytes(badcd))
    dup = archive(b"\x80\x02N.", [("data.pkl", b"\x80\x02N.")])
    write("bad_duplicate_record", dup)
    write("bad_no_version", archive(b"\x80\x02N.").replace(b"archive/version", b"archive/versioX"))
    print(f"wrote {len(os.listdir(OUT))} files to {OUT}", file=sys.stderr)


if __name__ == "__main__":
    main()
