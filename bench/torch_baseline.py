#!/usr/bin/python3
"""torch_baseline.py — the PyTorch side of bench_gpt2.

Builds the same state as bench_gpt2.c: GPT-2 small's parameters (the real
shapes, fp32, 124,439,808 elements) as a model state dict, and an AdamW
optimizer state dict in PyTorch's layout (state[i] = {step, exp_avg,
exp_avg_sq}, param_groups with the hyper-parameters). Then:

  save:  torch.save({"model": ..., "optimizer": ...}, file) + os.fsync,
         timed together (best of --save-reps; the file is removed and the
         disk synced before each);
  load:  torch.load(file) with the file in the page cache (read once before
         timing), best of --load-reps.

Prints one "key value" line per figure for bench_gpt2.c to parse:
  torch_version, bytes, save_s, load_s (best), load_all (every rep)
and removes its file at the end.

  /usr/bin/python3 torch_baseline.py FOLDER [--save-reps N] [--load-reps N]
"""
import argparse
import os
import sys
import time

import torch

D, LAYERS, VOCAB, CTX = 768, 12, 50257, 1024


def gpt2_small_shapes():
    """(name, shape) of every GPT-2 small parameter, HF transformers' names."""
    s = [("transformer.wte.weight", (VOCAB, D)), ("transformer.wpe.weight", (CTX, D))]
    for i in range(LAYERS):
        p = "transformer.h.%d." % i
        s += [
            (p + "ln_1.weight", (D,)), (p + "ln_1.bias", (D,)),
            (p + "attn.c_attn.weight", (D, 3 * D)), (p + "attn.c_attn.bias", (3 * D,)),
            (p + "attn.c_proj.weight", (D, D)), (p + "attn.c_proj.bias", (D,)),
            (p + "ln_2.weight", (D,)), (p + "ln_2.bias", (D,)),
            (p + "mlp.c_fc.weight", (D, 4 * D)), (p + "mlp.c_fc.bias", (4 * D,)),
            (p + "mlp.c_proj.weight", (4 * D, D)), (p + "mlp.c_proj.bias", (D,)),
        ]
    s += [("transformer.ln_f.weight", (D,)), ("transformer.ln_f.bias", (D,))]
    return s


def filled(shape, seed):
    # Non-constant values, every page touched; cheap to build (no RNG needed:
    # torch.save does not compress, the values do not change its speed).
    t = torch.empty(shape, dtype=torch.float32)
    t.view(-1).copy_(torch.arange(t.numel(), dtype=torch.float32).remainder_(997).mul_(1e-3).add_(seed))
    return t


def build_state():
    model = {}
    opt_state = {}
    for i, (name, shape) in enumerate(gpt2_small_shapes()):
        model[name] = filled(shape, 0.001 * i)
        opt_state[i] = {
            "step": torch.tensor(1.0),
            "exp_avg": filled(shape, 0.5 + 0.001 * i),
            "exp_avg_sq": filled(shape, 0.25 + 0.001 * i),
        }
    groups = [{
        "lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01,
        "amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
        "params": list(range(len(model))),
    }]
    return {"model": model, "optimizer": {"state": opt_state, "param_groups": groups}}


def drop(path):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("folder")
    ap.add_argument("--save-reps", type=int, default=3)
    ap.add_argument("--load-reps", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(1)  # the C side is single-threaded too
    path = os.path.join(a.folder, "torch_state.pt")
    state = build_state()
    nparams = sum(t.numel() for t in state["model"].values())
    if nparams != 124439808:
        sys.exit("torch_baseline: %d parameters, expected 124439808" % nparams)

    t_save = float("inf")
    try:
        for _ in range(a.save_reps):
            drop(path)
            os.sync()
            t0 = time.perf_counter()
            with open(path, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            t_save = min(t_save, time.perf_counter() - t0)
        nbytes = os.path.getsize(path)

        # Warm the page cache: read the file once before timing.
        with open(path, "rb") as f:
            while f.read(1 << 24):
                pass
        loads = []
        for _ in range(a.load_reps):
            t0 = time.perf_counter()
            back = torch.load(path)
            loads.append(time.perf_counter() - t0)
            ok = torch.equal(back["model"]["transformer.wte.weight"],
                             state["model"]["transformer.wte.weight"])
            del back
            if not ok:
                sys.exit("torch_baseline: torch.load returned different values")
    finally:
        drop(path)

    print("torch_version %s" % torch.__version__)
    print("bytes %d" % nbytes)
    print("save_s %.6f" % t_save)
    print("load_s %.6f" % min(loads))
    print("load_all %s" % ",".join("%.3f" % t for t in loads))


if __name__ == "__main__":
    main()
