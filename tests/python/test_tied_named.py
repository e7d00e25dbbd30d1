#!/usr/bin/python3
"""Tied weights, named custom objects and u64 entries between the C library,
python/ckpt_torch and Debian's PyTorch.

- a C checkpoint (tests/progs/tied_run) with lm_head tied to wte, the named
  objects rng_state and counts, an unnamed one: ckpt_torch.load gives every
  object under its name, the u64 exactly (a U64), the tied name as the very
  array of its target, and loads into a torch module whose lm_head is wte
  (and its AdamW over the distinct parameters);
- ckpt_torch.save of that module and state: the C program resumes it (the
  tie and the u64 survive), and rng_state.safetensors is byte for byte what
  the C writer wrote;
- ckpt export: model.safetensors holds wte once with Hugging Face's record
  {"lm_head": "wte"} in __metadata__, pytorch_model.bin both names on one
  storage (torch.load), each custom object a .pkl dict (the u64 exact, the
  alias on its target's storage, bytes as uint8), the U32 object left out and
  named in the README;
- ckpt import of a torch.save'd tied state dict records the tie.
usage: test_tied_named.py BUILD_DIR   (CKPT_BIN from the environment)
"""
import json
import os
import struct
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.dont_write_bytecode = True
sys.path.insert(0, os.path.join(ROOT, "python"))
import ckpt_torch  # noqa: E402
from ckpt_torch import _format as F  # noqa: E402

try:
    import torch
except ImportError:
    print("SKIP: no torch (apt install python3-torch)")
    sys.exit(77)

BUILD = sys.argv[1]
CKPT = os.environ.get("CKPT_BIN") or os.path.join(BUILD, "ckpt")
PROG = os.path.join(BUILD, "tests", "tied_run")
failures = []


def check(cond, msg):
    if not cond:
        failures.append(msg)
        print("FAIL:", msg)


def run(*args, expect=0):
    p = subprocess.run(list(args), capture_output=True, text=True)
    if p.returncode != expect:
        raise SystemExit(f"{' '.join(args)}: exit {p.returncode}, want {expect}\n"
                         f"{p.stdout}{p.stderr}")
    return p.stdout


def header(path):
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n])


class Net(torch.nn.Module):
    """GPT-2's tie in miniature: lm_head is wte (one Parameter, two names)."""

    def __init__(self):
        super().__init__()
        self.wte = torch.nn.Parameter(torch.zeros(6, 4))
        self.h = torch.nn.Parameter(torch.zeros(4, 4))
        self.lm_head = self.wte
        self.bias = torch.nn.Parameter(torch.zeros(6))


