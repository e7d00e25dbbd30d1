"""Runs tests/progs/optim_trace and the same configurations in PyTorch
(torch.optim with foreach=False, torch.optim.lr_scheduler, and GradScaler's
update rule), and checks every printed value agrees to a relative 1e-6.

Usage: test_torch_numerics.py <build dir>

GradScaler: torch 1.13's GradScaler disables itself without CUDA and its CPU
kernels (_amp_update_scale_, _amp_foreach_non_finite_check_and_unscale_) do
not exist for CPU tensors, so the scaler's rule is re-implemented here from
those kernels' definitions, on float32 tensors, around a real torch.optim.SGD.
transformers is not installed: its warmup schedules are LambdaLR with the
lambdas copied from get_{cosine,linear,constant}_schedule_with_warmup's
definitions."""
import json
import math
import os
import struct
import subprocess
import sys
import tempfile

import torch

STEPS = 50
RTOL = 1e-6


def find_prog(build, name):
    for root, _dirs, files in os.walk(build):
        if name in files:
            return os.path.join(root, name)
    raise SystemExit("optim_trace not found under %s" % build)


def f32(x):
    return float(torch.tensor(x, dtype=torch.float32))


def make_params():
    w = torch.tensor([f32(0.5 * math.sin(0.3 * j + 1.0 + 0)) for j in range(12)],
                     dtype=torch.float32).reshape(3, 4)
    b = torch.tensor([f32(0.5 * math.sin(0.3 * j + 1.0 + 1)) for j in range(5)],
                     dtype=torch.float32)
    return torch.nn.Parameter(w), torch.nn.Parameter(b)


def set_grads(w, b, t):
    wv = w.detach().reshape(-1).tolist()
    bv = b.detach().tolist()
    w.grad = torch.tensor([math.sin(0.37 * j + t + 0) + 0.1 * wv[j] for j in range(12)],
                          dtype=torch.float32).reshape(3, 4)
    b.grad = torch.tensor([math.sin(0.37 * j + t + 1) + 0.1 * bv[j] for j in range(5)],
                          dtype=torch.float32)


def values(w, b):
    return w.detach().reshape(-1).tolist() + b.detach().tolist()


def sgd(lr, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False):
    return ("sgd", dict(lr=lr, momentum=momentum, dampening=dampening,
                        weight_decay=weight_decay, nesterov=nesterov, maximize=maximize))


def adam(kind, lr, weight_decay, amsgrad=False, maximize=False):
    return (kind, dict(lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=weight_decay,
                       amsgrad=amsgrad, maximize=maximize))


OPT_CONFIGS = [
    ("sgd_plain", sgd(0.1), None),
    ("sgd_momentum", sgd(0.05, 0.9), None),
    ("sgd_nesterov", sgd(0.05, 0.9, nesterov=True), None),
    ("sgd_dampening", sgd(0.05, 0.9, dampening=0.3), None),
    ("sgd_weight_decay", sgd(0.05, 0.5, weight_decay=0.01), None),
    ("sgd_maximize", sgd(0.01, 0.9, weight_decay=0.1, maximize=True), None),
    ("adam", adam("adam", 1e-2, 0.0), None),
    ("adam_l2", adam("adam", 1e-2, 0.1), None),
    ("adam_maximize", adam("adam", 1e-2, 0.0, maximize=True), None),
    ("adamw", adam("adamw", 1e-2, 0.01), None),
    ("adamw_amsgrad", adam("adamw", 1e-2, 0.01, amsgrad=True), None),
    ("adamw_two_groups", adam("adamw", 1e-2, 0.01), adam("adamw", 5e-3, 0.0, amsgrad=True)),
    ("sgd_two_groups", sgd(0.05, 0.9, nesterov=True), sgd(0.1, weight_decay=0.01)),
]

OPT_CLASSES = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


def torch_optimizer(w, b, g0, g1):
    kind, opts = g0
    cls = OPT_CLASSES[kind]
    if g1 is None:
        return cls([w, b], foreach=False, **opts)
    return cls([dict(params=[w], **opts), dict(params=[b], **g1[1])], foreach=False)


def run_optimizer(name, g0, g1):
    w, b = make_params()
    opt = torch_optimizer(w, b, g0, g1)
    out = []
    for t in range(1, STEPS + 1):
        set_grads(w, b, t)
        opt.step()
        out.append(("opt", name, t, values(w, b)))
    return out


def warmup_lambda(kind, warmup, total):
    def cosine(step):
        if step < warmup:
            return float(step) / float(max(1, warmup))
        progress = float(step - warmup) / float(max(1, total - warmup))
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * float(0.5) * 2.0 * progress)))

    def linear(step):
        if step < warmup:
            return float(step) / float(max(1, warmup))
        return max(0.0, float(total - step) / float(max(1, total - warmup)))

    def constant(step):
        if step < warmup:
            return float(step) / float(max(1.0, warmup))
        return 1.0

    return {"cosine": cosine, "linear": linear, "constant": constant}[kind]


S = torch.optim.lr_scheduler
SCHED_CONFIGS = [
    ("steplr", lambda o: S.StepLR(o, 7, 0.5)),
    ("multisteplr", lambda o: S.MultiStepLR(o, [5, 15, 15, 30], 0.3)),
    ("exponentiallr", lambda o: S.ExponentialLR(o, 0.93)),
    ("cosinelr", lambda o: S.CosineAnnealingLR(o, 12, 0.001)),
    ("warmup_cosine", lambda o: S.LambdaLR(o, warmup_lambda("cosine", 5, 40))),
    ("warmup_linear", lambda o: S.LambdaLR(o, warmup_lambda("linear", 5, 40))),
    ("constant", lambda o: S.LambdaLR(o, lambda _: 1)),
    ("constant_warmup", lambda o: S.LambdaLR(o, warmup_lambda("constant", 7, 0))),
]


