#!/usr/bin/python3
"""C and PyTorch continue each other's training (Debian's python3-torch).

For each configuration of tests/progs/bridge_run.c -- SGD with nesterov
momentum and weight decay under StepLR; Adam with L2 under warmup + cosine;
AdamW in two groups (one with amsgrad) under warmup + cosine with a loss
scaler that skips steps on inf; centered RMSprop with momentum and weight
decay under StepLR -- on a small problem with a fixed gradient sequence:

C -> PyTorch: C trains K steps and saves; `ckpt export` writes the
  Accelerate folder; PyTorch loads optimizer.bin, scheduler.bin, scaler.pt
  (with the weights-only rules) into real torch.optim / lr_scheduler objects
  and runs M more steps; C continues the same checkpoint M steps. The
  parameters, learning rates and loss scale agree to 1e-6 relative (and C's
  own continuation equals C's uninterrupted run bit for bit).
PyTorch -> C: PyTorch trains K steps and saves an Accelerate folder with
  torch.save (then `ckpt import`), and separately a ckpt checkpoint with
  ckpt_torch.save; C continues each M steps; PyTorch continues its own
  objects M steps; the same agreement.

GradScaler: torch 1.13's GradScaler disables itself without CUDA, so its
update rule is applied here as its kernels define it (as in
test_torch_numerics.py), with the scale and growth tracker that scaler.pt
carries. Usage: test_torch_continue.py <build dir>"""
import math
import os
import subprocess
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.dont_write_bytecode = True
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, HERE)
import ckpt_torch  # noqa: E402
from test_torch_bridge import load_weights_only  # noqa: E402

BUILD = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "build-test")
CKPT = os.environ.get("CKPT_BIN") or os.path.join(BUILD, "ckpt")
K, M = 7, 9
RTOL = 1e-6
failures = []


def find_prog(name):
    for root, _dirs, files in os.walk(BUILD):
        if name in files:
            return os.path.join(root, name)
    raise SystemExit("%s not found under %s" % (name, BUILD))


BRIDGE = find_prog("bridge_run")


def run(cmd):
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit("%s: exit %d\n%s%s" % (" ".join(cmd), p.returncode, p.stdout, p.stderr))
    return p.stdout


def parse(text):
    out = {}
    for line in text.splitlines():
        f = line.split()
        out[f[0]] = [float(x) for x in f[1:]]
    return out


# ---- the same problem and configurations in PyTorch -------------------------------------------

def f32(x):
    return float(torch.tensor(x, dtype=torch.float32))


class Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(
            [f32(0.5 * math.sin(0.3 * j + 1.0)) for j in range(12)], dtype=torch.float32).reshape(3, 4))
        self.b = torch.nn.Parameter(torch.tensor(
            [f32(0.5 * math.sin(0.3 * j + 2.0)) for j in range(5)], dtype=torch.float32))


def cosine(warmup, total):
    return ckpt_torch.WarmupCosine(warmup, total)


def make(config):
    """(model, optimizer, scheduler, scaler state or None) as bridge_run builds them."""
    net = Toy()
    if config == "sgd":
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, nesterov=True,
                              weight_decay=1e-3, foreach=False)
        sched = torch.optim.lr_scheduler.StepLR(opt, 3, 0.5)
        scaler = None
    elif config == "rmsprop":
        opt = torch.optim.RMSprop(net.parameters(), lr=0.01, alpha=0.9, eps=1e-6,
                                  weight_decay=0.01, momentum=0.5, centered=True, foreach=False)
        sched = torch.optim.lr_scheduler.StepLR(opt, 3, 0.5)
        scaler = None
    elif config == "adam":
        opt = torch.optim.Adam(net.parameters(), lr=0.01, weight_decay=0.01, foreach=False)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, cosine(3, 20))
        scaler = None
    else:
        opt = torch.optim.AdamW([dict(params=[net.w], lr=0.01, weight_decay=0.1),
                                 dict(params=[net.b], lr=0.02, weight_decay=0.0, amsgrad=True)],
                                foreach=False)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, cosine(3, 20))
        scaler = {"scale": 256.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 3,
                  "_growth_tracker": 0}
    return net, opt, sched, scaler


def step(net, opt, sched, scaler, t):
    w, b = net.w, net.b
    wv, bv = w.detach().reshape(-1).tolist(), b.detach().tolist()
    w.grad = torch.tensor([math.sin(0.37 * j + t) + 0.1 * wv[j] for j in range(12)],
                          dtype=torch.float32).reshape(3, 4)
    b.grad = torch.tensor([math.sin(0.37 * j + t + 1) + 0.1 * bv[j] for j in range(5)],
                          dtype=torch.float32)
    if scaler is None:
        opt.step()
    else:  # GradScaler's scale / unscale_ / step / update, as its kernels define them
        scale = torch.tensor([scaler["scale"]], dtype=torch.float32)
        with torch.no_grad():
            w.grad.mul_(scale)
            b.grad.mul_(scale)
            if t % 7 == 3:
                w.grad.view(-1)[t % 12] = float("inf")
            inv = scale.double().reciprocal().float()
            found = any(not bool(torch.isfinite(g).all()) for g in (w.grad, b.grad))
            w.grad.mul_(inv)
            b.grad.mul_(inv)
        if not found:
            opt.step()
        if found:
            scale = (scale.double() * scaler["backoff_factor"]).float()
            scaler["_growth_tracker"] = 0
        elif scaler["_growth_tracker"] + 1 == scaler["growth_interval"]:
            grown = (scale.double() * scaler["growth_factor"]).float()
            if bool(torch.isfinite(grown).all()):
                scale = grown
            scaler["_growth_tracker"] = 0
        else:
            scaler["_growth_tracker"] += 1
        scaler["scale"] = float(scale)
    sched.step()


