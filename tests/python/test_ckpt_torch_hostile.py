"""python/ckpt_torch against hostile files and folders (replayable: every
input is made by this script).

Usage: test_ckpt_torch_hostile.py <build dir>   (CKPT_BIN: the ckpt CLI)

1. Sizes: a tensor of shape [2**62, 4, 0] loads (as the C reader accepts
   it); shapes whose sizes overflow get the C reader's message as a
   CorruptError (a ValueError), never a bare ValueError or MemoryError.
2. 8 EiB: a sparse 2^63-64-byte model file with a forged manifest is damage
   (refused at once, the project falls back); two of them overflow the
   sum; a valid header over 8 EiB of data is TooLargeError, not MemoryError.
3. Non-regular files: a FIFO (as checkpoint.json, as a state file, as a
   single file), a folder and a link to /dev/zero as checkpoint.json never
   block and are damage: verify names them, latest() and load(project_dir=)
   fall back with a warning. Each call runs in a child with a time limit,
   so a regression fails instead of hanging. A checkpoint's own files are
   never read through a symbolic link (a state file, the manifest, a shard
   index; a link swapped in after the look too): verify refuses them with
   the very message `ckpt verify` prints; a single file the caller names
   (load_state_dict) may be a link, as in the C library.
4. The save lock is never followed or truncated: a symbolic link, a hard
   link, a FIFO as checkpoints/.lock are refused and the target is intact.
5. Control characters of hostile names are escaped in errors and warnings.
"""
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import warnings

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.dont_write_bytecode = True
sys.path.insert(0, os.path.join(ROOT, "python"))
import ckpt_torch  # noqa: E402
from ckpt_torch import _verify as V  # noqa: E402

BUILD = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "build-test")
CKPT = os.environ.get("CKPT_BIN") or os.path.join(BUILD, "ckpt")


def expect_error(cls, needle, fn, *a, **kw):
    try:
        fn(*a, **kw)
    except cls as e:
        if needle not in str(e):
            raise AssertionError("error %r does not contain %r" % (str(e), needle))
        return str(e)
    except BaseException as e:
        raise AssertionError("%s raised %s: %s, expected %s (%r)"
                             % (getattr(fn, "__name__", fn), type(e).__name__, e, cls.__name__,
                                needle))
    raise AssertionError("no %s raised (expected %r)" % (cls.__name__, needle))


def safetensors(header, data=b""):
    h = json.dumps(header).encode()
    h += b" " * (-(8 + len(h)) % 8)
    return struct.pack("<Q", len(h)) + h + data


def write(path, data):
    with open(path, "wb") as f:
        f.write(data)


def project(tmp, name, n=2):
    """A project with checkpoints 0..n-1 written by ckpt_torch.save (byte for
    byte the C writer's layout)."""
    p = os.path.join(tmp, name)
    for i in range(n):
        w = {"fc.weight": np.full((3, 2), i, dtype=np.float32),
             "fc.bias": np.arange(3, dtype=np.float32)}
        ckpt_torch.save(os.path.join(p, "checkpoints", "checkpoint_%d" % i), model=w,
                        step=10 * (i + 1))
    return p


def forge_manifest(d, edit):
    """Rewrites checkpoint.json after edit(manifest dict), with a valid
    self-checksum: damage that only the files themselves can reveal."""
    path = os.path.join(d, "checkpoint.json")
    with open(path, "rb") as f:
        m = V.parse_manifest(f.read(), path)
    edit(m)
    write(path, V.manifest_text(m))


def newest_fell_back(p, expect, needle, fn):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        got = fn()
    msgs = [str(x.message) for x in w]
    assert any("skipping" in m and needle in m for m in msgs), (needle, msgs)
    return got, msgs


# ---- 1. sizes --------------------------------------------------------------------------------

