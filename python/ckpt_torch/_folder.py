"""Checkpoint folders: their numbering, the lock, and the atomic publish of
a folder as ckpt_save_state does it for an explicit folder
(docs/CHECKPOINTS.md)."""
import errno
import fcntl
import math
import os
import re
import stat
import time

import numpy as np

from ._format import (LIBRARY_VERSION, MANIFEST_NAME, WRITE_FORMAT_VERSION, BusyError,
                      InvalidError, _hex, _kind_of, encode_state, xxh3_64)
from ._verify import MAX_METRICS, _METRIC_NAME, manifest_text

# ---- checkpoint folders -----------------------------------------------------

_NUM = re.compile(r"checkpoint_(0|[1-9][0-9]{0,17})")


def checkpoint_number(name):
    """n for a folder named checkpoint_<n> (1..18 digits, no leading zero),
    else None: the C library's rule."""
    mm = _NUM.fullmatch(name)
    return int(mm.group(1)) if mm else None


def list_numbers(cdir):
    try:
        names = os.listdir(cdir)
    except FileNotFoundError:
        return []
    out = []
    for n in names:
        k = checkpoint_number(n)
        if k is not None and os.path.isdir(os.path.join(cdir, n)) and \
                not os.path.islink(os.path.join(cdir, n)):
            out.append(k)
    return sorted(out)


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path, data):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view[: 64 << 20])
            view = view[n:]
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_tree(path):
    """Removes what is at path without following a link: a link or a file is
    unlinked itself, a folder removed with its contents."""
    import shutil
    st = os.lstat(path)
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path, ignore_errors=False)
    else:
        os.unlink(path)


