#!/usr/bin/python3
"""The PyTorch bridge against the real PyTorch (Debian's python3-torch).

C -> PyTorch: `ckpt train` (AdamW in two groups, warmup + cosine, loss scaling), `ckpt export`;
optimizer.bin, scheduler.bin and scaler.pt load into real torch objects and hold exactly the
checkpoint's values; the files use only what torch.load(weights_only=True) accepts.
PyTorch -> C: torch trains, saves an Accelerate-style folder, a plain state dict, HF sharded
safetensors with an index; `ckpt import` gives exactly the same tensors and values.
Round trip: export then import is what `ckpt diff` calls equal. Hostile pickles: clear errors.

usage: test_torch_bridge.py BUILD_DIR   (CKPT_BIN, CKPT_SOURCE_DIR from the environment)
"""
import json
import math
import os
import pickle
import pickletools
import shutil
import struct
import subprocess
import sys
import tempfile
import types
import zipfile

import numpy as np
import torch

CKPT = os.environ.get("CKPT_BIN") or os.path.join(sys.argv[1], "ckpt")
SRC = os.environ.get("CKPT_SOURCE_DIR") or os.path.join(os.path.dirname(__file__), "..", "..")
failures = []


def check(cond, msg):
    if not cond:
        failures.append(msg)
        print("FAIL:", msg)


def run(*args, expect=0):
    p = subprocess.run([CKPT, *args], capture_output=True, text=True)
    if p.returncode != expect:
        raise SystemExit(f"ckpt {' '.join(args)}: exit {p.returncode}, want {expect}\n{p.stdout}{p.stderr}")
    return p


# ---- safetensors without the safetensors package ---------------------------------------------

DT = {"F32": np.float32, "F64": np.float64, "I64": np.int64, "F16": np.float16, "I32": np.int32,
      "U8": np.uint8, "I8": np.int8, "I16": np.int16, "BOOL": np.bool_, "U32": np.uint32}


def read_st(path):
    """(tensors as numpy arrays, ckpt's scalar entries)."""
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    meta = header.pop("__metadata__", {}) or {}
    data = raw[8 + n:]
    tensors = {k: np.frombuffer(data[v["data_offsets"][0]:v["data_offsets"][1]],
                                dtype=DT[v["dtype"]]).reshape(v["shape"]) for k, v in header.items()}
    scalars = {}
    if "ckpt" in meta:
        for e in json.loads(meta["ckpt"])["entries"]:
            scalars[e["key"]] = e["value"]
    return tensors, scalars


def write_st(path, tensors):
    header, blobs, off = {}, [], 0
    for k, t in tensors.items():
        b = t.detach().contiguous().numpy().tobytes()
        header[k] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


# ---- what torch.load(weights_only=True) accepts ------------------------------------------------

# torch >= 2.6's weights-only unpickler: exactly these opcodes (torch 1.13's lacks BINFLOAT,
# so it cannot load any file with a float in it, torch's own optimizer state included).
WEIGHTS_ONLY_OPS = {"PROTO", "STOP", "GLOBAL", "NEWOBJ", "REDUCE", "BUILD", "APPEND", "APPENDS",
                    "SETITEM", "SETITEMS", "MARK", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "NONE",
                    "NEWTRUE", "NEWFALSE", "EMPTY_TUPLE", "EMPTY_LIST", "EMPTY_DICT", "EMPTY_SET",
                    "BININT", "BININT1", "BININT2", "BINFLOAT", "BINUNICODE", "SHORT_BINSTRING",
                    "BINPERSID", "BINGET", "LONG_BINGET", "BINPUT", "LONG_BINPUT", "LONG1"}
ALLOWED_GLOBALS = {("torch._utils", "_rebuild_tensor_v2"), ("collections", "OrderedDict")} | {
    ("torch", n) for n in ("FloatStorage", "DoubleStorage", "HalfStorage", "BFloat16Storage",
                           "LongStorage", "IntStorage", "ShortStorage", "CharStorage", "ByteStorage",
                           "BoolStorage")}


class RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) not in ALLOWED_GLOBALS:
            raise pickle.UnpicklingError(f"global {module}.{name} not allowed")
        return super().find_class(module, name)


restricted = types.SimpleNamespace(Unpickler=RestrictedUnpickler, load=pickle.load,
                                   __name__="restricted")


