"""python/ckpt_torch as a user's package: what save() and load() offer
beyond the byte-for-byte round trip of test_ckpt_torch.py.

Usage: test_ckpt_torch_api.py <build dir>   (CKPT_BIN: the ckpt CLI)

1. save(metrics=) records the manifest's "metrics" as ckpt_set_metric does
   (`ckpt ls` shows them); bad names and values are refused.
2. load()["files"] is keyed by the same stems as load()'s own entries.
3. A checkpoint holding a save pre-hook's file (kind "extra") loads.
4. Key mapping as ckpt_load_state_ex: prefix_map, rename, strict=False with
   the missing / unexpected / renamed report; collisions and shape
   differences refused before any change. (PyTorch)
5. A LambdaLR: transformers' schedule partials map to the C schedules; a
   lambda that cannot be mapped is refused naming it and its group. (PyTorch)
6. save() refuses a data loader position that does not match the step
   (batches_per_step for gradient accumulation, None to skip).
8. save() without a step records the first optimizer's step count, as the C
   accelerator does (0 without an optimizer). (PyTorch)
7. `pip install` of python/ into a temporary target works offline and the
   installed package imports and verifies a checkpoint.
"""
import json
import os
import warnings
import shutil
import subprocess
import sys
import tempfile
import types

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.dont_write_bytecode = True
sys.path.insert(0, os.path.join(ROOT, "python"))
import ckpt_torch  # noqa: E402
from ckpt_torch import _format as F  # noqa: E402
from ckpt_torch import _verify as V  # noqa: E402

try:
    import torch
except ImportError as e:
    torch = None
    TORCH_MISSING = str(e)

BUILD = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "build-test")
CKPT = os.environ.get("CKPT_BIN") or os.path.join(BUILD, "ckpt")


def expect_error(cls, needle, fn, *a, **kw):
    try:
        fn(*a, **kw)
    except cls as e:
        if needle not in str(e):
            raise AssertionError("error %r does not contain %r" % (str(e), needle))
        return str(e)
    raise AssertionError("no %s raised (expected %r)" % (cls.__name__, needle))


def weights(v=0.0):
    return {"fc.weight": np.full((3, 2), v, dtype=np.float32),
            "fc.bias": np.arange(3, dtype=np.float32)}


def loader(epoch, pos, n=100, batch=10):
    return {"seed": 1, "epoch": epoch, "batches_yielded": pos, "dataset_length": n,
            "batch_size": batch, "shuffle": 1, "drop_last": 0, "even_batches": 1,
            "num_processes": 1, "process_index": 0}


def check_metrics(tmp):
    p = os.path.join(tmp, "metrics")
    d = os.path.join(p, "checkpoints", "checkpoint_0")
    m = ckpt_torch.save(d, model=weights(), step=5, metrics={"val/loss": 0.25, "acc": 1})
    assert m["metrics"] == {"val/loss": 0.25, "acc": 1.0}
    assert ckpt_torch.verify(d)["metrics"] == {"val/loss": 0.25, "acc": 1.0}
    text = open(os.path.join(d, "checkpoint.json")).read()
    assert '"metrics": {\n    "val/loss": 0.25,\n    "acc": 1.0\n  },' in text, text
    ls = subprocess.run([CKPT, "ls", p], capture_output=True, text=True, check=True).stdout
    assert "val/loss" in ls and "0.25" in ls, ls
    ins = json.loads(subprocess.run([CKPT, "inspect", "--json", d], capture_output=True,
                                    text=True, check=True).stdout)
    assert "val/loss" in json.dumps(ins), ins
    bad = os.path.join(tmp, "badmetric")
    expect_error(ckpt_torch.InvalidError, "metric name 'bad name'", ckpt_torch.save, bad,
                 model=weights(), metrics={"bad name": 1.0})
    expect_error(ckpt_torch.InvalidError, "metric 'loss': nan is not a finite number",
                 ckpt_torch.save, bad, model=weights(), metrics={"loss": float("nan")})
    expect_error(ckpt_torch.InvalidError, "17 metrics, at most 16", ckpt_torch.save, bad,
                 model=weights(), metrics={"m%d" % i: i for i in range(17)})
    assert not os.path.exists(bad)
    print("ok: save(metrics=) writes the manifest's metrics as C does (ckpt ls shows them); "
          "bad names and values refused")


