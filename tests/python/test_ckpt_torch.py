"""python/ckpt_torch against the C library, both ways.

Usage: test_ckpt_torch.py <build dir>   (CKPT_BIN: the ckpt CLI)

1. `ckpt train` (AdamW with two groups, warmup + cosine, a loss scaler)
   writes checkpoints; Python verifies them, re-encodes every state file and
   the manifest byte for byte, finds the newest with latest(), and loads one
   into real torch objects whose values equal the files'.
2. A flipped byte in a tensor, in a header, and an edited manifest fail
   verify() naming the file (and the tensor), as `ckpt verify` does.
3. save() from those torch objects writes files identical to C's; `ckpt
   verify` and `ckpt inspect` accept the folder, and `ckpt train --resume`
   continues it to the same bits as the uninterrupted C run.
4. A model, optimizer and scheduler made and stepped in PyTorch are saved,
   round-trip through load(), and `ckpt train --resume` continues training
   from them.
5. Without torch (hidden from the import system) verify() and load() work
   and return numpy arrays and plain dicts.
Torch parts are skipped, with the reason printed, if torch is missing."""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import warnings

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.dont_write_bytecode = True  # no __pycache__ in the source tree
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
DATA = os.path.join(ROOT, "data", "digits.csv.gz")
EPOCHS = ["--epochs", "1"]  # 46 steps of 32 samples; warmup 2 steps


def run(*args, check=True):
    p = subprocess.run([CKPT, *args], capture_output=True, text=True)
    if check and p.returncode != 0:
        raise SystemExit("ckpt %s: exit %d\n%s%s" % (" ".join(args), p.returncode, p.stdout, p.stderr))
    return p


def train(project, *extra):
    return run("train", *EPOCHS, "--save-every", "20", "--total-limit", "0", "--workers", "0",
               "--data", DATA, "--project-dir", project, "--quiet", *extra)


def expect_error(cls, needle, fn, *a, **kw):
    try:
        fn(*a, **kw)
    except cls as e:
        if needle not in str(e):
            raise AssertionError("error %r does not contain %r" % (str(e), needle))
        return str(e)
    raise AssertionError("no %s raised (expected %r)" % (cls.__name__, needle))


def file_bytes(d, name):
    with open(os.path.join(d, name), "rb") as f:
        return f.read()


def state_files(d):
    return sorted(n for n in os.listdir(d) if n.endswith(".safetensors"))


# ---- 1. C checkpoints in Python ---------------------------------------------------------

def check_c_checkpoints(tmp):
    proj = os.path.join(tmp, "c")
    train(proj)
    cdir = os.path.join(proj, "checkpoints")
    assert sorted(os.listdir(cdir)) == [".lock", "checkpoint_0", "checkpoint_1", "checkpoint_2"], \
        os.listdir(cdir)
    for n, step in ((0, 20), (1, 40), (2, 46)):
        d = os.path.join(cdir, "checkpoint_%d" % n)
        m = ckpt_torch.verify(d)
        assert m["step"] == step and m["iteration"] == n + 1, m
        assert [f["name"] for f in m["files"]] == [
            "model.safetensors", "optimizer.safetensors", "scheduler.safetensors",
            "dataloader.safetensors", "scaler.safetensors", "custom_checkpoint_0.safetensors",
            "random_states_0.safetensors"]
        # the Python writer reproduces every byte the C writer wrote
        for f in m["files"]:
            data, digests = F.encode_state(F.read_state_file(os.path.join(d, f["name"])).flat())
            assert data == file_bytes(d, f["name"]), f["name"]
            assert {k: "%016x" % h for k, h in digests} == f["tensors"], f["name"]
        assert V.manifest_text(m) == file_bytes(d, "checkpoint.json")
    assert ckpt_torch.latest(proj) == os.path.join(cdir, "checkpoint_2")
    # the manifest agrees with the C tool's reading of it
    info = json.loads(run("inspect", "--json", os.path.join(cdir, "checkpoint_2")).stdout)
    assert json.dumps(info).count('"step": 46') >= 1
    print("ok: 3 checkpoints of ckpt train verify in Python; every file re-encodes byte for byte")
    return proj


# ---- 2. damage ------------------------------------------------------------------------------

