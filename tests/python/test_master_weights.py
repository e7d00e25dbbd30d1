#!/usr/bin/python3
"""BF16/F16 parameters with fp32 master weights against the real PyTorch
(Debian's python3-torch).

tests/progs/master_trace runs ckpt's AdamW with master_weights over BF16 (and
F16) parameters for 30 steps, printing every parameter's bits after each
step, and saves a checkpoint after step 20. Here:

- torch.optim.AdamW(foreach=False) runs on fp32 copies of the same initial
  values with the same gradients (widened), and after each step the copies
  rounded (.bfloat16() / .half()) must be ckpt's parameters bit for bit (a
  1-ulp difference is allowed only where torch's fp32 AdamW itself differs
  in its last bit, which it does not on this machine: the count is printed);
- ckpt_torch.load of the checkpoint into a module with BF16/F16 parameters
  and a torch AdamW over them gives the parameters and keeps each fp32
  master under state[p]["master"]; ckpt_torch.save of those objects writes
  the same masters back (state.<i>.master);
- the checkpoint's export: model.safetensors holds the step-20 parameters in
  their dtype, optimizer.bin holds every parameter's fp32 master under
  state[i]["master"]; torch AdamW over fp32 parameters made from those
  masters, loaded with optimizer.bin, continues steps 21..30 and rounds to
  ckpt's parameters of those steps bit for bit.

usage: test_master_weights.py BUILD_DIR   (CKPT_BIN from the environment)
"""
import json
import math
import os
import struct
import subprocess
import sys
import tempfile

try:
    import torch
except ImportError:
    print("SKIP: no torch (apt install python3-torch)")
    sys.exit(77)

ROOT = os.environ.get("CKPT_SOURCE_DIR") or os.path.dirname(os.path.dirname(
    os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "python"))
import ckpt_torch  # noqa: E402

BUILD = sys.argv[1] if len(sys.argv) > 1 else "build"
CKPT = os.environ.get("CKPT_BIN") or os.path.join(BUILD, "ckpt")
SHAPES = [(7, 13), (29,)]
HALF = {"bf16": torch.bfloat16, "f16": torch.float16}


def find_prog(name):
    for root, _dirs, files in os.walk(BUILD):
        if name in files:
            return os.path.join(root, name)
    raise SystemExit("%s not found under %s" % (name, BUILD))


def narrow(values, dt):
    """Python floats (doubles) -> float32 -> the half dtype, as the C
    program's (float) cast and ckpt_dtype_convert round them."""
    return torch.tensor(values, dtype=torch.float64).float().to(dt)


def bits(t):
    return t.contiguous().view(torch.int16).reshape(-1).tolist()


def initial(dt):
    out = []
    for k, shape in enumerate(SHAPES):
        n = math.prod(shape)
        out.append(narrow([0.5 * math.sin(0.3 * j + 1 + k) for j in range(n)], dt).reshape(shape))
    return out


def grads(params_half, t, dt):
    out = []
    for k, p in enumerate(params_half):
        v = p.float().reshape(-1).tolist()
        out.append(narrow([math.sin(0.37 * j + t + k) + 0.1 * v[j] for j in range(len(v))],
                          dt).reshape(p.shape))
    return out


def parse(text):
    rows = {}
    for line in text.splitlines():
        f = line.split()
        assert f[0] == "step", line
        rows[int(f[1])] = [int(x, 16) for x in f[2:]]
    return rows


def as_signed(u):
    return u - 0x10000 if u >= 0x8000 else u


def compare(ours, masters, dt, t, what):
    """ckpt's bits at step t against torch's fp32 masters rounded; returns
    the 1-ulp differences (anything more fails)."""
    theirs = []
    for m in masters:
        theirs += bits(m.detach().to(dt))
    want = [as_signed(u) for u in ours[t]]
    if len(want) != len(theirs):
        raise SystemExit("%s step %d: %d values, torch %d" % (what, t, len(want), len(theirs)))
    ulps = 0
    for i, (a, b) in enumerate(zip(want, theirs)):
        if a == b:
            continue
        if abs(a - b) == 1:
            ulps += 1
            continue
        raise SystemExit("%s step %d value %d: ckpt %04x, torch %04x" %
                         (what, t, i, a & 0xffff, b & 0xffff))
    return ulps


def run_torch(dt, steps, masters=None, sd=None, first=1):
    if masters is None:
        masters = [torch.nn.Parameter(p.float()) for p in initial(dt)]
    opt = torch.optim.AdamW(masters, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                            foreach=False)
    if sd is not None:
        opt.load_state_dict(sd)
    out = {}
    for t in range(first, first + steps):
        for m, g in zip(masters, grads([m.detach().to(dt) for m in masters], t, dt)):
            m.grad = g.float()
        opt.step()
        out[t] = [m.detach().clone() for m in masters]
    return out


def read_model(path):
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    return header, raw[8 + n:]


class Half(torch.nn.Module):
    def __init__(self, dt):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(SHAPES[0], dtype=dt))
        self.b = torch.nn.Parameter(torch.zeros(SHAPES[1], dtype=dt))