def run_scheduler(name, make):
    w, b = make_params()
    opt = torch.optim.SGD([dict(params=[w], lr=0.1), dict(params=[b], lr=0.05)], lr=0.1)
    sched = make(opt)
    out = []
    for t in range(STEPS + 1):
        if t > 0:
            opt.step()  # keeps PyTorch from warning about the call order
            sched.step()
        out.append(("sched", name, t, [g["lr"] for g in opt.param_groups]))
    return out


def run_scaler():
    """GradScaler(init_scale=1024, growth_factor=2, backoff_factor=0.5,
    growth_interval=3) as its kernels define it, on float32 tensors."""
    w, b = make_params()
    opt = torch.optim.SGD([w, b], lr=0.1, momentum=0.9, foreach=False)
    scale = torch.full((1,), 1024.0, dtype=torch.float32)
    tracker = 0
    out = []
    for t in range(1, STEPS + 1):
        set_grads(w, b, t)
        with torch.no_grad():
            w.grad.mul_(scale)
            b.grad.mul_(scale)
            if t % 7 == 3:
                w.grad.view(-1)[t % 12] = float("inf")
            if t in (20, 21):
                b.grad[2] = float("nan")
            # unscale_: inv_scale = scale.double().reciprocal().float()
            inv = scale.double().reciprocal().float()
            found = any(not bool(torch.isfinite(g).all()) for g in (w.grad, b.grad))
            w.grad.mul_(inv)
            b.grad.mul_(inv)
        stepped = not found
        if stepped:
            opt.step()
        # _amp_update_scale_
        if found:
            scale = (scale.double() * 0.5).float()
            tracker = 0
        elif tracker + 1 == 3:
            grown = (scale.double() * 2.0).float()
            if bool(torch.isfinite(grown).all()):
                scale = grown
            tracker = 0
        else:
            tracker += 1
        out.append(("scaler", str(int(stepped)), t, [float(scale)] + values(w, b)))
    return out


def parse(text):
    rows = []
    for line in text.splitlines():
        f = line.split()
        if f[0] == "scaler":
            rows.append(("scaler", f[3], int(f[1]), [float(x) for x in [f[2]] + f[4:]]))
        else:
            rows.append((f[0], f[1], int(f[2]), [float(x) for x in f[3:]]))
    return rows


def close(a, c):
    if math.isnan(a) or math.isnan(c):
        return math.isnan(a) and math.isnan(c)
    return abs(a - c) <= RTOL * max(abs(a), abs(c))


def check_model_file(path):
    """model.safetensors must be a plain state dict: exactly the parameters,
    as PyTorch's own tensors, and no entries in the ckpt metadata (the
    string-to-string __metadata__ itself is ignored by safetensors' loaders)."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    meta = header.pop("__metadata__", {})
    if "ckpt" in meta and json.loads(meta["ckpt"]).get("entries"):
        raise SystemExit("model file carries ckpt entries: %r" % meta)
    if sorted(header) != ["b", "w"]:
        raise SystemExit("model file keys: %r" % sorted(header))
    w, b = make_params()
    for name, want in (("w", w), ("b", b)):
        h = header[name]
        if h["dtype"] != "F32" or h["shape"] != list(want.shape):
            raise SystemExit("model file %s: %r" % (name, h))
        lo, hi = h["data_offsets"]
        got = torch.frombuffer(bytearray(data[8 + n + lo:8 + n + hi]), dtype=torch.float32)
        if not torch.equal(got.reshape(want.shape), want.detach()):
            raise SystemExit("model file %s: values differ" % name)


def main():
    build = sys.argv[1] if len(sys.argv) > 1 else "build"
    prog = find_prog(build, "optim_trace")
    with tempfile.TemporaryDirectory() as tmp:
        model_path = os.path.join(tmp, "model.safetensors")
        out = subprocess.run([prog, model_path], check=True, capture_output=True, text=True)
        check_model_file(model_path)
    ours = parse(out.stdout)
    theirs = []
    for name, g0, g1 in OPT_CONFIGS:
        theirs += run_optimizer(name, g0, g1)
    for name, make in SCHED_CONFIGS:
        theirs += run_scheduler(name, make)
    theirs += run_scaler()
    if len(ours) != len(theirs):
        raise SystemExit("line count: ours %d, torch %d" % (len(ours), len(theirs)))
    failures = 0
    worst = {}
    for o, t in zip(ours, theirs):
        if o[:3] != t[:3] or len(o[3]) != len(t[3]):
            raise SystemExit("row mismatch: ours %r, torch %r" % (o[:3], t[:3]))
        for i, (a, c) in enumerate(zip(o[3], t[3])):
            if o[0] != "sched":  # float32 values: compare them as float32
                a, c = f32(a), f32(c)
            rel = 0.0 if a == c else abs(a - c) / max(abs(a), abs(c))
            key = o[1] if o[0] != "scaler" else "scaler"
            worst[key] = max(worst.get(key, 0.0), rel)
            if not close(a, c):
                failures += 1
                if failures <= 20:
                    print("MISMATCH %s %s step %d value %d: ours %.17g torch %.17g" %
                          (o[0], o[1], o[2], i, a, c))
    for key, rel in worst.items():
        print("%-18s max relative difference %.3g" % (key, rel))
    if failures:
        raise SystemExit("%d values differ by more than %g" % (failures, RTOL))
    print("ok: %d rows agree with PyTorch %s" % (len(ours), torch.__version__))


if __name__ == "__main__":
    main()