def check_files_keys_and_extra(tmp):
    d = os.path.join(tmp, "keys")
    ckpt_torch.save(d, model=weights(), dataloader=loader(0, 3), step=3,
                    custom=[{"lr": 0.1}])
    r = ckpt_torch.load(d, as_torch=False)
    stems = {"model", "dataloader", "custom_checkpoint_0", "random_states_0"}
    assert set(r["files"]) == stems, sorted(r["files"])
    assert stems <= set(r), sorted(r)
    for s in stems:
        assert set(r["files"][s]) == set(r[s]), s
    # a save pre-hook's file, listed with kind "extra", is not a state object
    write = os.path.join(d, "notes.txt")
    with open(write, "wb") as f:
        f.write(b"a hook wrote this\n")
    path = os.path.join(d, "checkpoint.json")
    with open(path, "rb") as f:
        m = V.parse_manifest(f.read(), path)
    m["files"].append({"name": "notes.txt", "kind": "extra", "size": 18,
                       "xxh3": "%016x" % F.xxh3_64(b"a hook wrote this\n"), "tensors": {}})
    with open(path, "wb") as f:
        f.write(V.manifest_text(m))
    subprocess.run([CKPT, "verify", d], check=True, capture_output=True)
    r = ckpt_torch.load(d, as_torch=False)
    assert set(r["files"]) == stems, sorted(r["files"])
    with open(write, "ab") as f:
        f.write(b"!")
    with open(write, "r+b") as f:
        f.truncate(18)
        f.seek(0)
        f.write(b"A")
    expect_error(ckpt_torch.CorruptError, "notes.txt: checksum mismatch (a file a save pre-hook "
                 "added)", ckpt_torch.verify, d)
    print("ok: load()['files'] has the stems of load()'s entries; a pre-hook's file is verified "
          "and not parsed as state")


def check_loader_position(tmp):
    out = os.path.join(tmp, "pos")
    # 100 samples in batches of 10: 10 batches per epoch; epoch 1, batch 2 = 12 batches
    msg = expect_error(ckpt_torch.MismatchError, "consumed 12 batches (epoch 1, batches_yielded 2) "
                       "but step 11 x batches_per_step 1 is 11 batches", ckpt_torch.save, out,
                       model=weights(), dataloader=loader(1, 2), step=11)
    assert "batches_per_step=None" in msg
    assert not os.path.exists(out)
    ckpt_torch.save(out, model=weights(), dataloader=loader(1, 2), step=12)
    ckpt_torch.save(out, model=weights(), dataloader=loader(1, 2), step=6, batches_per_step=2)
    ckpt_torch.save(out, model=weights(), dataloader=loader(1, 2), step=7, batches_per_step=None)
    # drop_last, several processes: the C library's batches per epoch
    dl = dict(loader(2, 1, n=105, batch=10), num_processes=2, drop_last=1)  # 5 per epoch
    ckpt_torch.save(out, model=weights(), dataloader=dl, step=11)
    expect_error(ckpt_torch.InvalidError, "batches_per_step must be a positive int",
                 ckpt_torch.save, out, model=weights(), dataloader=dl, step=11,
                 batches_per_step=0)
    print("ok: save() refuses a data loader position that does not match the step")


# ---- PyTorch parts ------------------------------------------------------------------------------

class Net(torch.nn.Module if torch else object):
    def __init__(self, out=3):
        super().__init__()
        self.fc = torch.nn.Linear(2, out)