def check_ckpt_torch(ck, dt, ours, masters, tmp):
    mod = Half(dt)
    opt = torch.optim.AdamW(mod.parameters(), lr=1e-3, foreach=False)
    ckpt_torch.load(ck, model=mod, optimizer=opt)
    got = bits(mod.w.detach()) + bits(mod.b.detach())
    if got != [as_signed(u) for u in ours[20]]:
        raise SystemExit("ckpt_torch.load: the parameters are not step 20's")
    for p, m in zip((mod.w, mod.b), masters):
        st = opt.state[p]
        if st["master"].dtype != torch.float32 or not torch.equal(st["master"], m):
            raise SystemExit("ckpt_torch.load: state['master'] is not the checkpoint's fp32 master")
    again = os.path.join(tmp, "again")
    ckpt_torch.save(again, model=mod, optimizer=opt, step=20)
    flat = ckpt_torch.load_state_dict(os.path.join(again, "optimizer.safetensors"))
    for i, m in enumerate(masters):
        got = torch.from_numpy(flat["state.%d.master" % i].copy())
        if not torch.equal(got, m):
            raise SystemExit("ckpt_torch.save: state.%d.master differs" % i)


def check_frozen(tmp, dt):
    fz = os.path.join(tmp, "fz")
    mod = Half(dt)
    mod.b.requires_grad_(False)
    opt = torch.optim.AdamW(mod.parameters(), lr=1e-3, foreach=False)
    ckpt_torch.load(fz, model=mod, optimizer=opt)
    if "master" not in opt.state[mod.w] or len(opt.state[mod.b]) != 0:
        raise SystemExit("ckpt_torch.load of a frozen parameter: state %r / %r"
                         % (sorted(opt.state[mod.w]), sorted(opt.state[mod.b])))
    out = os.path.join(tmp, "fz_out")
    e = subprocess.run([CKPT, "export", fz, out], capture_output=True, text=True)
    if e.returncode:
        raise SystemExit("ckpt export: %s%s" % (e.stdout, e.stderr))
    sd = torch.load(os.path.join(out, "optimizer.bin"))
    if sorted(sd["state"]) != [0] or sd["param_groups"][0]["params"] != [0, 1]:
        raise SystemExit("optimizer.bin of a frozen parameter: state %r, params %r"
                         % (sorted(sd["state"]), sd["param_groups"][0]["params"]))
    ws = [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES]
    torch.optim.AdamW(ws, foreach=False).load_state_dict(sd)


def main():
    prog = find_prog("master_trace")
    total_ulps = 0
    for name, dt in HALF.items():
        with tempfile.TemporaryDirectory() as tmp:
            p = subprocess.run([prog, tmp, name], capture_output=True, text=True)
            if p.returncode:
                raise SystemExit("master_trace %s: %s" % (name, p.stderr))
            ours = parse(p.stdout)
            ref = run_torch(dt, 30)
            ulps = sum(compare(ours, ref[t], dt, t, name) for t in range(1, 31))
            total_ulps += ulps
            print("%s: 30 steps of %d values, %d 1-ulp differences" %
                  (name, sum(math.prod(s) for s in SHAPES), ulps))

            out = os.path.join(tmp, "out")
            e = subprocess.run([CKPT, "export", os.path.join(tmp, "ck"), out],
                               capture_output=True, text=True)
            if e.returncode:
                raise SystemExit("ckpt export: %s%s" % (e.stdout, e.stderr))
            header, data = read_model(os.path.join(out, "model.safetensors"))
            want_dtype = {"bf16": "BF16", "f16": "F16"}[name]
            step20 = []
            for key in ("w", "b"):
                h = header[key]
                if h["dtype"] != want_dtype:
                    raise SystemExit("model.safetensors %s: %s, want %s" % (key, h, want_dtype))
                a, b = h["data_offsets"]
                step20 += [as_signed(x) for x in struct.unpack("<%dH" % ((b - a) // 2), data[a:b])]
            if step20 != [as_signed(u) for u in ours[20]]:
                raise SystemExit("%s: the exported model is not step 20's" % name)
            sd = torch.load(os.path.join(out, "optimizer.bin"))
            st = sd["state"]
            if sorted(st) != [0, 1] or any("master" not in st[i] for i in st):
                raise SystemExit("optimizer.bin state: %r" % {i: sorted(st[i]) for i in st})
            masters = []
            for i, shape in enumerate(SHAPES):
                m = st[i]["master"]
                if m.dtype != torch.float32 or tuple(m.shape) != shape:
                    raise SystemExit("state[%d]['master']: %s %s" % (i, m.dtype, tuple(m.shape)))
                masters.append(torch.nn.Parameter(m.clone()))
            check_ckpt_torch(os.path.join(tmp, "ck"), dt, ours, [m.detach() for m in masters], tmp)
            check_frozen(tmp, dt)
            cont = run_torch(dt, 10, masters, sd, first=21)
            ulps = sum(compare(ours, cont[t], dt, t, name + " continued") for t in range(21, 31))
            total_ulps += ulps
            print("%s: continued in torch from the export, steps 21..30 agree (%d 1-ulp)" %
                  (name, ulps))
    if total_ulps > 2:
        raise SystemExit("%d 1-ulp differences: more than a rare one" % total_ulps)
    print("ok: master weights agree with PyTorch %s" % torch.__version__)


if __name__ == "__main__":
    main()