def load_weights_only(path):
    """torch.load under the weights-only rules: STORED records, a version record, only the
    allowed opcodes and globals; with torch >= 2 through weights_only=True itself."""
    z = zipfile.ZipFile(path)
    check(z.testzip() is None, f"{path}: a CRC-32 is wrong")
    names = z.namelist()
    folder = names[0].split("/")[0]
    check(all(n.startswith(folder + "/") and n.count("/") <= 2 for n in names), f"{path}: layout {names}")
    check(f"{folder}/version" in names and f"{folder}/data.pkl" in names, f"{path}: records {names}")
    check(all(i.compress_type == zipfile.ZIP_STORED for i in z.infolist()), f"{path}: not STORED")
    raw = open(path, "rb").read()
    for i in z.infolist():
        if "/data/" in i.filename:
            start = i.header_offset + 30 + len(i.filename) + struct.unpack(
                "<H", raw[i.header_offset + 28:i.header_offset + 30])[0]
            check(start % 64 == 0, f"{path}: {i.filename} data at {start}, not 64-aligned")
    ops = {op.name for op, _, _ in pickletools.genops(z.read(f"{folder}/data.pkl"))}
    check(ops <= WEIGHTS_ONLY_OPS, f"{path}: opcodes outside the weights-only set: {ops - WEIGHTS_ONLY_OPS}")
    if int(torch.__version__.split(".")[0]) >= 2:
        return torch.load(path, weights_only=True)
    return torch.load(path, pickle_module=restricted)


# ---- the demo's model in PyTorch ---------------------------------------------------------------

class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(64, 256)
        self.fc2 = torch.nn.Linear(256, 256)
        self.fc3 = torch.nn.Linear(256, 10)


def cosine_lambda(warmup, total):
    def f(step):
        if step < warmup:
            return step / max(1, warmup)
        progress = (step - warmup) / max(1, total - warmup)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress)))
    return f