def check_damage(tmp, proj):
    src = os.path.join(proj, "checkpoints", "checkpoint_2")
    bad = os.path.join(tmp, "bad")
    sf = F.read_state_file(os.path.join(src, "model.safetensors"))
    _dt, _shape, begin, end = sf.tensors["fc2.weight"]

    def damaged(name, offset=None, edit=None):
        shutil.rmtree(bad, ignore_errors=True)
        shutil.copytree(src, bad)
        path = os.path.join(bad, name)
        data = bytearray(file_bytes(bad, name))
        if edit:
            data = edit(data)
        else:
            data[offset] ^= 0x10
        with open(path, "wb") as f:
            f.write(data)
        return bad

    d = damaged("model.safetensors", (begin + end) // 2)
    msg = expect_error(ckpt_torch.CorruptError,
                       "model.safetensors: tensor 'fc2.weight': checksum mismatch",
                       ckpt_torch.verify, d)
    assert run("verify", d, check=False).returncode == 1
    print("ok: a flipped byte in fc2.weight: %s" % msg)
    # a byte of a padding space in the header: the tensors are intact
    n = int.from_bytes(file_bytes(src, "dataloader.safetensors")[:8], "little")
    d = damaged("dataloader.safetensors", edit=lambda b: b[:8 + n - 1] + b"\t" + b[8 + n:])
    expect_error(ckpt_torch.CorruptError,
                 "dataloader.safetensors: checksum mismatch and the file does not parse",
                 ckpt_torch.verify, d)
    d = damaged("scaler.safetensors", edit=lambda b: b.replace(b'\\"value\\":100}', b'\\"value\\":200}'))
    expect_error(ckpt_torch.CorruptError,
                 "scaler.safetensors: checksum mismatch in the header or metadata",
                 ckpt_torch.verify, d)
    d = damaged("checkpoint.json", edit=lambda b: b.replace(b'"step": 46', b'"step": 47'))
    expect_error(ckpt_torch.CorruptError, "the manifest was changed after it was written",
                 ckpt_torch.verify, d)
    assert run("verify", d, check=False).returncode == 1
    size = os.path.getsize(os.path.join(src, "optimizer.safetensors"))
    d = damaged("optimizer.safetensors", edit=lambda b: b[:-1])
    expect_error(ckpt_torch.CorruptError, "optimizer.safetensors: size %d bytes, the manifest "
                 "says %d (truncated)" % (size - 1, size), ckpt_torch.verify, d)
    d = damaged("checkpoint.json", edit=lambda b: b.replace(b'"format_version": 1', b'"format_version": 4'))
    expect_error(ckpt_torch.UnsupportedError, "format version 4 is newer", ckpt_torch.verify, d)
    d = damaged("checkpoint.json", edit=lambda b: b)
    shutil.copy(os.path.join(bad, "model.safetensors"), os.path.join(bad, "extra.safetensors"))
    expect_error(ckpt_torch.CorruptError, "extra.safetensors is not listed in the manifest",
                 ckpt_torch.verify, d)
    os.remove(os.path.join(bad, "checkpoint.json"))
    expect_error(ckpt_torch.NotFoundError, "not a checkpoint (no checkpoint.json)", ckpt_torch.verify, d)
    # latest() skips a damaged newest checkpoint, as ckpt_load_state does
    proj2 = os.path.join(tmp, "fallback")
    shutil.copytree(proj, proj2)
    with open(os.path.join(proj2, "checkpoints", "checkpoint_2", "scaler.safetensors"), "r+b") as f:
        f.seek(20)
        f.write(b"#")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert ckpt_torch.latest(proj2) == os.path.join(proj2, "checkpoints", "checkpoint_1")
    assert any("skipping" in str(x.message) and "scaler.safetensors" in str(x.message) for x in w)
    print("ok: damaged tensors, headers, metadata, manifests and folders are refused by name")


# ---- 3. C -> torch -> C ----------------------------------------------------------------------

class MLP(torch.nn.Module if torch else object):
    """ckpt train's network (tools/mlp.c) under the same names."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(64, 256)
        self.fc2 = torch.nn.Linear(256, 256)
        self.fc3 = torch.nn.Linear(256, 10)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x):
        x = self.drop(torch.relu(self.fc1(x)))
        x = self.drop(torch.relu(self.fc2(x)))
        return self.fc3(x)


def torch_objects(lr=0.002, total=46):
    net = MLP()
    weights = [net.fc1.weight, net.fc2.weight, net.fc3.weight]
    biases = [net.fc1.bias, net.fc2.bias, net.fc3.bias]
    opt = torch.optim.AdamW([{"params": weights, "weight_decay": 0.01},
                             {"params": biases, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.999), eps=1e-8, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, ckpt_torch.WarmupCosine(total // 20, total))
    return net, opt, sched


def enabled_scaler():
    """A GradScaler that keeps its state on this machine. torch 1.13 turns
    GradScaler off without CUDA (it then has no state at all), so it is
    built with CUDA reported present: its state_dict/load_state_dict touch
    no device until scale() is called, which this test never does."""
    amp = getattr(torch, "amp", None)
    if amp is not None and hasattr(amp, "GradScaler"):
        try:
            return amp.GradScaler("cpu", init_scale=1.0, growth_interval=7)
        except Exception:
            pass
    real = torch.cuda.is_available
    torch.cuda.is_available = lambda: True
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.cuda.amp.GradScaler(init_scale=1.0, growth_interval=7)
    finally:
        torch.cuda.is_available = real


def check_torch_load(proj):
    cdir = os.path.join(proj, "checkpoints")
    d1 = os.path.join(cdir, "checkpoint_1")
    net, opt, sched = torch_objects()
    scaler = enabled_scaler()
    res = ckpt_torch.load(d1, model=net, optimizer=opt, scheduler=sched, scaler=scaler)
    assert res["step"] == 40 and res["dir"] == d1
    files = {n: ckpt_torch.load_state_dict(os.path.join(d1, n)) for n in state_files(d1)}
    model_f, opt_f = files["model.safetensors"], files["optimizer.safetensors"]
    for k, v in net.state_dict().items():
        assert np.array_equal(v.numpy(), model_f[k]) and v.dtype == torch.float32, k
    sd = opt.state_dict()
    assert sd["param_groups"][0]["params"] == [0, 1, 2] and sd["param_groups"][1]["params"] == [3, 4, 5]
    for g in range(2):
        pg = sd["param_groups"][g]
        assert pg["lr"] == opt_f["param_groups.%d.lr" % g]
        assert pg["weight_decay"] == (0.01, 0.0)[g]
        assert pg["betas"] == (0.9, 0.999) and pg["eps"] == 1e-8 and pg["amsgrad"] is False
    names = ["fc1.weight", "fc2.weight", "fc3.weight", "fc1.bias", "fc2.bias", "fc3.bias"]
    for i, name in enumerate(names):
        st = sd["state"][i]
        assert float(st["step"]) == 40.0
        assert st["exp_avg"].shape == net.state_dict()[name].shape
        for b in ("exp_avg", "exp_avg_sq"):
            assert np.array_equal(st[b].numpy(), opt_f["state.%d.%s" % (i, b)]), (i, b)
    # the optimizer's parameters are the model's: a step moves the model
    s = sched.state_dict()
    sched_f = files["scheduler.safetensors"]
    assert s["last_epoch"] == 40 and s["_step_count"] == 41
    assert s["base_lrs"] == [0.002, 0.002] and s["_last_lr"] == [sched_f["_last_lr.0"]] * 2
    assert scaler.state_dict() == {"scale": files["scaler.safetensors"]["scale"],
                                   "growth_factor": 2.0, "backoff_factor": 0.5,
                                   "growth_interval": 100, "_growth_tracker": 40}
    # PyTorch continues the schedule where C did: 6 more steps give C's rate at step 46
    last = ckpt_torch.load_state_dict(os.path.join(cdir, "checkpoint_2", "scheduler.safetensors"))
    for _ in range(6):
        opt.step()  # no gradients: parameters unchanged, keeps the scheduler's order check quiet
        sched.step()
    assert sched.get_last_lr() == [last["_last_lr.0"], last["_last_lr.1"]], (sched.get_last_lr(), last)
    print("ok: ckpt train's checkpoint_1 loaded into nn.Module, AdamW (2 groups), LambdaLR and "
          "GradScaler; values equal to the files; the schedule continues to C's rate at step 46")

    # the file names each state index's parameter: an optimizer that lists them in another
    # order gets each parameter's own state
    assert [opt_f["param_names.%d" % i] for i in range(6)] == names
    net3 = MLP()
    rev = torch.optim.AdamW([{"params": [net3.fc3.weight, net3.fc2.weight, net3.fc1.weight],
                              "weight_decay": 0.01},
                             {"params": [net3.fc3.bias, net3.fc2.bias, net3.fc1.bias],
                              "weight_decay": 0.0}], lr=0.002, foreach=False)
    ckpt_torch.load(d1, model=net3, optimizer=rev)
    for i, name in enumerate(["fc3.weight", "fc2.weight", "fc1.weight", "fc3.bias", "fc2.bias",
                              "fc1.bias"]):
        j = names.index(name)
        for b in ("exp_avg", "exp_avg_sq"):
            assert np.array_equal(rev.state_dict()["state"][i][b].numpy(),
                                  opt_f["state.%d.%s" % (j, b)]), (name, b)
    print("ok: an optimizer listing the parameters in another order gets each one's state by name")

    # a mismatch changes nothing: Adam is not AdamW
    net2, _o, _s = torch_objects()
    before = {k: v.clone() for k, v in net2.state_dict().items()}
    adam = torch.optim.Adam(net2.parameters())
    expect_error(ckpt_torch.MismatchError, "for an adamw optimizer, this one is adam",
                 ckpt_torch.load, d1, model=net2, optimizer=adam)
    assert all(torch.equal(before[k], v) for k, v in net2.state_dict().items())
    bigger = torch.nn.Linear(64, 3)
    expect_error(ckpt_torch.MismatchError, "missing in file", ckpt_torch.load, d1, model=bigger)
    return files


def check_torch_save_and_c_resume(tmp, proj):
    cdir = os.path.join(proj, "checkpoints")
    d0 = os.path.join(cdir, "checkpoint_0")
    net, opt, sched = torch_objects()
    scaler = enabled_scaler()
    res = ckpt_torch.load(d0, model=net, optimizer=opt, scheduler=sched, scaler=scaler)
    py = os.path.join(tmp, "py")
    out = os.path.join(py, "checkpoints", "checkpoint_0")
    ckpt_torch.save(out, model=net, optimizer=opt, scheduler=sched, scaler=scaler, step=res["step"],
                    dataloader=res["files"]["dataloader"],
                    custom=[res["files"]["custom_checkpoint_0"]],
                    random_states=res["files"]["random_states_0"])
    assert sorted(os.listdir(os.path.join(py, "checkpoints"))) == [".lock", "checkpoint_0"]
    # the same objects give the same bytes as C wrote
    assert state_files(out) == state_files(d0)
    for n in state_files(out):
        assert file_bytes(out, n) == file_bytes(d0, n), n
    m = ckpt_torch.verify(out)
    assert m["step"] == 20 and m["iteration"] == 1
    v = run("verify", out)
    assert v.stdout.startswith("ok ") and "(step 20, 7 files" in v.stdout, v.stdout
    ins = run("inspect", out).stdout
    assert "step 20, iteration 1" in ins and "state.5.exp_avg_sq" in ins and "warmup_cosine" in ins, ins
    # C resumes the Python-written checkpoint and ends where the uninterrupted run ended
    train(py, "--resume")
    a, b = os.path.join(cdir, "checkpoint_2"), os.path.join(py, "checkpoints", "checkpoint_2")
    assert ckpt_torch.verify(b)["step"] == 46
    for n in state_files(a):
        assert file_bytes(a, n) == file_bytes(b, n), n
    print("ok: save() from torch objects is byte for byte C's; ckpt verify/inspect accept it; "
          "ckpt train --resume from it ends bit for bit where the C run ended")


def check_torch_native(tmp, files):
    """A run started in PyTorch, continued by C."""
    torch.manual_seed(0)
    net, opt, sched = torch_objects()
    x = torch.rand(32, 64)
    y = torch.randint(0, 10, (32,))
    for _ in range(3):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        sched.step()
    scaler_state = {"scale": 512.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                    "growth_interval": 100, "_growth_tracker": 3}
    run_config = files["custom_checkpoint_0.safetensors"]  # epochs, batch size, seed, rows, width, lr
    loader = dict(files["dataloader.safetensors"], batches_yielded=3)
    tp = os.path.join(tmp, "torchrun")
    out = os.path.join(tp, "checkpoints", "checkpoint_0")
    ckpt_torch.save(out, model=net, optimizer=opt, scheduler=sched, scaler=scaler_state, step=3,
                    dataloader=loader, custom=[run_config], seed=1)
    run("verify", out)
    # round trip through Python into fresh objects
    net2, opt2, sched2 = torch_objects()
    ckpt_torch.load(out, model=net2, optimizer=opt2, scheduler=sched2)
    for k, v in net.state_dict().items():
        assert torch.equal(v, net2.state_dict()[k]), k
    s1, s2 = opt.state_dict(), opt2.state_dict()
    assert s1["param_groups"] == s2["param_groups"]
    for i in s1["state"]:
        for k in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(s1["state"][i][k], s2["state"][i][k]), (i, k)
    assert sched.state_dict() == sched2.state_dict()
    # and C continues training it
    train(tp, "--resume")
    with open(os.path.join(tp, "logs", "metrics.jsonl")) as f:
        lines = [json.loads(x) for x in f]
    assert [x["step"] for x in lines] == list(range(4, 47)), [x["step"] for x in lines]
    assert lines[0]["scale"] == 512.0
    assert lines[-1]["loss"] < lines[0]["loss"], (lines[0], lines[-1])
    final = ckpt_torch.load(ckpt_torch.latest(tp), as_torch=True)
    assert final["step"] == 46
    assert not torch.equal(final["model"]["fc1.weight"], net.state_dict()["fc1.weight"])
    print("ok: a model, AdamW and LambdaLR stepped in PyTorch, saved with save(), reload equal and "
          "ckpt train --resume continues them from step 4 to 46 (loss %.3f -> %.3f)"
          % (lines[0]["loss"], lines[-1]["loss"]))


# ---- 5. no torch ----------------------------------------------------------------------------------

NO_TORCH = r"""
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch hidden for this test")
sys.meta_path.insert(0, Block())
sys.path.insert(0, sys.argv[1])
import numpy as np, ckpt_torch
assert ckpt_torch.torch is None
r = ckpt_torch.load(sys.argv[2])
assert isinstance(r["model"]["fc1.weight"], np.ndarray) and r["model"]["fc1.weight"].dtype == np.float32
o = r["optimizer"]
assert isinstance(o["state"][0]["exp_avg"], np.ndarray) and o["param_groups"][1]["params"] == [3, 4, 5]
assert isinstance(r["scheduler"]["base_lrs"], list) and r["scaler"]["growth_interval"] == 100
try:
    ckpt_torch.load(sys.argv[2], model=object())
    raise AssertionError("loading into objects without torch must fail")
except ImportError as e:
    assert "PyTorch" in str(e)
print("numpy only: ok")
"""


def check_without_torch(proj):
    d = os.path.join(proj, "checkpoints", "checkpoint_2")
    p = subprocess.run([sys.executable, "-c", NO_TORCH, os.path.join(ROOT, "python"), d],
                       capture_output=True, text=True)
    assert p.returncode == 0 and "numpy only: ok" in p.stdout, p.stdout + p.stderr
    print("ok: without torch, verify() and load() give numpy arrays and plain dicts")


def main():
    if not os.path.exists(CKPT):
        raise SystemExit("ckpt CLI not found: %s" % CKPT)
    assert ckpt_torch.__version__ == open(os.path.join(ROOT, "CMakeLists.txt")).read().split(
        "project(ckpt VERSION ")[1].split()[0], "ckpt_torch.__version__ differs from the project's"
    tmp = tempfile.mkdtemp(prefix="ckpt_torch_")
    try:
        proj = check_c_checkpoints(tmp)
        check_damage(tmp, proj)
        check_without_torch(proj)
        if torch is None:
            print("SKIP torch parts: PyTorch is not importable (%s); scripts/setup test installs "
                  "python3-torch" % TORCH_MISSING)
            return
        files = check_torch_load(proj)
        check_torch_save_and_c_resume(tmp, proj)
        check_torch_native(tmp, files)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("all ckpt_torch tests passed")


if __name__ == "__main__":
    main()