def check_sizes(tmp):
    path = os.path.join(tmp, "empty_huge.safetensors")
    write(path, safetensors({"t": {"dtype": "F32", "shape": [2**62, 4, 0], "data_offsets": [0, 0]},
                             "u": {"dtype": "I64", "shape": [2], "data_offsets": [0, 16]}},
                            struct.pack("<qq", 7, -7)))
    flat = ckpt_torch.load_state_dict(path)
    t = flat["t"]
    assert isinstance(t, ckpt_torch.RawTensor) and t.shape == (2**62, 4, 0) and t.data == b"", t
    assert list(flat["u"]) == [7, -7]
    # in a checkpoint: verify, load, and save it back byte for byte
    d = os.path.join(tmp, "huge_empty_ckpt")
    ckpt_torch.save(d, model={"t": t, "u": flat["u"]})
    ckpt_torch.verify(d)
    r = ckpt_torch.load(d, as_torch=False)
    assert r["model"]["t"] == t
    subprocess.run([CKPT, "verify", d], check=True, capture_output=True)
    print("ok: an F32 tensor of shape [2**62, 4, 0] loads (RawTensor), saves and verifies")

    cases = [
        ({"dtype": "F32", "shape": [2**62, 4, 2], "data_offsets": [0, 0]},
         "tensor 't': shape [4611686018427387904,4,2] x element size overflows"),
        ({"dtype": "F32", "shape": [2**61], "data_offsets": [0, 0]},
         "tensor 't': shape [2305843009213693952] x element size overflows"),
        ({"dtype": "U8", "shape": [2**32, 2**32], "data_offsets": [0, 0]},
         "tensor 't': shape [4294967296,4294967296] x element size overflows"),
        ({"dtype": "F4", "shape": [2**62, 2**3], "data_offsets": [0, 0]},
         "F4 shape [4611686018427387904,8]: elements x 4 bits is not a whole number of bytes "
         "(or overflows)"),
        ({"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 4]},
         "data_offsets [0, 4] hold 4 bytes, F32 shape [2,3] needs 24"),
    ]
    for i, (entry, needle) in enumerate(cases):
        path = os.path.join(tmp, "size%d.safetensors" % i)
        write(path, safetensors({"t": entry}, b"\0" * entry["data_offsets"][1]))
        e = expect_error(ckpt_torch.CorruptError, needle, ckpt_torch.load_state_dict, path)
        assert isinstance(ckpt_torch.CorruptError(e), ValueError)
        c = subprocess.run([CKPT, "inspect", path], capture_output=True, text=True)
        assert c.returncode != 0 and needle in c.stderr, (needle, c.stderr)
    # arguments: the module's own error class, still a ValueError
    expect_error(ckpt_torch.InvalidError, "key is empty", ckpt_torch.save,
                 os.path.join(tmp, "badkey"), model={"": np.zeros(1, np.float32)})
    expect_error(ckpt_torch.InvalidError, "F32 shape [2,2] needs 16 bytes, 3 given",
                 ckpt_torch.RawTensor, "F32", (2, 2), b"abc")
    print("ok: overflowing shapes are CorruptError with the C reader's message (%d cases)"
          % len(cases))


# ---- 2. 8 EiB --------------------------------------------------------------------------------

EIB8 = 2**63 - 64  # as the forged manifests of the issue
EIB8_ONE = 2**63 - 2**20  # one such file beside the checkpoint's small ones


def sparse_dir():
    """A folder on a file system that holds sparse files of 2^63-64 bytes
    (tmpfs does), or None."""
    for base in ("/dev/shm", tempfile.gettempdir()):
        try:
            d = tempfile.mkdtemp(prefix="ckpt_torch_eib_", dir=base)
        except OSError:
            continue
        try:
            with open(os.path.join(d, "probe"), "wb") as f:
                f.truncate(EIB8)
            os.remove(os.path.join(d, "probe"))
            return d
        except OSError:
            shutil.rmtree(d, ignore_errors=True)
    return None


def check_8eib():
    tmp = sparse_dir()
    if tmp is None:
        print("SKIP 8 EiB cases: no file system here holds a sparse 2^63-64-byte file")
        return
    try:
        p = project(tmp, "eib")
        d1 = os.path.join(p, "checkpoints", "checkpoint_1")
        model = os.path.join(d1, "model.safetensors")
        os.remove(model)
        with open(model, "wb") as f:
            f.truncate(EIB8_ONE)

        def size_it(m):
            m["files"][0]["size"] = EIB8_ONE
        forge_manifest(d1, size_it)
        expect_error(ckpt_torch.CorruptError, "model.safetensors: checksum mismatch and the file "
                     "does not parse: ", ckpt_torch.verify, d1)
        d0 = os.path.join(p, "checkpoints", "checkpoint_0")
        got, _ = newest_fell_back(p, d0, "model.safetensors", lambda: ckpt_torch.latest(p))
        assert got == d0, got
        r, _ = newest_fell_back(p, d0, "does not parse",
                                lambda: ckpt_torch.load(project_dir=p, as_torch=False))
        assert r["dir"] == d0 and r["step"] == 10
        # two of them: the sum passes 2^63-1 before any byte is read
        rs = os.path.join(d1, "random_states_0.safetensors")
        os.remove(rs)
        for path in (model, rs):
            with open(path, "ab") as f:
                f.truncate(EIB8)

        def size_both(m):
            for f in m["files"]:
                f["size"] = EIB8
        forge_manifest(d1, size_both)
        expect_error(ckpt_torch.CorruptError, "the listed files add up to more than 2^63-1 bytes",
                     ckpt_torch.verify, d1)
        # a valid header over 8 EiB of tensor data: too large to hold, said so
        shutil.rmtree(d1)
        shutil.copytree(d0, d1)
        hdr = json.dumps({"big": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}})
        n = len(hdr) + 64
        data_len = EIB8_ONE - 8 - n
        hdr = json.dumps({"big": {"dtype": "U8", "shape": [data_len],
                                  "data_offsets": [0, data_len]}}).encode()
        hdr += b" " * (n - len(hdr))
        model = os.path.join(d1, "model.safetensors")
        with open(model, "wb") as f:
            f.write(struct.pack("<Q", n) + hdr)
            f.truncate(EIB8_ONE)
        forge_manifest(d1, size_it)
        expect_error(ckpt_torch.TooLargeError, "model.safetensors: %d bytes do not fit" % EIB8_ONE,
                     ckpt_torch.load, d1, as_torch=False)
        assert issubclass(ckpt_torch.TooLargeError, ckpt_torch.CkptError)
        print("ok: 8 EiB sparse files: damage refused at once (the project falls back), sizes "
              "summed before reading, a valid 8 EiB layout is TooLargeError")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---- 3. non-regular files, each call in a child with a time limit --------------------------

