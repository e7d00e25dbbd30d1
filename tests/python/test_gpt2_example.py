#!/usr/bin/python3
"""The GPT-2 trainer of examples/gpt2, seen from PyTorch (Debian's python3-torch).

example_gpt2 trains its tiny configuration for a few steps, saves (its own
AdamW's bf16 parameters, fp32 masters and moments through an external ckpt
optimizer) and writes its validation batch and the loss of its final
parameters on it. `ckpt export --bin` turns the newest checkpoint into
pytorch_model.bin and optimizer.bin. Here:

- a GPT-2 module written below (llm.c's parameter layout: each layer's
  tensors stacked, nn.Linear's (out, in) weights, GELU's tanh form, the
  output layer tied to the token embedding) loads pytorch_model.bin strictly
  (the bf16 parameters widened to fp32) and gives the C program's loss on
  its batch to 1e-5 relative;
- the output layer (lm_head.weight, tied to wte with ckpt_model_tie) shares
  the embedding's storage in the export (one tensor under two names, as
  torch.save writes a tied module);
- optimizer.bin holds, for every parameter, exp_avg, exp_avg_sq and an fp32
  master that rounds to the parameter exactly, and the step count of the
  run.

usage: test_gpt2_example.py BUILD_DIR   (CKPT_BIN from the environment)
       test_gpt2_example.py --export DIR EVAL_JSON STEPS
         checks an export made already (`ckpt export --bin` of a run that
         wrote EVAL_JSON with --eval-out after STEPS steps): scripts/demo-gpt2
"""
import json
import math
import os
import subprocess
import sys
import tempfile

try:
    import torch
    import torch.nn.functional as F
except ImportError:
    print("SKIP: no torch (apt install python3-torch)")
    sys.exit(77)

BUILD = sys.argv[1] if len(sys.argv) > 1 else "build"
CKPT = os.environ.get("CKPT_BIN") or os.path.join(BUILD, "ckpt")
STEPS = 8
NAMES = ["wte", "wpe", "ln1w", "ln1b", "qkvw", "qkvb", "attprojw", "attprojb",
         "ln2w", "ln2b", "fcw", "fcb", "fcprojw", "fcprojb", "lnfw", "lnfb"]


def find_prog(name):
    for root, _dirs, files in os.walk(BUILD):
        if name in files:
            return os.path.join(root, name)
    raise SystemExit("%s not found under %s" % (name, BUILD))


class GPT2(torch.nn.Module):
    """GPT-2 over llm.c's stacked parameter tensors."""

    def __init__(self, V, T, L, H, C):
        super().__init__()
        self.L, self.H, self.C = L, H, C
        shapes = [(V, C), (T, C), (L, C), (L, C), (L, 3 * C, C), (L, 3 * C), (L, C, C),
                  (L, C), (L, C), (L, C), (L, 4 * C, C), (L, 4 * C), (L, C, 4 * C), (L, C),
                  (C,), (C,)]
        for name, shape in zip(NAMES, shapes):
            self.register_parameter(name, torch.nn.Parameter(torch.zeros(shape)))
        self.lm_head = torch.nn.Linear(C, V, bias=False)
        self.lm_head.weight = self.wte  # tied

    def forward(self, idx, targets):
        B, T = idx.shape
        C, H = self.C, self.H
        hs = C // H
        x = self.wte[idx] + self.wpe[:T]
        mask = torch.tril(torch.ones(T, T, dtype=torch.bool))
        for l in range(self.L):
            h = F.layer_norm(x, (C,), self.ln1w[l], self.ln1b[l], 1e-5)
            q, k, v = F.linear(h, self.qkvw[l], self.qkvb[l]).split(C, dim=2)
            q, k, v = (t.view(B, T, H, hs).transpose(1, 2) for t in (q, k, v))
            att = (q @ k.transpose(-2, -1)) / math.sqrt(hs)
            att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
            y = (att @ v).transpose(1, 2).reshape(B, T, C)
            x = x + F.linear(y, self.attprojw[l], self.attprojb[l])
            h = F.layer_norm(x, (C,), self.ln2w[l], self.ln2b[l], 1e-5)
            h = F.gelu(F.linear(h, self.fcw[l], self.fcb[l]), approximate="tanh")
            x = x + F.linear(h, self.fcprojw[l], self.fcprojb[l])
        x = F.layer_norm(x, (C,), self.lnfw, self.lnfb, 1e-5)
        logits = self.lm_head(x)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def run_and_export():
    """example_gpt2 for STEPS steps, its newest checkpoint exported (--bin)."""
    ex = find_prog("example_gpt2")
    with tempfile.TemporaryDirectory() as tmp:
        proj, out, evf = (os.path.join(tmp, n) for n in ("proj", "export", "eval.json"))
        subprocess.run([ex, proj, "--steps", str(STEPS), "--save-every", "4", "--eval-out", evf,
                        "--quiet"], check=True, stdout=subprocess.DEVNULL)
        subprocess.run([CKPT, "export", "--bin", proj, out], check=True,
                       stdout=subprocess.DEVNULL)
        check(out, evf, STEPS)