with tempfile.TemporaryDirectory() as tmp:
    ck = os.path.join(tmp, "ck")
    run(PROG, "save", ck)
    want = run(PROG, "load", ck)

    # ---- ckpt_torch reads it ----
    res = ckpt_torch.load(ck, as_torch=False)
    rs = res["rng_state"]
    check(isinstance(rs["seed"], ckpt_torch.U64) and rs["seed"] == 2**64 - 1,
          f"rng_state seed {rs['seed']!r}")
    check(rs["buf_alias"] is rs["buf"], "an alias is not the very array of its target")
    check(rs["n"] == -5 and rs["x"] == 0.25 and rs["s"] == "philox" and rs["b"] == b"\0\1\xff",
          "rng_state scalars")
    check(res["custom_checkpoint_0"]["k"] == 7, "the unnamed object")
    check(list(res["counts"]["counts"]) == [4000000000 + i for i in range(5)], "counts")
    model = res["model"]
    check(model["lm_head"] is model["wte"], "the tied name is not its target's array")
    check(list(model) == ["bias", "h", "wte", "lm_head"], f"model keys {list(model)}")

    net = Net()
    opt = torch.optim.AdamW(net.parameters(), lr=0.01, weight_decay=0.01)
    check(len(opt.param_groups[0]["params"]) == 3, "torch sees 3 distinct parameters")
    out = ckpt_torch.load(ck, model=net, optimizer=opt)
    check(np.array_equal(net.wte.detach().numpy(), model["wte"]), "module wte")
    check(net.lm_head is net.wte, "the module's tie survived the load")
    check(len(opt.state) == 3, f"AdamW state for {len(opt.state)} parameters")

    # ---- ckpt_torch writes it back: the C program resumes it ----
    ck2 = os.path.join(tmp, "ck2")
    files = out["files"]
    ckpt_torch.save(ck2, model=net, optimizer=opt, custom=[files["custom_checkpoint_0"]],
                    named={"rng_state": files["rng_state"], "counts": files["counts"]},
                    random_states=files["random_states_0"], step=out["step"])
    sf = F.StateFile("model", open(os.path.join(ck2, "model.safetensors"), "rb").read())
    check(sf.aliases() == {"lm_head": "wte"}, f"python's model file aliases {sf.aliases()}")
    check(open(os.path.join(ck2, "rng_state.safetensors"), "rb").read() ==
          open(os.path.join(ck, "rng_state.safetensors"), "rb").read(),
          "rng_state.safetensors differs from the C writer's bytes")
    check(run(PROG, "load", ck2) == want, "the C program resumed python's save differently")
    run(CKPT, "diff", ck, ck2)  # the same state, tie and u64 included
    err = run(PROG, "untied", ck, expect=3)
    check("lm_head" in err and "tied" in err, f"untied load: {err}")

    # ---- export ----
    exp = os.path.join(tmp, "exp")
    run(CKPT, "export", ck, exp)
    h = header(os.path.join(exp, "model.safetensors"))
    check(h["__metadata__"].get("lm_head") == "wte", f"HF record: {h['__metadata__']}")
    check(sorted(k for k in h if k != "__metadata__") == ["bias", "h", "wte"],
          f"model.safetensors tensors {sorted(h)}")
    readme = open(os.path.join(exp, "README.md")).read()
    check("counts.pkl: tensor 'counts' is U32" in readme, "README names the left-out object")
    check(not os.path.exists(os.path.join(exp, "counts.pkl")), "a U32 object was exported")
    k0 = torch.load(os.path.join(exp, "custom_checkpoint_0.pkl"), weights_only=True)
    check(k0 == {"k": 7}, f"custom_checkpoint_0.pkl {k0}")
    # our own file (floats: torch 1.13's weights-only unpickler lacks BINFLOAT)
    major = int(torch.__version__.split(".")[0])
    rp = torch.load(os.path.join(exp, "rng_state.pkl"), weights_only=major >= 2)
    check(rp["seed"] == 2**64 - 1 and rp["n"] == -5 and rp["x"] == 0.25 and rp["s"] == "philox",
          f"rng_state.pkl scalars {rp}")
    check(rp["buf_alias"].data_ptr() == rp["buf"].data_ptr(), "rng_state.pkl: alias not shared")
    check(rp["b"].dtype == torch.uint8 and rp["b"].tolist() == [0, 1, 255], "bytes as uint8")
    check(rp["scale"].dim() == 0 and float(rp["scale"]) == 0.5, "0-dim tensor")

    expb = os.path.join(tmp, "expb")
    run(CKPT, "export", "--bin", ck, expb)
    sd = torch.load(os.path.join(expb, "pytorch_model.bin"), weights_only=True)
    check(set(sd) == {"wte", "h", "bias", "lm_head"}, f"pytorch_model.bin keys {list(sd)}")
    check(sd["lm_head"].data_ptr() == sd["wte"].data_ptr(), "pytorch_model.bin: not one storage")
    net2 = Net()
    net2.load_state_dict(sd)
    check(torch.equal(net2.wte, net.wte), "pytorch_model.bin into the module")

    # ---- import: PyTorch's shared storage is a tie ----
    src = os.path.join(tmp, "tied.bin")
    torch.save(net.state_dict(), src)
    ck3 = os.path.join(tmp, "ck3")
    run(CKPT, "import", src, ck3)
    sf = F.StateFile("model", open(os.path.join(ck3, "model.safetensors"), "rb").read())
    check(sf.aliases() == {"lm_head": "wte"}, f"import aliases {sf.aliases()}")
    check(set(sf.tensors) == {"wte", "h", "bias"}, f"import tensors {set(sf.tensors)}")
    insp = run(CKPT, "inspect", ck3)
    check("lm_head" in insp and "-> wte" in insp, "inspect shows the tie")

    # ---- inspect: u64 values and 0-dim tensors' values ----
    insp = run(CKPT, "inspect", os.path.join(ck, "rng_state.safetensors"))
    check(any(ln.split()[:1] == ["seed"] and ln.endswith("= 18446744073709551615")
              for ln in insp.splitlines()), f"inspect u64: {insp}")
    check(any(ln.split()[:1] == ["scale"] and ln.endswith("= 0.5") for ln in insp.splitlines()),
          f"inspect 0-dim: {insp}")
    doc = json.loads(run(CKPT, "inspect", "--json", ck))
    ents = {e["key"]: e for o in doc["objects"] if o["file"] == "rng_state.safetensors"
            for e in o["entries"]}
    check(ents["seed"]["kind"] == "u64" and ents["seed"]["value"] == 2**64 - 1, "json u64")
    check(ents["scale"]["value"] == 0.5, "json 0-dim value")
    check(ents["buf_alias"] == {"key": "buf_alias", "kind": "alias", "target": "buf"},
          f"json alias {ents['buf_alias']}")

if failures:
    print(f"{len(failures)} failure(s)")
    sys.exit(1)
print("ok")