def check_step_follows_optimizer(tmp):
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    for _ in range(3):
        opt.zero_grad()
        net.fc(torch.ones(4, 2)).sum().backward()
        opt.step()
    d = os.path.join(tmp, "stepfollows", "checkpoint_0")
    assert ckpt_torch.save(d, model=net, optimizer=opt)["step"] == 3
    assert ckpt_torch.verify(d)["step"] == 3
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert ckpt_torch.save(d, model=net, optimizer=opt, step=7)["step"] == 7
        assert ckpt_torch.save(d, model=net, optimizer=opt, step=3)["step"] == 3
    said = [str(x.message) for x in w]
    assert said == ["step 7 differs from the optimizer's step count 3; the checkpoint records 7"], said
    assert ckpt_torch.save(d, model=net)["step"] == 0
    print("ok: save() without a step records the optimizer's step count (3), as C does; "
          "a step that differs is kept with a warning")


def check_key_mapping(tmp):
    d = os.path.join(tmp, "prefixed")
    w = {"model.fc.weight": np.arange(6, dtype=np.float32).reshape(3, 2),
         "model.fc.bias": np.array([7, 8, 9], np.float32),
         "model.head.weight": np.ones((1, 3), np.float32)}
    ckpt_torch.save(d, model=w)
    net = Net()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    # strict: the unexpected key is refused, nothing changes
    expect_error(ckpt_torch.MismatchError, "key 'model.head.weight' in file but not in memory; a "
                 "non-strict load would ignore it", ckpt_torch.load, d, model=net,
                 prefix_map={"model.": ""})
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    r = ckpt_torch.load(d, model=net, prefix_map=[("model.", "")], strict=False)
    assert torch.equal(net.fc.weight, torch.arange(6, dtype=torch.float32).reshape(3, 2))
    assert r["unexpected"] == [("model", "model.head.weight")], r["unexpected"]
    assert r["missing"] == [] and sorted(r["renamed"]) == [("model", "fc.bias", "model.fc.bias"),
                                                           ("model", "fc.weight",
                                                            "model.fc.weight")]
    # rename after the prefix map; a missing key keeps its value
    net2 = Net()
    keep_bias = net2.fc.bias.detach().clone()
    calls = []

    def rename(obj, key):
        calls.append((obj, key))
        return {"fc.bias": "fc.unused"}.get(key)
    r = ckpt_torch.load(d, model=net2, prefix_map={"model.": ""}, rename=rename, strict=False)
    assert ("model", "fc.bias") in calls
    assert torch.equal(net2.fc.bias, keep_bias) and r["missing"] == [("model", "fc.bias")]
    assert ("model", "model.fc.bias") in r["unexpected"]
    # two keys becoming one; a shape difference; both before any change
    expect_error(ckpt_torch.MismatchError, "file keys 'model.fc.weight' and 'model.head.weight' "
                 "both become 'fc.weight'", ckpt_torch.load, d, model=Net(), strict=False,
                 prefix_map={"model.": ""},
                 rename=lambda o, k: "fc.weight" if k == "head.weight" else None)
    small = Net(out=2)
    expect_error(ckpt_torch.MismatchError, "tensor 'fc.weight': shape [3,2] in file, [2,2] in "
                 "memory", ckpt_torch.load, d, model=small, prefix_map={"model.": ""},
                 strict=False)
    expect_error(ckpt_torch.InvalidError, "prefix_map[0] is not a (from, to) pair",
                 ckpt_torch.load, d, model=small, prefix_map=["model."])
    print("ok: prefix_map, rename and strict=False as ckpt_load_state_ex, with the report; "
          "collisions and shape differences refused before any change")


def transformers_like():
    """Functions named and placed as transformers.optimization's schedule
    lambdas (transformers is not a dependency of these tests)."""
    mod = types.ModuleType("transformers.optimization")
    exec("import math\n"
         "def _get_cosine_schedule_with_warmup_lr_lambda(current_step, *, num_warmup_steps,"
         " num_training_steps, num_cycles):\n"
         "    if current_step < num_warmup_steps:\n"
         "        return float(current_step) / float(max(1, num_warmup_steps))\n"
         "    progress = float(current_step - num_warmup_steps) / "
         "float(max(1, num_training_steps - num_warmup_steps))\n"
         "    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * float(num_cycles) * 2.0 * "
         "progress)))\n", mod.__dict__)
    return mod