CHILD = r"""
import sys, warnings, json
class NoTorch:  # the child needs numpy only; importing torch would take seconds
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch not needed here")
sys.meta_path.insert(0, NoTorch())
sys.path.insert(0, sys.argv[1])
import ckpt_torch
op, arg = sys.argv[2], sys.argv[3]
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    try:
        if op == "verify":
            r = ckpt_torch.verify(arg)["step"]
        elif op == "latest":
            r = ckpt_torch.latest(arg)
        elif op == "load_project":
            r = ckpt_torch.load(project_dir=arg, as_torch=False)["dir"]
        elif op == "load_state_dict":
            r = sorted(ckpt_torch.load_state_dict(arg))
        else:
            raise SystemExit("unknown op " + op)
        out = {"result": r}
    except ckpt_torch.CkptError as e:
        out = {"error": type(e).__name__, "message": str(e)}
out["warnings"] = [str(x.message) for x in w]
print(json.dumps(out))
"""


def child(op, arg):
    try:
        p = subprocess.run([sys.executable, "-c", CHILD, os.path.join(ROOT, "python"), op, arg],
                           capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        raise AssertionError("ckpt_torch %s(%s) blocked (killed after 120 s)" % (op, arg))
    assert p.returncode == 0, (op, arg, p.stdout, p.stderr)
    return json.loads(p.stdout)


def check_nonregular(tmp):
    p = project(tmp, "fifo")
    d0 = os.path.join(p, "checkpoints", "checkpoint_0")
    d1 = os.path.join(p, "checkpoints", "checkpoint_1")
    man = os.path.join(d1, "checkpoint.json")
    kinds = (("a FIFO", lambda: os.mkfifo(man)), ("a folder", lambda: os.mkdir(man)),
             ("a character device", lambda: os.symlink("/dev/zero", man)))
    for what, make in kinds:
        os.remove(man) if not os.path.isdir(man) or os.path.islink(man) else os.rmdir(man)
        make()
        r = child("verify", d1)
        # never followed: the link to /dev/zero is a symlink, as C says it
        needle = "checkpoint.json: %s, expected a regular file" % (
            "a symlink" if what == "a character device" else what)
        assert r.get("error") == "CorruptError" and needle in r["message"], r
        for op in ("latest", "load_project"):
            r = child(op, p)
            assert r.get("result") == d0, (what, op, r)
            assert any("skipping %s" % d1 in w and needle in w for w in r["warnings"]), r
    print("ok: checkpoint.json as a FIFO, a folder, a link to /dev/zero: verify refuses at once, "
          "latest() and load(project_dir=) fall back with a warning")
    # a FIFO as a listed state file, and as a single file
    shutil.rmtree(d1)
    shutil.copytree(d0, d1)
    model = os.path.join(d1, "model.safetensors")
    os.remove(model)
    os.mkfifo(model)
    r = child("verify", d1)
    assert r.get("error") == "CorruptError" and \
        "model.safetensors: a FIFO, expected a regular file" in r["message"], r
    r = child("load_project", p)
    assert r.get("result") == d0, r
    r = child("load_state_dict", model)
    assert r.get("error") == "CorruptError" and "not a regular file (a FIFO)" in r["message"], r
    print("ok: a FIFO state file is refused by verify, load and load_state_dict without blocking")


def ckpt_verify_says(d):
    """The reason `ckpt verify` gives for the checkpoint folder d."""
    p = subprocess.run([CKPT, "verify", d], capture_output=True, text=True)
    assert p.returncode == 1, (d, p.stdout, p.stderr)
    return p.stdout.strip().splitlines()[-1].strip()


def check_symlinks(tmp):
    p = project(tmp, "links")
    d0 = os.path.join(p, "checkpoints", "checkpoint_0")
    d1 = os.path.join(p, "checkpoints", "checkpoint_1")
    outside = os.path.join(tmp, "outside")
    os.mkdir(outside)
    # a state file and the manifest, each moved out of the folder with a link
    # left in its place: the same bytes, but not the checkpoint's own file
    for name in ("model.safetensors", "checkpoint.json"):
        path = os.path.join(d1, name)
        real = os.path.join(outside, name)
        shutil.move(path, real)
        os.symlink(real, path)
        c_says = ckpt_verify_says(d1)
        r = child("verify", d1)
        assert r.get("error") == "CorruptError" and r["message"] == c_says, (name, r, c_says)
        assert r["message"].endswith("%s: a symlink, expected a regular file" % name), r
        r = child("load_project", p)
        assert r.get("result") == d0, (name, r)
        assert any("skipping %s" % d1 in w and "a symlink" in w for w in r["warnings"]), r
        os.remove(path)
        shutil.move(real, path)
    assert ckpt_torch.verify(d1)["step"] == 20
    # a file the caller names may be a link (the C library follows it too)
    link = os.path.join(tmp, "model-link.safetensors")
    os.symlink(os.path.join(d1, "model.safetensors"), link)
    assert sorted(ckpt_torch.load_state_dict(link)) == ["fc.bias", "fc.weight"]
    # a link swapped in between the look (lstat) and the open: O_NOFOLLOW
    from ckpt_torch import _format as F
    real_lstat = F.os.lstat
    F.os.lstat = os.stat  # the look sees the link's target, a regular file
    try:
        expect_error(ckpt_torch.CorruptError, "x: a symlink, expected a regular file",
                     F.open_own, link, "x")
    finally:
        F.os.lstat = real_lstat
    print("ok: a symlinked state file or manifest is refused by verify with ckpt verify's very "
          "message, load(project_dir=) falls back; a single file the caller names may be a link")


# ---- 4. the save lock ------------------------------------------------------------------------

def check_lock(tmp):
    p = project(tmp, "lock", 1)
    cdir = os.path.join(p, "checkpoints")
    lock = os.path.join(cdir, ".lock")
    precious = os.path.join(tmp, "precious.txt")
    write(precious, b"do not truncate me\n")
    target = os.path.join(cdir, "checkpoint_0", "model.safetensors")
    before = open(target, "rb").read()
    w = {"fc.weight": np.zeros((3, 2), np.float32)}
    out = os.path.join(cdir, "checkpoint_1")
    for what, make, needle in (
            ("symlink to a file outside", lambda: os.symlink(precious, lock),
             "is a symbolic link"),
            ("symlink to the newest model", lambda: os.symlink(target, lock),
             "is a symbolic link"),
            ("hard link to the newest model", lambda: os.link(target, lock), "has 2 links"),
            ("FIFO", lambda: os.mkfifo(lock), "not a regular file (a FIFO)"),
            ("folder", lambda: os.mkdir(lock), "is a folder")):
        if os.path.isdir(lock) and not os.path.islink(lock):
            os.rmdir(lock)
        elif os.path.lexists(lock):
            os.remove(lock)
        make()
        expect_error(ckpt_torch.InvalidError, needle, ckpt_torch.save, out, model=w, step=1)
        assert open(precious, "rb").read() == b"do not truncate me\n", what
        assert open(target, "rb").read() == before, what
        assert not os.path.exists(out), what
    print("ok: a symlinked, hard-linked, FIFO or folder lock is refused; nothing it points at "
          "changes")


# ---- 5. control characters ---------------------------------------------------------------------

def check_escaping(tmp):
    evil = "x\x1b[2J\nFAKE: ok\x07\x9b"
    path = os.path.join(tmp, "evil.safetensors")
    write(path, safetensors({evil: {"dtype": "F32", "shape": [3], "data_offsets": [0, 4]}},
                            b"\0" * 4))
    msg = expect_error(ckpt_torch.CorruptError, "x\\x1b[2J\\x0aFAKE: ok\\x07\\x9b",
                       ckpt_torch.load_state_dict, path)
    assert not any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F for c in msg), repr(msg)
    # in a warning: a project whose newest checkpoint holds that file
    p = project(tmp, "escape")
    d1 = os.path.join(p, "checkpoints", "checkpoint_1")
    model = os.path.join(d1, "model.safetensors")
    write(model, open(path, "rb").read())
    size = os.path.getsize(model)

    def fix(m):
        m["files"][0]["size"] = size
    forge_manifest(d1, fix)
    _, msgs = newest_fell_back(p, None, "\\x1b[2J\\x0aFAKE",
                               lambda: ckpt_torch.load(project_dir=p, as_torch=False))
    assert not any(ord(c) < 0x20 for m in msgs for c in m), msgs
    print("ok: control characters of a hostile tensor name are escaped in errors and warnings")


def main():
    if not os.path.exists(CKPT):
        raise SystemExit("ckpt CLI not found: %s" % CKPT)
    tmp = tempfile.mkdtemp(prefix="ckpt_torch_hostile_")
    try:
        check_sizes(tmp)
        check_8eib()
        check_nonregular(tmp)
        check_symlinks(tmp)
        check_lock(tmp)
        check_escaping(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("all hostile-input tests passed")


if __name__ == "__main__":
    main()