def c_to_torch(tmp):
    proj = os.path.join(tmp, "run")
    run("train", "--epochs", "2", "--save-every", "0", "--quiet", "--workers", "0",
        "--project-dir", proj, "--data", os.path.join(SRC, "data", "digits.csv.gz"))
    ck = os.path.join(proj, "checkpoints", "checkpoint_0")
    out = os.path.join(tmp, "export")
    run("export", ck, out)
    for f in ("model.safetensors", "optimizer.bin", "scheduler.bin", "scaler.pt", "README.md"):
        check(os.path.exists(os.path.join(out, f)), f"export lacks {f}")

    model = MLP()
    weights, _ = read_st(os.path.join(out, "model.safetensors"))
    model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in weights.items()})
    mine, _ = read_st(os.path.join(ck, "model.safetensors"))
    for k, p in model.state_dict().items():
        check(np.array_equal(p.numpy(), mine[k]), f"model {k} differs")

    decay = [model.fc1.weight, model.fc2.weight, model.fc3.weight]
    no_decay = [model.fc1.bias, model.fc2.bias, model.fc3.bias]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                             {"params": no_decay, "weight_decay": 0.0}], lr=0.002)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, cosine_lambda(5, 94))
    sd = load_weights_only(os.path.join(out, "optimizer.bin"))
    opt.load_state_dict(sd)
    check(type(sd["state"]) is dict and list(sd["state"]) == list(range(6)), "state keys")
    ref = torch.optim.AdamW([{"params": decay}, {"params": no_decay}])
    ref_keys = set(ref.state_dict()["param_groups"][0])
    check(set(sd["param_groups"][0]) == ref_keys | {"initial_lr", "param_names"},
          f"param_groups fields {sorted(sd['param_groups'][0])} vs torch's {sorted(ref_keys)} + "
          "initial_lr, param_names")
    # the parameters' names, as PyTorch 2.6 keeps them for named_parameters()
    check(sd["param_groups"][0]["param_names"] == ["fc1.weight", "fc2.weight", "fc3.weight"] and
          sd["param_groups"][1]["param_names"] == ["fc1.bias", "fc2.bias", "fc3.bias"],
          f"param_names {[g['param_names'] for g in sd['param_groups']]}")
    ost, osc = read_st(os.path.join(ck, "optimizer.safetensors"))
    params = decay + no_decay
    for i, p in enumerate(params):
        st = opt.state[p]
        check(st["step"].dtype == torch.float32 and st["step"].dim() == 0, "step is a 0-d float32")
        check(float(st["step"]) == float(ost[f"state.{i}.step"]), f"state {i} step")
        for b in ("exp_avg", "exp_avg_sq"):
            check(np.array_equal(st[b].numpy(), ost[f"state.{i}.{b}"]), f"state {i} {b} differs")
    for g in range(2):
        check(opt.param_groups[g]["lr"] == osc[f"param_groups.{g}.lr"], f"group {g} lr")
        check(opt.param_groups[g]["weight_decay"] == osc[f"param_groups.{g}.weight_decay"], f"group {g} wd")
        check(opt.param_groups[g]["betas"] == (osc[f"param_groups.{g}.betas.0"], osc[f"param_groups.{g}.betas.1"]),
              f"group {g} betas")

    ssd = load_weights_only(os.path.join(out, "scheduler.bin"))
    sched.load_state_dict(ssd)
    _, ssc = read_st(os.path.join(ck, "scheduler.safetensors"))
    check(sched.last_epoch == ssc["last_epoch"], "scheduler last_epoch")
    check(sched._step_count == ssc["_step_count"], "scheduler _step_count")
    check(sched.base_lrs == [ssc["base_lrs.0"], ssc["base_lrs.1"]], "scheduler base_lrs")
    check(sched.get_last_lr() == [ssc["_last_lr.0"], ssc["_last_lr.1"]], "scheduler _last_lr")
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref, lambda e: 1.0).state_dict()
    check(set(ssd) == set(ref_sched), f"scheduler fields {sorted(ssd)} vs {sorted(ref_sched)}")
    # torch's own next step from the loaded state gives the rate the schedule says
    opt.step()
    sched.step()
    want = 0.002 * cosine_lambda(5, 94)(ssc["last_epoch"] + 1)
    check(abs(opt.param_groups[0]["lr"] - want) <= 1e-15, "LambdaLR continues the schedule")

    scaler = load_weights_only(os.path.join(out, "scaler.pt"))
    _, gsc = read_st(os.path.join(ck, "scaler.safetensors"))
    check(scaler == gsc, f"scaler {scaler} vs {gsc}")
    check(set(scaler) == {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"},
          "scaler fields")
    check(type(scaler["growth_interval"]) is int and type(scaler["scale"]) is float, "scaler types")

    # export -> import -> the same state, as ckpt diff sees it
    back = os.path.join(tmp, "back")
    run("import", "--optimizer", "adamw", out, back)
    for f in ("model", "optimizer", "scheduler", "scaler"):
        p = run("diff", os.path.join(ck, f + ".safetensors"), os.path.join(back, f + ".safetensors"))
        check("equal" in p.stdout, f"round trip {f}: {p.stdout}")
    run("verify", back)
    # sharded export: the index and its shards
    shards = os.path.join(tmp, "sharded")
    run("export", "--weights-only", "--max-shard-size", "100KB", ck, shards)
    index = json.load(open(os.path.join(shards, "model.safetensors.index.json")))
    files = sorted(set(index["weight_map"].values()))
    check(len(files) >= 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors", f"shards {files}")
    check(index["metadata"]["total_size"] == sum(v.nbytes for v in mine.values()), "index total_size")
    check(not os.path.exists(os.path.join(shards, "optimizer.bin")), "--weights-only wrote the optimizer")
    got = {}
    for f in files:
        got.update(read_st(os.path.join(shards, f))[0])
    check(got.keys() == mine.keys() and all(np.array_equal(got[k], mine[k]) for k in mine), "shards hold the model")


class HFModel(torch.nn.Module):
    """HF-style names: embeddings, a layer list, a head."""

    def __init__(self):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(11, 8)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
        self.norm = torch.nn.LayerNorm(8)
        self.lm_head = torch.nn.Linear(8, 11, bias=False)

    def forward(self, x):
        h = self.embed_tokens(x)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.lm_head(self.norm(h))


def torch_to_c(tmp):
    torch.manual_seed(3)
    model = HFModel()
    decay = [p for n, p in model.named_parameters() if p.ndim == 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim != 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}], lr=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, cosine_lambda(2, 20))
    for _ in range(4):
        x = torch.randint(0, 11, (5, 6))
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, 11), x.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    folder = os.path.join(tmp, "accelerate")
    os.makedirs(folder)
    torch.save(model.state_dict(), os.path.join(folder, "pytorch_model.bin"))
    torch.save(opt.state_dict(), os.path.join(folder, "optimizer.bin"))
    torch.save(sched.state_dict(), os.path.join(folder, "scheduler.bin"))
    torch.save({"scale": 4096.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 50,
                "_growth_tracker": 3}, os.path.join(folder, "scaler.pt"))
    ck = os.path.join(tmp, "imported")
    # a LambdaLR's lambdas are not in the file: the command says what it needs
    p = run("import", "--optimizer", "adamw", folder, ck, expect=3)
    check("--warmup" in p.stderr, f"LambdaLR without a schedule: {p.stderr}")
    run("import", "--optimizer", "adamw", "--scheduler", "warmup_cosine", "--warmup", "2",
        "--total", "20", folder, ck)
    run("verify", ck)
    mt, _ = read_st(os.path.join(ck, "model.safetensors"))
    sd = model.state_dict()
    check(mt.keys() == sd.keys(), f"model keys {sorted(mt)}")
    for k, v in sd.items():
        check(np.array_equal(mt[k], v.numpy()), f"imported {k} differs")
    ot, osc = read_st(os.path.join(ck, "optimizer.safetensors"))
    check(osc["kind"] == "adamw", "optimizer kind")
    for i, p in enumerate(decay + no_decay):
        st = opt.state[p]
        check(ot[f"state.{i}.step"] == st["step"].numpy(), f"state {i} step")
        for b in ("exp_avg", "exp_avg_sq"):
            check(np.array_equal(ot[f"state.{i}.{b}"], st[b].numpy()), f"state {i} {b} differs")
    for g, grp in enumerate(opt.param_groups):
        check(osc[f"param_groups.{g}.lr"] == grp["lr"], f"group {g} lr")
        check(osc[f"param_groups.{g}.weight_decay"] == grp["weight_decay"], f"group {g} wd")
        check(list(ot[f"param_groups.{g}.params"]) == opt.state_dict()["param_groups"][g]["params"],
              f"group {g} params")
    _, ssc = read_st(os.path.join(ck, "scheduler.safetensors"))
    check(ssc["kind"] == "warmup_cosine" and ssc["warmup"] == 2 and ssc["total"] == 20, "schedule")
    check(ssc["last_epoch"] == sched.last_epoch and ssc["_last_lr.1"] == sched.get_last_lr()[1], "scheduler state")
    _, gsc = read_st(os.path.join(ck, "scaler.safetensors"))
    check(gsc == {"scale": 4096.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 50,
                  "_growth_tracker": 3}, f"scaler {gsc}")
    check(json.load(open(os.path.join(ck, "checkpoint.json")))["step"] == 4, "step from the optimizer")
    check("param_names.0" not in osc, "names appeared from a file without them")

    # PyTorch 2.6 keeps each group's parameter names: the import keeps them, and a C load maps
    # the state by them
    named = os.path.join(tmp, "accelerate_named")
    shutil.copytree(folder, named)
    osd = opt.state_dict()
    by_id = {id(p): n for n, p in model.named_parameters()}
    for g, grp in zip(osd["param_groups"], opt.param_groups):
        g["param_names"] = [by_id[id(p)] for p in grp["params"]]
    torch.save(osd, os.path.join(named, "optimizer.bin"))
    ck2 = os.path.join(tmp, "imported_named")
    run("import", "--optimizer", "adamw", "--scheduler", "warmup_cosine", "--warmup", "2",
        "--total", "20", named, ck2)
    _, osc2 = read_st(os.path.join(ck2, "optimizer.safetensors"))
    want = [by_id[id(p)] for p in decay + no_decay]
    check([osc2.get(f"param_names.{i}") for i in range(len(want))] == want,
          f"imported param_names {[osc2.get(f'param_names.{i}') for i in range(len(want))]}")
    # export writes them back into the groups
    back_named = os.path.join(tmp, "export_named")
    run("export", ck2, back_named)
    sd2 = load_weights_only(os.path.join(back_named, "optimizer.bin"))
    check([g.get("param_names") for g in sd2["param_groups"]] ==
          [g["param_names"] for g in osd["param_groups"]], "export of param_names")

    # a plain torch.save'd state dict, one file
    plain = os.path.join(tmp, "plain")
    run("import", os.path.join(folder, "pytorch_model.bin"), plain)
    pt, _ = read_st(os.path.join(plain, "model.safetensors"))
    check(all(np.array_equal(pt[k], v.numpy()) for k, v in sd.items()) and pt.keys() == sd.keys(), "plain import")
    check(not os.path.exists(os.path.join(plain, "optimizer.safetensors")), "plain import has no optimizer")

    # HF sharded safetensors with an index
    hf = os.path.join(tmp, "hf")
    os.makedirs(hf)
    names = list(sd)
    parts = [names[:3], names[3:7], names[7:]]
    weight_map = {}
    for i, part in enumerate(parts):
        fn = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
        write_st(os.path.join(hf, fn), {k: sd[k] for k in part})
        weight_map.update({k: fn for k in part})
    json.dump({"metadata": {"total_size": sum(v.numel() * 4 for v in sd.values())}, "weight_map": weight_map},
              open(os.path.join(hf, "model.safetensors.index.json"), "w"))
    sharded = os.path.join(tmp, "from_shards")
    run("import", hf, sharded)
    run("diff", os.path.join(plain, "model.safetensors"), os.path.join(sharded, "model.safetensors"))
    # pytorch_model.bin sharded the same way
    hfb = os.path.join(tmp, "hf_bin")
    os.makedirs(hfb)
    wm = {}
    for i, part in enumerate(parts):
        fn = f"pytorch_model-{i + 1:05d}-of-{len(parts):05d}.bin"
        torch.save({k: sd[k] for k in part}, os.path.join(hfb, fn))
        wm.update({k: fn for k in part})
    json.dump({"metadata": {}, "weight_map": wm}, open(os.path.join(hfb, "pytorch_model.bin.index.json"), "w"))
    run("import", hfb, os.path.join(tmp, "from_bin_shards"))
    run("diff", os.path.join(plain, "model.safetensors"), os.path.join(tmp, "from_bin_shards", "model.safetensors"))