def check_lambdalr(tmp):
    import functools
    net = Net()
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    custom = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    out = os.path.join(tmp, "lam")
    msg = expect_error(ckpt_torch.UnsupportedError, "LambdaLR group 0: its lambda ",
                       ckpt_torch.save, out, model=net, optimizer=opt, scheduler=custom)
    assert "check_lambdalr.<locals>.<lambda> is not a schedule the C library has" in msg, msg
    assert "ckpt_torch.WarmupCosine(warmup, total)" in msg and not os.path.exists(out)
    hf = transformers_like()
    fn = hf._get_cosine_schedule_with_warmup_lr_lambda
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, functools.partial(
        fn, num_warmup_steps=2, num_training_steps=20, num_cycles=0.5))
    for _ in range(3):
        opt.step()
        sched.step()
    ckpt_torch.save(out, model=net, optimizer=opt, scheduler=sched, step=3)
    flat = ckpt_torch.load_state_dict(os.path.join(out, "scheduler.safetensors"))
    assert (flat["kind"], flat["warmup"], flat["total"]) == ("warmup_cosine", 2, 20), flat
    # and it loads back into such a scheduler, which then agrees with C's schedule
    opt2 = torch.optim.AdamW(Net().parameters(), lr=0.01)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, functools.partial(
        fn, num_warmup_steps=2, num_training_steps=20, num_cycles=0.5))
    expect_error(ckpt_torch.MismatchError, "give the model they belong to (model=...)",
                 ckpt_torch.load, out, optimizer=opt2, scheduler=sched2)
    ckpt_torch.load(out, optimizer=opt2, scheduler=sched2, match_by_position=True)
    assert sched2.get_last_lr() == sched.get_last_lr()
    # state saved without names (no model given) is never matched by position unasked
    unnamed = os.path.join(tmp, "unnamed")
    ckpt_torch.save(unnamed, model=net.state_dict(), optimizer=opt, step=3)  # a dict: no names
    flat = ckpt_torch.load_state_dict(os.path.join(unnamed, "optimizer.safetensors"))
    assert not any(k.startswith("param_names.") for k in flat), list(flat)
    net4 = Net()
    opt4 = torch.optim.AdamW(net4.parameters(), lr=0.01)
    before = {k: v.clone() for k, v in net4.state_dict().items()}
    expect_error(ckpt_torch.MismatchError, "does not name its parameters", ckpt_torch.load,
                 unnamed, model=net4, optimizer=opt4)
    assert not opt4.state_dict()["state"] and \
        all(torch.equal(before[k], v) for k, v in net4.state_dict().items())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ckpt_torch.load(unnamed, model=net4, optimizer=opt4, match_by_position=True)
    assert any("matched by position" in str(w.message) for w in caught), caught
    assert np.array_equal(opt4.state_dict()["state"][0]["exp_avg"].numpy(),
                          flat["state.0.exp_avg"])
    print("ok: optimizer state without names, or without the model to name the parameters, is "
          "refused unless match_by_position=True (then loaded by position with a warning)")
    odd = torch.optim.lr_scheduler.LambdaLR(torch.optim.AdamW(net.parameters(), lr=0.01),
                                            functools.partial(fn, num_warmup_steps=2,
                                                              num_training_steps=20,
                                                              num_cycles=1.0))
    expect_error(ckpt_torch.UnsupportedError, "num_cycles=1.0; the C warmup_cosine is half a "
                 "cosine", ckpt_torch.save, os.path.join(tmp, "lam2"), scheduler=odd)
    print("ok: transformers' cosine partial maps to warmup_cosine; an unmappable lambda is "
          "refused naming it and its group")


# ---- the package ---------------------------------------------------------------------------------

