#!/usr/bin/python3
"""`ckpt export --bin` against the real PyTorch (Debian 12's python3-torch is 1.13).

- pytorch_model.bin opens with torch.load(weights_only=True) and holds exactly the
  checkpoint's model (an OrderedDict, in the checkpoint's order);
- a checkpoint whose model is saved as Hugging Face shards exports the same split as
  pytorch_model-0000k-of-0000N.bin + pytorch_model.bin.index.json, and --max-shard-size
  gives its own split; the index read by hand (as transformers does) finds every tensor;
- what the export README says about torch versions holds for the installed torch: 1.13
  refuses optimizer.bin, scheduler.bin and scaler.pt with weights_only=True (no
  BINFLOAT), 2.x opens them.
usage: test_export_bin.py BUILD_DIR   (CKPT_BIN, CKPT_SOURCE_DIR from the environment)
"""
import json
import os
import struct
import subprocess
import sys
import tempfile

import numpy as np

try:
    import torch
except ImportError:
    print("SKIP: no torch (apt install python3-torch)")
    sys.exit(77)

CKPT = os.environ.get("CKPT_BIN") or os.path.join(sys.argv[1], "ckpt")
failures = []


def check(cond, msg):
    if not cond:
        failures.append(msg)
        print("FAIL:", msg)


def run(*args, expect=0):
    p = subprocess.run([CKPT, *args], capture_output=True, text=True)
    if p.returncode != expect:
        raise SystemExit(f"ckpt {' '.join(args)}: exit {p.returncode}, want {expect}\n"
                         f"{p.stdout}{p.stderr}")
    return p


def read_st(path):
    """The tensors of a safetensors file as numpy arrays, in file order."""
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    data = raw[8 + n:]
    out = {}
    for k, v in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        assert v["dtype"] == "F32", v
        a, b = v["data_offsets"]
        out[k] = np.frombuffer(data[a:b], np.float32).reshape(v["shape"])
    return out


def same(sd, want, what):
    check(list(sd) == list(want), f"{what}: keys {list(sd)} vs {list(want)}")
    for k in want:
        t = sd.get(k)
        check(t is not None and t.dtype == torch.float32 and
              np.array_equal(t.numpy(), want[k]) and t.numpy().tobytes() == want[k].tobytes(),
              f"{what}: {k} differs")


def load_index(folder):
    """transformers' reading of a sharded .bin, by hand."""
    idx = json.load(open(os.path.join(folder, "pytorch_model.bin.index.json")))
    files = sorted(set(idx["weight_map"].values()))
    sd = {}
    for f in files:
        part = torch.load(os.path.join(folder, f), weights_only=True)
        for k in part:
            check(idx["weight_map"][k] == f, f"{k} is in {f}, the index says {idx['weight_map'][k]}")
        sd.update(part)
    check(set(sd) == set(idx["weight_map"]), "the shards do not hold exactly the index's keys")
    total = sum(t.numel() * t.element_size() for t in sd.values())
    check(idx["metadata"]["total_size"] == total, "index total_size")
    return files, sd


with tempfile.TemporaryDirectory() as tmp:
    proj = os.path.join(tmp, "p")
    run("train", "--epochs", "1", "--save-every", "0", "--quiet", "--project-dir", proj)
    ck = os.path.join(proj, "checkpoints", "checkpoint_0")
    want = read_st(os.path.join(ck, "model.safetensors"))

    # one file
    out = os.path.join(tmp, "bin")
    run("export", "--bin", ck, out)
    check(not os.path.exists(os.path.join(out, "model.safetensors")), "--bin also wrote safetensors")
    sd = torch.load(os.path.join(out, "pytorch_model.bin"), weights_only=True)
    check(type(sd).__name__ == "OrderedDict", f"pytorch_model.bin holds a {type(sd).__name__}")
    same(sd, want, "pytorch_model.bin")
    model = torch.nn.Sequential()
    model.add_module("fc1", torch.nn.Linear(64, 256))
    model.add_module("fc2", torch.nn.Linear(256, 256))
    model.add_module("fc3", torch.nn.Linear(256, 10))
    model.load_state_dict(sd)  # strict: every key and shape

    # what the README says about weights_only on this torch
    major = int(torch.__version__.split(".")[0])
    for f in ("optimizer.bin", "scheduler.bin", "scaler.pt"):
        try:
            torch.load(os.path.join(out, f), weights_only=True)
            opened = True
        except Exception:  # torch's own UnpicklingError / RuntimeError
            opened = False
        if major >= 2:
            check(opened, f"torch {torch.__version__} refuses {f} with weights_only=True")
        else:
            check(not opened, f"torch {torch.__version__} opens {f}: the README says it cannot")
    readme = open(os.path.join(out, "README.md")).read()
    check("PyTorch 1.13" in readme and "ckpt_torch.load(" in readme, "README: torch versions")
    check("never needs `weights_only=False`" not in readme, "README still promises too much")

    # --max-shard-size: its own split
    out2 = os.path.join(tmp, "bin_sharded")
    run("export", "--bin", "--weights-only", "--max-shard-size", "100KB", ck, out2)
    files, sd = load_index(out2)
    check(files == ["pytorch_model-%05d-of-00003.bin" % i for i in (1, 2, 3)], f"shards {files}")
    same({k: sd[k] for k in want}, want, "sharded .bin")

    # a checkpoint saved as HF shards: the same split, without --max-shard-size
    hf = os.path.join(tmp, "hf")
    run("train", "--epochs", "1", "--save-every", "0", "--quiet", "--project-dir", hf,
        "--max-shard-size", "150KB")
    hck = os.path.join(hf, "checkpoints", "checkpoint_0")
    parts = sorted(f for f in os.listdir(hck) if f.startswith("model-"))
    index = json.load(open(os.path.join(hck, "model.safetensors.index.json")))["weight_map"]
    out3 = os.path.join(tmp, "bin_hf")
    run("export", "--bin", hf, out3)  # a project: its newest valid checkpoint
    files, sd = load_index(out3)
    check(files == [p.replace("model-", "pytorch_model-").replace(".safetensors", ".bin")
                    for p in parts], f"split {files} vs the checkpoint's {parts}")
    bin_index = json.load(open(os.path.join(out3, "pytorch_model.bin.index.json")))["weight_map"]
    check({k: v.replace("pytorch_model-", "model-").replace(".bin", ".safetensors")
           for k, v in bin_index.items()} == index, "the .bin split is not the checkpoint's")
    hwant = {}
    for p in parts:
        hwant.update(read_st(os.path.join(hck, p)))
    for k in hwant:
        check(np.array_equal(sd[k].numpy(), hwant[k]), f"sharded checkpoint: {k} differs")

if failures:
    print(f"{len(failures)} failure(s)")
    sys.exit(1)
print("ok: ckpt export --bin opens with torch %s weights_only=True, one file and sharded"
      % torch.__version__)