def hostile(tmp):
    corpus = os.path.join(SRC, "tests", "fuzz", "corpus", "fuzz_torch")
    marker = os.path.join(tmp, "pwned")
    # a pickle that would run a shell command if anything executed it
    cmd = f"touch {marker}".encode()
    pkl = b"\x80\x02cos\nsystem\nX" + struct.pack("<I", len(cmd)) + cmd + b"\x85R."
    path = os.path.join(tmp, "evil.bin")
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("evil/data.pkl", pkl)
        z.writestr("evil/version", "3\n")
    p = run("import", path, os.path.join(tmp, "evil_out"), expect=3)
    check("global 'os.system' is not allowed" in p.stderr, f"os.system: {p.stderr}")
    check(not os.path.exists(marker), "the pickle's command ran")
    check(not os.path.exists(os.path.join(tmp, "evil_out")), "a checkpoint was left behind")
    for name, needle in [("bad_reduce_non_callable", "REDUCE of list"),
                         ("bad_build_on_dict", "BUILD of dict"),
                         ("bad_recursion_bomb", "nested deeper than 256"),
                         ("bad_huge_memo_index", "memo index 4294967295 too large"),
                         ("bad_storage_too_short", "its record has 8"),
                         ("bad_overlapping_records", "overlapping records"),
                         ("bad_central_directory_offset", "central directory outside"),
                         ("bad_legacy_format", "legacy torch.save file")]:
        p = run("import", os.path.join(corpus, name), os.path.join(tmp, name), expect=3)
        check(needle in p.stderr, f"{name}: {p.stderr}")


def main():
    tmp = tempfile.mkdtemp(prefix="ckpt_torch_bridge_")
    try:
        c_to_torch(tmp)
        torch_to_c(tmp)
        hostile(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if failures:
        print(f"{len(failures)} failure(s)")
        sys.exit(1)
    print("ok: C -> PyTorch, PyTorch -> C, round trip, hostile files")


if __name__ == "__main__":
    main()