def check_pip_install(tmp):
    src = os.path.join(tmp, "src")
    shutil.copytree(os.path.join(ROOT, "python"), src,
                    ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    target = os.path.join(tmp, "site")
    env = dict(os.environ, PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1",
               PYTHONDONTWRITEBYTECODE="1")
    p = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps",
                        "--no-build-isolation", "--target", target, src],
                       capture_output=True, text=True, env=env, cwd=tmp)
    assert p.returncode == 0, p.stdout + p.stderr
    d = os.path.join(tmp, "pipck")
    ckpt_torch.save(d, model=weights())
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import ckpt_torch; "
            "assert ckpt_torch.__file__.startswith(sys.argv[1]), ckpt_torch.__file__; "
            "print(ckpt_torch.__version__, ckpt_torch.verify(sys.argv[2])['step'])")
    p = subprocess.run([sys.executable, "-I", "-c", code, target, d], capture_output=True,
                       text=True, cwd=tmp)
    assert p.returncode == 0 and p.stdout.split() == [ckpt_torch.__version__, "0"], \
        p.stdout + p.stderr
    meta = [n for n in os.listdir(target) if n.endswith(".dist-info")]
    assert meta == ["ckpt_torch-%s.dist-info" % ckpt_torch.__version__], meta
    print("ok: pip install --no-deps --no-build-isolation --target of python/ works offline; "
          "the installed ckpt_torch %s imports and verifies" % ckpt_torch.__version__)
    # The build needs nothing but the standard library (no setuptools, no
    # wheel: a Python whose setuptools lacks bdist_wheel once failed with
    # "invalid command 'bdist_wheel'"): the backend run with no site-packages
    # at all (-S) writes a wheel, and pip builds one with build isolation,
    # offline (it installs nothing into the isolated environment).
    wheels = os.path.join(tmp, "wheels")
    os.makedirs(wheels)
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import ckpt_torch_build as b; "
            "print(b.build_wheel(sys.argv[2]))")
    p = subprocess.run([sys.executable, "-S", "-I", "-c", code, os.path.join(src, "_backend"),
                        wheels], capture_output=True, text=True, cwd=tmp)
    assert p.returncode == 0, p.stdout + p.stderr
    whl = os.path.join(wheels, p.stdout.strip())
    import zipfile
    with zipfile.ZipFile(whl) as z:
        names = z.namelist()
    assert "ckpt_torch/__init__.py" in names and \
        "ckpt_torch-%s.dist-info/RECORD" % ckpt_torch.__version__ in names, names
    pythons = [sys.executable]
    other = shutil.which("python3")  # another Python 3 (not Debian's) on PATH, if any
    if other and os.path.realpath(other) != os.path.realpath(sys.executable):
        pythons.append(other)
    for py in pythons:
        out = os.path.join(tmp, "wheel-%d" % len(os.listdir(tmp)))
        p = subprocess.run([py, "-m", "pip", "wheel", "--no-deps", "-w", out, src],
                           capture_output=True, text=True, env=env, cwd=tmp)
        assert p.returncode == 0 and os.listdir(out), "%s: %s" % (py, p.stdout + p.stderr)
    print("ok: python/ builds with the standard library alone (python -S), and pip builds it "
          "with build isolation offline under %s" % " and ".join(pythons))


def main():
    if not os.path.exists(CKPT):
        raise SystemExit("ckpt CLI not found: %s" % CKPT)
    tmp = tempfile.mkdtemp(prefix="ckpt_torch_api_")
    try:
        check_metrics(tmp)
        check_files_keys_and_extra(tmp)
        check_loader_position(tmp)
        check_pip_install(tmp)
        if torch is None:
            print("SKIP torch parts: PyTorch is not importable (%s)" % TORCH_MISSING)
            return
        check_key_mapping(tmp)
        check_lambdalr(tmp)
        check_step_follows_optimizer(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("all ckpt_torch API tests passed")


if __name__ == "__main__":
    main()