def torch_values(net, opt, scaler):
    v = {"params": net.w.detach().reshape(-1).tolist() + net.b.detach().tolist(),
         "lr": [g["lr"] for g in opt.param_groups]}
    if scaler is not None:
        v["scale"] = [scaler["scale"]]
    return v


def agree(what, a, b):
    for key in a:
        if key not in b or len(a[key]) != len(b[key]):
            failures.append("%s: %s missing or of another length" % (what, key))
            print("FAIL:", failures[-1])
            continue
        for i, (x, y) in enumerate(zip(a[key], b[key])):
            if not (abs(x - y) <= RTOL * max(abs(x), abs(y), 1e-30)):
                failures.append("%s: %s[%d]: %r vs %r" % (what, key, i, x, y))
                print("FAIL:", failures[-1])
                break


# ---- C -> PyTorch -------------------------------------------------------------------------------

def c_to_torch(tmp, config):
    ck = os.path.join(tmp, "c_" + config)
    run([BRIDGE, "save", config, str(K), ck])
    c_cont = parse(run([BRIDGE, "continue", config, str(K), str(M), ck]))
    # C's continuation is C's uninterrupted run, bit for bit
    whole = parse(run([BRIDGE, "save", config, str(K + M), os.path.join(tmp, "whole_" + config)]))
    if whole != c_cont:
        failures.append("%s: C resumed differs from C uninterrupted" % config)
        print("FAIL:", failures[-1])
    out = os.path.join(tmp, "export_" + config)
    run([CKPT, "export", ck, out])
    net, opt, sched, scaler = make(config)
    weights = ckpt_torch.load_state_dict(os.path.join(out, "model.safetensors"), as_torch=True)
    net.load_state_dict(weights)
    opt.load_state_dict(load_weights_only(os.path.join(out, "optimizer.bin")))
    sched.load_state_dict(load_weights_only(os.path.join(out, "scheduler.bin")))
    if scaler is not None:
        scaler = load_weights_only(os.path.join(out, "scaler.pt"))
    for t in range(K + 1, K + M + 1):
        step(net, opt, sched, scaler, t)
    agree("C -> torch, " + config, c_cont, torch_values(net, opt, scaler))
    print("ok: %s: C saved at step %d; torch (from `ckpt export`) and C each continued %d steps: "
          "agree to %g" % (config, K, M, RTOL))


# ---- PyTorch -> C -------------------------------------------------------------------------------

def torch_to_c(tmp, config):
    net, opt, sched, scaler = make(config)
    for t in range(1, K + 1):
        step(net, opt, sched, scaler, t)
    folder = os.path.join(tmp, "accelerate_" + config)
    os.makedirs(folder)
    torch.save(net.state_dict(), os.path.join(folder, "pytorch_model.bin"))
    torch.save(opt.state_dict(), os.path.join(folder, "optimizer.bin"))
    torch.save(sched.state_dict(), os.path.join(folder, "scheduler.bin"))
    if scaler is not None:
        torch.save(dict(scaler), os.path.join(folder, "scaler.pt"))
    imported = os.path.join(tmp, "imported_" + config)
    # RMSprop's kind is found from its fields (no --optimizer)
    args = [CKPT, "import", "--step", str(K)]
    if config != "rmsprop":
        args += ["--optimizer", config]
    if config not in ("sgd", "rmsprop"):
        args += ["--scheduler", "warmup_cosine", "--warmup", "3", "--total", "20"]
    if len(opt.param_groups) > 1:
        # torch 1.13 names no parameters and with several groups the import cannot prove the
        # order: give the names (the C load refuses unnamed state)
        names = os.path.join(folder, "param_names.txt")
        by_id = {id(p): n for n, p in net.named_parameters()}
        with open(names, "w") as f:
            f.writelines(by_id[id(p)] + "\n" for g in opt.param_groups for p in g["params"])
        args += ["--param-names", names]
    run(args + [folder, imported])
    # and a checkpoint written from the torch objects by ckpt_torch.save
    pysaved = os.path.join(tmp, "pysaved_" + config)
    ckpt_torch.save(pysaved, model=net, optimizer=opt, scheduler=sched,
                    scaler=dict(scaler) if scaler is not None else None, step=K)
    c_imp = parse(run([BRIDGE, "continue", config, str(K), str(M), imported]))
    c_py = parse(run([BRIDGE, "continue", config, str(K), str(M), pysaved]))
    for t in range(K + 1, K + M + 1):
        step(net, opt, sched, scaler, t)
    mine = torch_values(net, opt, scaler)
    agree("torch -> C (ckpt import), " + config, mine, c_imp)
    agree("torch -> C (ckpt_torch.save), " + config, mine, c_py)
    print("ok: %s: torch saved at step %d (torch.save + `ckpt import`, and ckpt_torch.save); C "
          "continued each and torch its own %d steps: agree to %g" % (config, K, M, RTOL))


def main():
    with tempfile.TemporaryDirectory() as tmp:
        for config in ("sgd", "adam", "adamw", "rmsprop"):
            c_to_torch(tmp, config)
            torch_to_c(tmp, config)
    if failures:
        print("%d failure(s)" % len(failures))
        sys.exit(1)


if __name__ == "__main__":
    main()