def open_lock(path, what="save"):
    """The lock file's descriptor, open for writing, created if absent.
    Only a regular file with one link is used: never a symbolic link
    (O_NOFOLLOW), a FIFO (O_NONBLOCK, then fstat), a folder, or a hard link
    to another file, since the lock is truncated and written. InvalidError
    naming what was found otherwise; nothing was written."""
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise InvalidError("%s: %s is a symbolic link; the lock must be a regular file "
                               "(not following it, nothing written)" % (what, path)) from None
        if e.errno == errno.EISDIR:
            raise InvalidError("%s: %s is a folder; the lock must be a regular file"
                               % (what, path)) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidError("%s: %s is not a regular file (%s); the lock must be one "
                               "(nothing written)" % (what, path, _kind_of(st.st_mode)))
        if st.st_nlink != 1:
            raise InvalidError("%s: %s has %d links; the lock must be a file of its own "
                               "(nothing written)" % (what, path, st.st_nlink))
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _rename_exchange(a, b):
    """renameat2(RENAME_EXCHANGE) through libc; False if unavailable."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    AT_FDCWD, RENAME_EXCHANGE = -100, 2
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) != 0:
        e = ctypes.get_errno()
        if e in (errno.ENOSYS, errno.EINVAL):
            return False
        raise OSError(e, "rename %s <-> %s: %s" % (a, b, os.strerror(e)))
    return True


def _lock_path(parent, base):
    if checkpoint_number(base) is not None:
        return os.path.join(parent, ".lock")
    return os.path.join(parent, "." + base + ".lock")


_LEFTOVER = re.compile(r"\.(?P<base>.+)\.(tmp\.[0-9]{1,20}|old\.[0-9]{1,20}(\.[0-9]{1,20})?)")


def check_metrics(metrics):
    """The metrics of a save as ckpt_set_metric takes them: at most 16 names
    of 1..63 bytes of [A-Za-z0-9_.:/-], each a finite number. Returns them
    as an ordered dict of floats; InvalidError naming the bad one."""
    out = {}
    for k, v in (metrics or {}).items():
        if not isinstance(k, str) or not _METRIC_NAME.fullmatch(k):
            raise InvalidError("save: metric name %r is not 1..63 bytes of [A-Za-z0-9_.:/-]" % (k,))
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or \
                not math.isfinite(float(v)):
            raise InvalidError("save: metric '%s': %r is not a finite number" % (k, v))
        out[k] = float(v)
    if len(out) > MAX_METRICS:
        raise InvalidError("save: %d metrics, at most %d" % (len(out), MAX_METRICS))
    return out


def write_checkpoint(dir, files, step, iteration, warn=None, metrics=None):
    """Publishes a checkpoint folder as ckpt_save_state does for an explicit
    folder: lock, leftover cleanup, a hidden temporary folder beside it,
    every file written and fsynced, the manifest last, folder fsyncs, then an
    atomic rename (an exchange if dir already holds a checkpoint).
    files: [(file name, kind, flat state dict)] in the C library's order."""
    metrics = check_metrics(metrics)
    dir = os.path.abspath(dir)
    parent, base = os.path.split(dir.rstrip("/"))
    if not base or base.startswith("."):
        raise InvalidError("save: %s: not a usable folder name" % dir)
    os.makedirs(parent, exist_ok=True)
    lockp = _lock_path(parent, base)
    lfd = open_lock(lockp)
    try:
        try:
            fcntl.flock(lfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = ""
            try:
                holder = os.pread(lfd, 32, 0).decode("ascii", "replace").strip()
            except OSError:
                pass
            raise BusyError("save: %s is locked by another process%s"
                            % (lockp, " (pid %s)" % holder if holder else "")) from None
        os.ftruncate(lfd, 0)
        os.pwrite(lfd, ("%d\n" % os.getpid()).encode(), 0)
        numbered = checkpoint_number(base) is not None
        for e in os.listdir(parent):
            mm = _LEFTOVER.fullmatch(e)
            if not mm:
                continue
            if (numbered and checkpoint_number(mm.group("base")) is not None) or mm.group("base") == base:
                if warn:
                    warn("removing %s left by an interrupted save" % os.path.join(parent, e))
                _remove_tree(os.path.join(parent, e))
        existed = os.path.lexists(dir)
        if existed:
            if not os.path.isdir(dir) or os.path.islink(dir):
                raise FileExistsError(errno.EEXIST, "save: %s exists and is not a folder" % dir)
            if os.listdir(dir) and not os.path.exists(os.path.join(dir, MANIFEST_NAME)):
                raise FileExistsError(errno.EEXIST, "save: %s exists, is not empty and holds no "
                                      "checkpoint; not replacing it" % dir)
        tmp = os.path.join(parent, ".%s.tmp.%d" % (base, os.getpid()))
        os.mkdir(tmp, 0o755)
        try:
            now = int(time.time())
            m = {"format_version": WRITE_FORMAT_VERSION, "library_version": LIBRARY_VERSION,
                 "iteration": int(iteration), "step": int(step), "process_index": 0,
                 "num_processes": 1, "created_unix": now,
                 "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
                 "metrics": metrics, "files": []}
            for name, kind, flat in files:
                data, digests = encode_state(flat, name)
                _write_file(os.path.join(tmp, name), data)
                hlen = 8 + int.from_bytes(data[:8], "little")
                m["files"].append({"name": name, "kind": kind, "size": len(data),
                                   "xxh3": _hex(xxh3_64(data)),
                                   "header_xxh3": _hex(xxh3_64(data[:hlen])),
                                   "tensors": {k: _hex(h) for k, h in digests}})
            _write_file(os.path.join(tmp, MANIFEST_NAME), manifest_text(m))
            _fsync_dir(tmp)
            if existed and os.listdir(dir):
                if _rename_exchange(tmp, dir):
                    _fsync_dir(parent)
                    _remove_tree(tmp)  # now the old checkpoint
                    tmp = None
                else:
                    old = os.path.join(parent, ".%s.old.%d" % (base, os.getpid()))
                    os.rename(dir, old)
                    os.rename(tmp, dir)
                    tmp = None
                    _fsync_dir(parent)
                    _remove_tree(old)
            else:
                os.rename(tmp, dir)
                tmp = None
                _fsync_dir(parent)
        finally:
            if tmp is not None and os.path.lexists(tmp):
                _remove_tree(tmp)
    finally:
        os.close(lfd)
    return m
