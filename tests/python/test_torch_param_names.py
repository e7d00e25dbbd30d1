#!/usr/bin/python3
"""Optimizer state from torch 1.13 (whose optimizer.bin names no parameters) reaches each C
parameter by name, never silently by position (Debian's python3-torch).

A torch model registers fc.weight, fc.bias, ln.weight, ln.bias; AdamW trains it a few steps and
an Accelerate-style folder is saved with torch.save. The C model (tests/progs/optim_names)
registers ln.bias before ln.weight: two parameters of one shape, so a load by position would
swap their Adam moments and still succeed.

- model as pytorch_model.bin (torch's registration order) and one group: `ckpt import` names
  the parameters itself, and the C load gives every parameter its own moments;
- the same state with the model as model.safetensors (sorted names, no proof of the order), or
  with two groups (as Hugging Face's Trainer makes them): the import leaves them unnamed and the
  C load is refused, naming the two ways out;
- `ckpt import --param-names FILE` names them: every parameter gets its own moments; wrong lists
  (too short, an unknown name, twice, a shape that does not fit) are refused, nothing written;
- `optim_names --by-position` (ckpt_optimizer_set_match_by_position) loads unnamed state by
  position into a model in torch's order, and says so on stderr.

usage: test_torch_param_names.py BUILD_DIR
"""
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.dont_write_bytecode = True
sys.path.insert(0, HERE)
from test_torch_bridge import read_st, write_st  # noqa: E402

BUILD = sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "..", "..", "build-test")
CKPT = os.environ.get("CKPT_BIN") or os.path.join(BUILD, "ckpt")
failures = []


def check(cond, msg):
    if not cond:
        failures.append(msg)
        print("FAIL:", msg)


def find_prog(name):
    for root, _dirs, files in os.walk(BUILD):
        if name in files:
            return os.path.join(root, name)
    raise SystemExit("%s not found under %s" % (name, BUILD))


PROG = find_prog("optim_names")
# the C model's registration order: ln.bias before ln.weight (torch has them the other way)
C_PARAMS = ["fc.bias:4", "ln.bias:4", "ln.weight:4", "fc.weight:4x4"]


def run(cmd, expect=0):
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != expect:
        raise SystemExit("%s: exit %d, want %d\n%s%s" % (" ".join(cmd), p.returncode, expect,
                                                         p.stdout, p.stderr))
    return p


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.ln = torch.nn.LayerNorm(4)

    def forward(self, x):
        return self.ln(self.fc(x))


def train(groups):
    torch.manual_seed(3)
    net = Net()
    if groups == 1:
        opt = torch.optim.AdamW(net.parameters(), lr=0.01, weight_decay=0.1, foreach=False)
    else:  # Hugging Face Trainer's split: weights decay, biases and norms do not
        decay = [net.fc.weight]
        rest = [net.fc.bias, net.ln.weight, net.ln.bias]
        opt = torch.optim.AdamW([dict(params=decay, weight_decay=0.1),
                                 dict(params=rest, weight_decay=0.0)], lr=0.01, foreach=False)
    x = torch.linspace(-1, 1, 24).reshape(6, 4)
    y = torch.linspace(1, -1, 24).reshape(6, 4)
    for _ in range(3):
        opt.zero_grad()
        ((net(x) - y) ** 2).mean().backward()
        opt.step()
    return net, opt


def save_folder(path, net, opt, safetensors=False):
    os.makedirs(path)
    if safetensors:  # as the safetensors package writes it: names sorted
        sd = net.state_dict()
        write_st(os.path.join(path, "model.safetensors"), {k: sd[k] for k in sorted(sd)})
    else:
        torch.save(net.state_dict(), os.path.join(path, "pytorch_model.bin"))
    osd = opt.state_dict()
    check(all("param_names" not in g for g in osd["param_groups"]),
          "this torch's optimizer.bin carries param_names: the test needs one without")
    torch.save(osd, os.path.join(path, "optimizer.bin"))


def expected(net, opt):
    """name -> (exp_avg, exp_avg_sq) from torch's own optimizer."""
    return {n: (opt.state[p]["exp_avg"].numpy(), opt.state[p]["exp_avg_sq"].numpy())
            for n, p in net.named_parameters()}


def load_in_c(tmp, ck, tag, by_position=False, expect=0, params=C_PARAMS):
    out = os.path.join(tmp, "state_%s.safetensors" % tag)
    cmd = [PROG] + (["--by-position"] if by_position else []) + [ck, out] + params
    p = run(cmd, expect)
    return out, p


def own_moments(what, out, want, params=C_PARAMS):
    """Every C parameter holds its own torch moments (state.<i> by param_names.<i>)."""
    t, sc = read_st(out)
    names = [sc.get("param_names.%d" % i) for i in range(len(params))]
    check(names == [c.split(":")[0] for c in params], "%s: C names %s" % (what, names))
    for i, n in enumerate(names):
        ea, eas = want[n]
        ok = (np.array_equal(t["state.%d.exp_avg" % i], ea) and
              np.array_equal(t["state.%d.exp_avg_sq" % i], eas))
        check(ok, "%s: %s did not get its own Adam moments" % (what, n))