def check(out, evf, steps):
    """The export in out against the C program's eval file evf."""
    with open(evf) as f:
        ev = json.load(f)
    sd = torch.load(os.path.join(out, "pytorch_model.bin"), weights_only=True)
    # (PyTorch 1.13's weights_only refuses a pickled float: our own file)
    osd = torch.load(os.path.join(out, "optimizer.bin"), weights_only=False)

    B, T, L, H = ev["B"], ev["T"], ev["layers"], ev["heads"]
    V, C = sd["wte"].shape
    for name in NAMES:
        assert sd[name].dtype == torch.bfloat16, (name, sd[name].dtype)
    a, b = sd["lm_head.weight"], sd["wte"]
    assert a.data_ptr() == b.data_ptr() and a.shape == b.shape, \
        "lm_head.weight does not share wte's storage"
    model = GPT2(V, sd["wpe"].shape[0], L, H, C)
    model.load_state_dict({k: t.float() for k, t in sd.items()}, strict=True)
    assert model.lm_head.weight is model.wte
    tok = torch.tensor(ev["tokens"], dtype=torch.long).view(B, T + 1)
    with torch.no_grad():
        loss = model(tok[:, :-1], tok[:, 1:]).item()
    rel = abs(loss - ev["loss"]) / abs(ev["loss"])
    print("loss: C %.9g, PyTorch %.9g, relative difference %.3g" % (ev["loss"], loss, rel))
    assert rel <= 1e-5, "the losses differ by %g relative" % rel

    # the optimizer: PyTorch's AdamW layout with every field, masters exact
    state, groups = osd["state"], osd["param_groups"]
    assert len(groups) == 1 and len(groups[0]["params"]) == len(NAMES), groups
    f32 = lambda x: torch.tensor(x, dtype=torch.float32).item()  # the trainer's floats
    assert groups[0]["lr"] == f32(3e-3) and groups[0]["betas"] == (f32(0.9), f32(0.95)), groups[0]
    for i, name in enumerate(NAMES):
        st = state[i]
        for field in ("exp_avg", "exp_avg_sq", "master"):
            assert st[field].dtype == torch.float32 and st[field].shape == sd[name].shape, \
                (name, field)
        assert torch.equal(st["master"].bfloat16(), sd[name]), name + ": master does not round " \
            "to the parameter"
        assert float(st["step"]) == steps, (name, st["step"])
        assert st["exp_avg_sq"].abs().sum() > 0, name + ": no second moment"
    print("ok: %d parameters (lm_head tied to wte), loss equal to %.2g, optimizer state "
          "complete" % (len(NAMES), rel))


def main():
    if len(sys.argv) == 5 and sys.argv[1] == "--export":
        check(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        run_and_export()


if __name__ == "__main__":
    main()