def import_names(ck):
    _, sc = read_st(os.path.join(ck, "optimizer.safetensors"))
    return [sc.get("param_names.%d" % i) for i in range(4)]


def main():
    with tempfile.TemporaryDirectory() as tmp:
        net, opt = train(1)
        want = expected(net, opt)
        torch_order = [n for n, _ in net.named_parameters()]

        # 1. pytorch_model.bin + one group: the order is certain, the import names them
        src = os.path.join(tmp, "acc_bin")
        save_folder(src, net, opt)
        ck = os.path.join(tmp, "imp_bin")
        run([CKPT, "import", "--optimizer", "adamw", src, ck])
        check(import_names(ck) == torch_order, "derived names %s" % import_names(ck))
        out, p = load_in_c(tmp, ck, "bin")
        own_moments("pytorch_model.bin, derived names", out, want)
        check("by position" not in p.stderr, "a named load warned: %s" % p.stderr)
        print("ok: pytorch_model.bin + one group: names derived, each parameter its own moments")

        # 2. no proof of the order: unnamed, and the C load refuses
        cases = [("safetensors", net, opt, True)]
        net2, opt2 = train(2)
        cases.append(("two_groups", net2, opt2, False))
        for tag, n_, o_, st in cases:
            src = os.path.join(tmp, "acc_" + tag)
            save_folder(src, n_, o_, safetensors=st)
            ck = os.path.join(tmp, "imp_" + tag)
            run([CKPT, "import", "--optimizer", "adamw", src, ck])
            check(import_names(ck) == [None] * 4,
                  "%s: names appeared: %s" % (tag, import_names(ck)))
            names = [nm for g in o_.param_groups for p_ in g["params"]
                     for nm, q in n_.named_parameters() if q is p_]
            lst = os.path.join(tmp, "names_%s.txt" % tag)
            with open(lst, "w") as f:
                f.write("\n".join(names) + "\n")
            ck2 = os.path.join(tmp, "imp_named_" + tag)
            run([CKPT, "import", "--optimizer", "adamw", "--param-names", lst, src, ck2])
            check(import_names(ck2) == names, "%s: given names %s" % (tag, import_names(ck2)))
            print("ok: %s: no proof of the order, left unnamed; --param-names FILE names them"
                  % tag)
            if tag == "two_groups":
                continue  # the C side below has one group

            # the C load refuses unnamed state
            _, p = load_in_c(tmp, ck, tag, expect=3)
            check("does not name its parameters" in p.stderr and "--param-names" in p.stderr and
                  "ckpt_optimizer_set_match_by_position" in p.stderr,
                  "%s: refusal says %r" % (tag, p.stderr))
            # with the given names every parameter gets its own moments
            out, _ = load_in_c(tmp, ck2, "named_" + tag)
            own_moments("%s with --param-names" % tag, out, expected(n_, o_))
            # by position, allowed, into a C model in torch's order: loads, and says so
            torch_params = ["fc.weight:4x4", "fc.bias:4", "ln.weight:4", "ln.bias:4"]
            out, p = load_in_c(tmp, ck, "pos_" + tag, by_position=True, params=torch_params)
            own_moments("%s by position" % tag, out, expected(n_, o_), params=torch_params)
            check("matched by position" in p.stderr,
                  "%s: no by-position warning: %r" % (tag, p.stderr))
            print("ok: %s: unnamed state refused by the C load; loaded by the given names; by "
                  "position only when allowed, with a warning" % tag)

        # wrong --param-names lists are refused, nothing written
        src = os.path.join(tmp, "acc_safetensors")
        bad = {
            "short": (torch_order[:3], "3 parameter names given, optimizer.bin has 4"),
            "unknown": (torch_order[:3] + ["ln.gamma"], "'ln.gamma' is not a tensor of the model"),
            "twice": (torch_order[:3] + [torch_order[0]], "given twice"),
            "shape": ([torch_order[1], torch_order[0]] + torch_order[2:], "its optimizer state is"),
        }
        for tag, (names, msg) in bad.items():
            lst = os.path.join(tmp, "bad_%s.txt" % tag)
            with open(lst, "w") as f:
                f.write("\n".join(names) + "\n")
            dst = os.path.join(tmp, "imp_bad_" + tag)
            p = run([CKPT, "import", "--optimizer", "adamw", "--param-names", lst, src, dst],
                    expect=3)
            check(msg in p.stderr, "bad list %s: %r" % (tag, p.stderr))
            check(not os.path.exists(dst), "bad list %s: %s was written" % (tag, dst))
        print("ok: wrong --param-names lists refused with their reason, nothing written")
    if failures:
        print("%d failure(s)" % len(failures))
        sys.exit(1)


if __name__ == "__main__":
    main()
