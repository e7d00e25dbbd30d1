"""The ckpt file formats in pure Python: safetensors state files with the
__metadata__["ckpt"] document (docs/FORMAT.md), the checkpoint.json manifest
with its self-checksum, folder verification and the atomic folder publish
(docs/CHECKPOINTS.md). Files are hostile input: every rule the C library
enforces is enforced here, and a violation raises an error naming the file,
tensor or key. numpy is the only dependency besides XXH3-64 (python3-xxhash)."""
import base64
import errno
import fcntl
import json
import math
import os
import re
import stat
import struct
import time

import numpy as np

try:
    import xxhash
except ImportError:  # pragma: no cover - reported when a checksum is needed
    xxhash = None

LIBRARY_VERSION = "0.1.0"
FORMAT_VERSION = 2  # the newest read; several processes write 2 (chunks of replicated tensors)
WRITE_FORMAT_VERSION = 1  # what one process writes
DOC_VERSION = 2  # the newest read; 2 (u64 and alias entries) is written only when used
DOC_VERSION_BASE = 1
UINT64_MAX = (1 << 64) - 1
MANIFEST_NAME = "checkpoint.json"
MANIFEST_MAX_BYTES = 16 << 20
ST_MAX_HEADER = 100_000_000
MAX_NDIM = 16
MAX_KEY = 1024
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
_SUM_KEY = "manifest_xxh3"
_SUM_PREFIX = b'"manifest_xxh3": "'


# ---- errors ---------------------------------------------------------------

def escape(text):
    """text with every C0/DEL/C1 control character written as \\xNN, so
    that a name taken from a hostile file cannot move the cursor, clear the
    screen or forge a line of output when a message is printed."""
    if not isinstance(text, str):
        return text
    out = []
    for ch in text:
        c = ord(ch)
        out.append("\\x%02x" % c if c < 0x20 or 0x7F <= c <= 0x9F else ch)
    return "".join(out)


class CkptError(ValueError):
    """Base of every error this module raises about a checkpoint or its
    arguments. A ValueError, so code written for the bare ValueError of
    earlier versions still catches it. Its message has control characters
    escaped (escape())."""

    def __init__(self, *args):
        super().__init__(*(escape(a) for a in args))


class CorruptError(CkptError):
    """A file breaks a rule of the format, differs from its checksum, or is
    not a regular file (CKPT_ECORRUPT in C)."""


class UnsupportedError(CkptError):
    """A newer format version or something the library cannot represent
    (CKPT_EUNSUPPORTED)."""


class MismatchError(CkptError):
    """The checkpoint does not fit the objects it is loaded into: another
    optimizer kind, other keys, dtypes, shapes or group counts
    (CKPT_EMISMATCH)."""


class InvalidError(CkptError):
    """A bad argument, or a path ckpt_torch would write through that is not
    what it must be (a symlink, a FIFO) (CKPT_EINVAL)."""


class NotFoundError(CkptError, FileNotFoundError):
    """No checkpoint where one was asked for (CKPT_ENOENT)."""

    def __init__(self, *args):
        FileNotFoundError.__init__(self, *(escape(a) for a in args))


class BusyError(CkptError):
    """Another process holds the save lock (CKPT_EBUSY)."""


class TooLargeError(CkptError, MemoryError):
    """A checkpoint whose files are the sizes the manifest says, valid as far
    as their headers go, but too large to hold in this process's memory
    (CKPT_ENOMEM). Never raised as a bare MemoryError."""


def xxh3_64(data):
    if xxhash is None:
        raise ImportError("ckpt_torch needs XXH3-64: install Debian's python3-xxhash")
    return xxhash.xxh3_64_intdigest(data)


def _hex(v):
    return "%016x" % v


# ---- dtypes -----------------------------------------------------------------

# dtype name -> (bits per element, numpy dtype or None when numpy has none)
DTYPES = {
    "BOOL": (8, np.dtype(np.bool_)), "U8": (8, np.dtype("<u1")), "I8": (8, np.dtype("<i1")),
    "F8_E5M2": (8, None), "F8_E4M3": (8, None), "F8_E8M0": (8, None),
    "F8_E4M3FNUZ": (8, None), "F8_E5M2FNUZ": (8, None),
    "I16": (16, np.dtype("<i2")), "U16": (16, np.dtype("<u2")), "F16": (16, np.dtype("<f2")),
    "BF16": (16, None),
    "I32": (32, np.dtype("<i4")), "U32": (32, np.dtype("<u4")), "F32": (32, np.dtype("<f4")),
    "F64": (64, np.dtype("<f8")), "I64": (64, np.dtype("<i8")), "U64": (64, np.dtype("<u8")),
    "C64": (64, np.dtype("<c8")),
    "F4": (4, None), "F6_E2M3": (6, None), "F6_E3M2": (6, None),
}
_NP_TO_DTYPE = {v[1]: k for k, v in DTYPES.items() if v[1] is not None}


def dtype_of_array(a):
    """The safetensors dtype of a numpy array (either byte order)."""
    dt = a.dtype
    if dt.byteorder == ">":
        dt = dt.newbyteorder("<")
    name = _NP_TO_DTYPE.get(dt)
    if name is None:
        raise UnsupportedError("numpy dtype %s has no safetensors dtype" % a.dtype)
    return name


def _nbytes(dtype, shape):
    """The bytes of a tensor as ckpt_tensor_nbytes computes them: a zero
    dimension makes it empty however large the others are; else the element
    count must fit in 64 bits and the byte count be whole and below 2^63.
    None when it is not."""
    bits = DTYPES[dtype][0]
    if any(d == 0 for d in shape):
        return 0
    n = 1
    for d in shape:
        n *= d
        if n >= 1 << 64:
            return None
    if (n // 8) * bits >= 1 << 64 or (n % 8) * bits % 8:
        return None
    total = (n // 8) * bits + (n % 8) * bits // 8
    return total if total < 1 << 63 else None


def shape_str(shape):
    """A shape as the C library prints it: [2,3]."""
    return "[" + ",".join(str(int(d)) for d in shape) + "]"


class U64(int):
    """An unsigned 64-bit entry (ckpt_write_u64): an int from 0 to 2**64 - 1
    that a state file keeps as a u64 (a plain int is an i64; one above
    2**63 - 1 is written as a u64 too). Readers return u64 entries as U64."""

    def __new__(cls, v):
        v = int(v)
        if not 0 <= v <= UINT64_MAX:
            raise InvalidError("U64: %d is outside 0..2**64 - 1" % v)
        return super().__new__(cls, v)

    def __repr__(self):
        return "U64(%d)" % int(self)


class RawTensor:
    """A tensor numpy cannot hold: a dtype it lacks (BF16, the F8/F6/F4
    kinds), or an empty shape whose other dimensions numpy's sizes overflow
    ([2**62, 4, 0]). Its dtype name, shape and little-endian bytes, kept as
    they are."""

    __slots__ = ("dtype", "shape", "data")

    def __init__(self, dtype, shape, data):
        if dtype not in DTYPES:
            raise InvalidError("RawTensor: unknown dtype %r" % (dtype,))
        shape = tuple(int(d) for d in shape)
        need = _nbytes(dtype, shape) if all(d >= 0 for d in shape) else None
        if need is None or len(data) != need:
            raise InvalidError("RawTensor: %s shape %s needs %s bytes, %d given"
                               % (dtype, shape_str(shape), need, len(data)))
        self.dtype, self.shape, self.data = dtype, shape, bytes(data)

    def __eq__(self, other):
        return (isinstance(other, RawTensor) and (self.dtype, self.shape, self.data) ==
                (other.dtype, other.shape, other.data))

    def __repr__(self):
        return "RawTensor(%s, %s, %d bytes)" % (self.dtype, list(self.shape), len(self.data))


# ---- keys and JSON ----------------------------------------------------------

def check_key(key, what):
    """The key rules of ckpt.h: 1..1024 bytes of UTF-8, no C0/DEL/C1 control
    character, not __metadata__."""
    if not isinstance(key, str):
        raise InvalidError("%s: key %r is not a string" % (what, key))
    try:
        b = key.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidError("%s: key is not valid UTF-8" % what) from None
    if not b:
        raise InvalidError("%s: key is empty" % what)
    if len(b) > MAX_KEY:
        raise InvalidError("%s: key '%s...' is %d bytes, longer than %d"
                           % (what, key[:40], len(b), MAX_KEY))
    for i, ch in enumerate(key):
        c = ord(ch)
        if c < 0x20 or 0x7F <= c <= 0x9F:
            raise InvalidError("%s: key %r contains a control character" % (what, key))
    if key == "__metadata__":
        raise InvalidError("%s: key '__metadata__' is reserved by the file format" % what)


def _key_ok(key):
    try:
        check_key(key, "")
        return True
    except InvalidError:
        return False


class _Dup(Exception):
    pass


def _pairs_no_dup(pairs):
    d = {}
    for k, v in pairs:
        if k in d:
            raise _Dup(k)
        d[k] = v
    return d


def _no_constant(name):
    raise ValueError("%s is not JSON" % name)


_decoder = json.JSONDecoder(object_pairs_hook=_pairs_no_dup, parse_constant=_no_constant)


def _loads_strict(text, allow_trailing=False):
    """JSON as jansson reads it with JSON_REJECT_DUPLICATES: no duplicate key
    at any level, no NaN/Infinity literals, integers within int64. Returns
    (value, end) when allow_trailing, else the value."""
    try:
        i = 0
        while i < len(text) and text[i] in " \t\r\n":
            i += 1
        v, end = _decoder.raw_decode(text, i)
    except _Dup as e:
        raise ValueError("duplicate object key '%s'" % e.args[0]) from None
    except (ValueError, RecursionError) as e:
        raise ValueError(str(e)) from None
    _check_ints(v)
    if allow_trailing:
        return v, end
    rest = text[end:]
    if rest.strip(" \t\r\n"):
        raise ValueError("end of file expected at position %d" % end)
    return v


def _check_ints(v):
    """What jansson refuses and Python's json accepts: integers beyond
    int64, infinite reals, NUL characters in strings."""
    stack = [v]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            if any("\0" in k for k in x):
                raise ValueError("\\u0000 is not allowed without JSON_ALLOW_NUL")
            stack.extend(x.values())
        elif isinstance(x, str):
            if "\0" in x:
                raise ValueError("\\u0000 is not allowed without JSON_ALLOW_NUL")
        elif isinstance(x, list):
            stack.extend(x)
        elif isinstance(x, int) and not isinstance(x, bool):
            if not INT64_MIN <= x <= INT64_MAX:
                raise ValueError("too big integer %d" % x)
        elif isinstance(x, float) and not math.isfinite(x):
            raise ValueError("real number overflow")


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


_ESC = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def jstr(s):
    """A JSON string exactly as jansson writes it (UTF-8 kept, control
    characters as \\u00XX in upper case)."""
    out = ['"']
    for ch in s:
        e = _ESC.get(ch)
        if e is not None:
            out.append(e)
        elif ord(ch) < 0x20:
            out.append("\\u%04X" % ord(ch))
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def jreal(x):
    """A double as jansson writes it with JSON_REAL_PRECISION(17): %.17g,
    '.0' added to integral values, no '+' and no leading zeros in the
    exponent. Every finite double survives bit for bit."""
    s = "%.17g" % x
    if "." not in s and "e" not in s:
        s += ".0"
    if "e" in s:
        mant, exp = s.split("e")
        sign = "-" if exp.startswith("-") else ""
        exp = exp.lstrip("+-").lstrip("0") or "0"
        s = mant + "e" + sign + exp
    return s


# ---- state files: reading ---------------------------------------------------

def _b64decode_strict(s, where):
    if len(s) % 4 or not re.fullmatch(r"[A-Za-z0-9+/]*={0,2}", s):
        raise CorruptError("%s: invalid base64" % where)
    try:
        raw = base64.b64decode(s, validate=True)
    except ValueError:
        raise CorruptError("%s: invalid base64" % where) from None
    if base64.b64encode(raw).decode("ascii") != s:
        raise CorruptError("%s: invalid base64 (unused bits are not zero)" % where)
    return raw


def _numpy_can_hold(shape, itemsize):
    """numpy refuses a shape whose non-zero dimensions times the element size
    pass its index type, even when another dimension is 0 and the array is
    empty; the C library accepts such a tensor ([2**62, 4, 0])."""
    n = itemsize
    for d in shape:
        if d:
            n *= d
    return n <= np.iinfo(np.intp).max


class StateFile:
    """A parsed, fully validated state file: its tensors (name -> dtype,
    shape, begin, end relative to the data buffer), its entries in document
    order and the file's bytes."""

    def __init__(self, name, data, size=None, layout_only=False):
        """data: the file's bytes; or, with size (the file's real size), only
        its first 8 + header-length bytes: then the header and the layout
        are checked against size and no tensor can be read. layout_only:
        the __metadata__ 'ckpt' document is not parsed."""
        self.name = name
        self.data = data
        self.size = len(data) if size is None else size
        self.tensors = {}   # name -> (dtype, shape, abs_begin, abs_end), file order
        self.entries = {}   # key -> (type, value), document order
        self.metadata = None
        self._parse(layout_only)

    def _parse(self, layout_only):
        name, data = self.name, self.data
        size = self.size
        if size < 8:
            raise CorruptError("%s: file is shorter than 8 bytes (%d bytes)" % (name, size))
        n = struct.unpack_from("<Q", data, 0)[0]
        if n > ST_MAX_HEADER:
            raise CorruptError("%s: header length %d exceeds the %d-byte limit" % (name, n, ST_MAX_HEADER))
        if 8 + n > size:
            raise CorruptError("%s: header extends past end of file (8 + %d bytes, file has %d)"
                               % (name, n, size))
        raw = bytes(data[8:8 + n])
        if n == 0 or raw[:1] != b"{":
            raise CorruptError("%s: header does not start with '{'" % name)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise CorruptError("%s: header is not valid JSON: invalid UTF-8 (at byte %d)"
                               % (name, e.start)) from None
        try:
            root, end = _loads_strict(text, allow_trailing=True)
        except ValueError as e:
            raise CorruptError("%s: header is not valid JSON: %s" % (name, e)) from None
        if not isinstance(root, dict):
            raise CorruptError("%s: header is not a JSON object" % name)
        tail = text[end:]
        for i, ch in enumerate(tail):
            if ch != " ":
                off = 8 + len(text[:end + i].encode("utf-8"))
                raise CorruptError("%s: header padding contains byte 0x%02x at offset %d "
                                   "(padding other than spaces)" % (name, ord(ch) & 0xFF, off))
        meta = root.get("__metadata__")
        if meta is not None or "__metadata__" in root:
            if not isinstance(meta, dict):
                raise CorruptError("%s: __metadata__ is not a JSON object" % name)
            for k, v in meta.items():
                if not isinstance(v, str):
                    raise CorruptError("%s: __metadata__ value for '%s' is not a string" % (name, k))
            self.metadata = meta
        items = []
        for key, v in root.items():
            if key == "__metadata__":
                continue
            items.append(self._parse_tensor(key, v))
        items.sort(key=lambda t: (t[3], t[4], t[0].encode("utf-8")))
        prev_end, prev_name = 0, None
        for key, dtype, shape, b, e in items:
            if b > prev_end:
                if prev_name is None:
                    raise CorruptError("%s: tensor '%s': data_offsets [%d, %d] leave a hole: the "
                                       "first tensor must begin at 0" % (name, key, b, e))
                raise CorruptError("%s: tensor '%s': data_offsets [%d, %d] leave a hole after the "
                                   "previous tensor '%s' (ends at %d)"
                                   % (name, key, b, e, prev_name, prev_end))
            if b < prev_end:
                raise CorruptError("%s: tensor '%s': data_offsets [%d, %d] overlap the previous "
                                   "tensor (ends at %d)" % (name, key, b, e, prev_end))
            prev_end, prev_name = e, key
        expect = 8 + n + prev_end
        if expect < size:
            raise CorruptError("%s: trailing bytes: file has %d bytes, tensors end at %d"
                               % (name, size, expect))
        if expect > size:
            raise CorruptError("%s: tensor data extends past end of file: tensors end at %d, "
                               "file has %d bytes" % (name, expect, size))
        for key, dtype, shape, b, e in items:
            self.tensors[key] = (dtype, shape, 8 + n + b, 8 + n + e)
        if self.metadata is not None and "ckpt" in self.metadata and not layout_only:
            self._parse_doc(self.metadata["ckpt"])

    def _parse_tensor(self, key, v):
        name = self.name
        if not isinstance(v, dict):
            raise CorruptError("%s: tensor '%s': entry is not a JSON object" % (name, key))
        for f in ("dtype", "shape", "data_offsets"):
            if f not in v:
                raise CorruptError("%s: tensor '%s': missing %s" % (name, key, f))
        for f in v:
            if f not in ("dtype", "shape", "data_offsets"):
                raise CorruptError("%s: tensor '%s': unknown field '%s'" % (name, key, f))
        dt = v["dtype"]
        if not isinstance(dt, str):
            raise CorruptError("%s: tensor '%s': dtype is not a string" % (name, key))
        if dt not in DTYPES:
            raise CorruptError("%s: tensor '%s': unknown dtype '%s'" % (name, key, dt))
        shape = v["shape"]
        if not isinstance(shape, list):
            raise CorruptError("%s: tensor '%s': shape is not an array" % (name, key))
        if len(shape) > MAX_NDIM:
            raise CorruptError("%s: tensor '%s': %d dimensions, at most %d supported"
                               % (name, key, len(shape), MAX_NDIM))
        for i, d in enumerate(shape):
            if not _is_int(d) or d < 0:
                raise CorruptError("%s: tensor '%s': shape dimension %d is not a non-negative integer"
                                   % (name, key, i))
        offs = v["data_offsets"]
        if not isinstance(offs, list) or len(offs) != 2:
            raise CorruptError("%s: tensor '%s': data_offsets is not a [BEGIN, END] pair" % (name, key))
        b, e = offs
        if not (_is_int(b) and _is_int(e) and b >= 0 and e >= 0):
            raise CorruptError("%s: tensor '%s': data_offsets are not non-negative integers" % (name, key))
        if e < b:
            raise CorruptError("%s: tensor '%s': data_offsets [%d, %d]: END < BEGIN" % (name, key, b, e))
        need = _nbytes(dt, shape)
        if need is None:
            if DTYPES[dt][0] % 8:
                raise CorruptError("%s: tensor '%s': %s shape %s: elements x %d bits is not a "
                                   "whole number of bytes (or overflows)"
                                   % (name, key, dt, shape_str(shape), DTYPES[dt][0]))
            raise CorruptError("%s: tensor '%s': shape %s x element size overflows"
                               % (name, key, shape_str(shape)))
        if e - b != need:
            raise CorruptError("%s: tensor '%s': data_offsets [%d, %d] hold %d bytes, %s shape %s "
                               "needs %d" % (name, key, b, e, e - b, dt, shape_str(shape), need))
        return (key, dt, tuple(shape), b, e)

    def _doc_err(self, msg):
        return CorruptError("%s: __metadata__ 'ckpt': %s" % (self.name, msg))

    def _parse_doc(self, text):
        if "\0" in text:
            raise CorruptError("%s: __metadata__ 'ckpt' is not valid JSON: NUL character" % self.name)
        try:
            doc = _loads_strict(text)
        except ValueError as e:
            raise CorruptError("%s: __metadata__ 'ckpt' is not valid JSON: %s" % (self.name, e)) from None
        if not isinstance(doc, dict):
            raise self._doc_err("not a JSON object")
        for f in doc:
            if f not in ("version", "entries"):
                raise self._doc_err("unknown field '%s'" % f)
        ver = doc.get("version")
        if not _is_int(ver):
            raise self._doc_err("version is missing or not an integer")
        if ver > DOC_VERSION:
            raise UnsupportedError("%s: __metadata__ 'ckpt': version %d is newer than this library "
                                   "supports (%d)" % (self.name, ver, DOC_VERSION))
        if ver < 1:
            raise self._doc_err("version is not a positive integer")
        arr = doc.get("entries")
        if not isinstance(arr, list):
            raise self._doc_err("entries is missing or not an array")
        for idx, o in enumerate(arr):
            if not isinstance(o, dict):
                raise self._doc_err("entries[%d] is not an object" % idx)
            for f in o:
                if f not in ("key", "type", "value"):
                    raise self._doc_err("entries[%d]: unknown field '%s'" % (idx, f))
            key, typ = o.get("key"), o.get("type")
            if not isinstance(key, str):
                raise self._doc_err("entries[%d]: key is missing or not a string" % idx)
            if not isinstance(typ, str):
                raise self._doc_err("entries[%d]: type is missing or not a string" % idx)
            if "value" not in o:
                raise self._doc_err("entries[%d]: value is missing" % idx)
            if "\0" in key or not _key_ok(key):
                raise self._doc_err("entries[%d]: invalid key '%s'" % (idx, key))
            v = o["value"]
            if typ == "i64":
                if not _is_int(v):
                    raise self._doc_err("entry '%s': i64 value is not an integer" % key)
                val = int(v)
            elif typ == "u64":
                if not (isinstance(v, str) and 1 <= len(v) <= 20 and v.isascii() and v.isdigit()
                        and (len(v) == 1 or v[0] != "0") and int(v) <= UINT64_MAX):
                    raise self._doc_err("entry '%s': u64 value is not a string of decimal digits "
                                        "below 2^64 (no sign, no leading zero)" % key)
                val = U64(int(v))
            elif typ == "alias":
                if not isinstance(v, str) or "\0" in v or not _key_ok(v):
                    raise self._doc_err("entry '%s': alias value is not a valid tensor name" % key)
                if v == key:
                    raise self._doc_err("entry '%s': an alias of itself" % key)
                val = v
            elif typ == "f64":
                if isinstance(v, float):
                    val = v
                elif _is_int(v):
                    val = float(v)
                elif isinstance(v, str):
                    if v not in ("nan", "inf", "-inf"):
                        raise self._doc_err("entry '%s': f64 value '%s' is not a number, \"nan\", "
                                            "\"inf\" or \"-inf\"" % (key, v))
                    val = float(v)
                else:
                    raise self._doc_err("entry '%s': f64 value is not a number" % key)
            elif typ == "str":
                if not isinstance(v, str):
                    raise self._doc_err("entry '%s': str value is not a string" % key)
                if "\0" in v:
                    raise self._doc_err("entry '%s': str value contains a NUL character" % key)
                val = v
            elif typ == "bytes":
                if not isinstance(v, str):
                    raise self._doc_err("entry '%s': bytes value is not a string" % key)
                val = _b64decode_strict(v, "%s: __metadata__ 'ckpt': entry '%s'" % (self.name, key))
            else:
                raise self._doc_err("entry '%s': unknown type '%s'" % (key, typ))
            if key in self.tensors or key in self.entries:
                other = "tensor" if key in self.tensors else self.entries[key][0]
                raise CorruptError("%s: duplicate key '%s' (%s and %s)" % (self.name, key, other, typ))
            self.entries[key] = (typ, val)
        for key, (typ, val) in self.entries.items():
            if typ == "alias" and val in self.entries:
                raise self._doc_err("entry '%s': an alias of '%s', which is not a tensor"
                                    % (key, val))

    def tensor_bytes(self, key):
        dtype, shape, b, e = self.tensors[key]
        return memoryview(self.data)[b:e]

    def array(self, key):
        """A tensor as a numpy array (a copy), or a RawTensor for dtypes
        numpy lacks."""
        dtype, shape, b, e = self.tensors[key]
        npdt = DTYPES[dtype][1]
        if npdt is None or not _numpy_can_hold(shape, npdt.itemsize):
            return RawTensor(dtype, shape, self.data[b:e])
        return np.frombuffer(self.data, dtype=npdt, count=(e - b) // npdt.itemsize,
                             offset=b).reshape(shape).copy()

    def aliases(self):
        """{alias: target} of the file's tied names (alias entries)."""
        return {k: v for k, (t, v) in self.entries.items() if t == "alias"}

    def flat(self, aliases=None):
        """Every entry: tensors (numpy arrays or RawTensor) in file order,
        then scalars in document order (int, U64, float, str, bytes); an
        alias (a tied name) is the very array of its target. With a dict
        `aliases`, the aliases go there ({alias: target}) instead, for a
        caller whose object has tensors in other files too."""
        out = {k: self.array(k) for k in self.tensors}
        for k, (t, v) in self.entries.items():
            out[k] = None if t == "alias" else v  # an alias keeps its place in the order
        if aliases is not None:
            aliases.update(self.aliases())
        else:
            resolve_aliases(out, self.aliases(), self.name)
        return out


def resolve_aliases(flat, aliases, what):
    """Each alias of flat (a tied name) becomes the very array of its target."""
    for k, v in aliases.items():
        if not isinstance(flat.get(v), (np.ndarray, RawTensor)):
            raise CorruptError("%s: '%s' is an alias of '%s', which the file does not hold"
                               % (what, k, v))
        flat[k] = flat[v]


# ---- reading files: regular files only, never blocking, sizes first ---------

_PIECE = 8 << 20
_MODE_NAMES = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"),
               (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
               (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link"))


def _kind_of(mode):
    for test, what in _MODE_NAMES:
        if test(mode):
            return what
    return "not a regular file"


def open_regular(path, what=None):
    """(fd, size) of the regular file at path, open for reading. Never
    blocks: the kind is checked with stat before the open (a FIFO is never
    opened), the open is O_NONBLOCK (a FIFO swapped in meanwhile cannot block
    it either) and fstat checks again. CorruptError naming what it found for
    anything but a regular file; FileNotFoundError passes through."""
    what = what or path
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise CorruptError("%s: not a regular file (%s)" % (what, _kind_of(st.st_mode)))
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CorruptError("%s: not a regular file (%s)" % (what, _kind_of(st.st_mode)))
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def _alloc(n, what):
    """n writable bytes, not zero-filled (every one is read into)."""
    try:
        return np.empty(n, dtype=np.uint8)
    except (MemoryError, OverflowError, ValueError):
        raise TooLargeError("%s: %d bytes do not fit in this process's memory"
                            % (what, n)) from None


def _pread_into(fd, view, off, size, what):
    """Fills view from offset off; CorruptError if the file ends first."""
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], off + got)
        if n == 0:
            raise CorruptError("%s: ends at byte %d, the manifest says %d"
                               % (what, off + got, size))
        got += n


def _read_fd(fd, size, what, hasher=None, keep=True):
    """The file's size bytes read in pieces (and hashed on the way):
    bytearray if keep, else None. The memory is taken only once the size
    was checked by the caller; a size it cannot hold is TooLargeError."""
    buf = _alloc(size, what) if keep else None
    scratch = None if keep else bytearray(min(size, _PIECE))
    off = 0
    while off < size:
        want = min(_PIECE, size - off)
        view = memoryview(buf)[off:off + want] if keep else memoryview(scratch)[:want]
        _pread_into(fd, view, off, size, what)
        if hasher is not None:
            hasher.update(view)
        off += want
    return buf


def _read_head(fd, size, name):
    """The first 8 + n bytes of a safetensors file (n its header length,
    bounded by the format's limit and the file's size): enough to check its
    header and layout against the real size before the rest is read."""
    if size < 8:
        return b""
    pre = bytearray(8)
    _pread_into(fd, memoryview(pre), 0, size, name)
    n = struct.unpack_from("<Q", pre, 0)[0]
    if n > ST_MAX_HEADER or 8 + n > size:
        return bytes(pre)  # the parse refuses it from the length alone
    head = bytearray(8 + n)
    head[:8] = pre
    _pread_into(fd, memoryview(head)[8:], 8, size, name)
    return bytes(head)


def read_state_file(path, name=None):
    """One state file, every rule checked: its header and layout against
    its real size first, then its bytes (never more than the layout
    accounts for)."""
    name = name or path
    fd, size = open_regular(path, name)
    try:
        StateFile(name, _read_head(fd, size, name), size=size, layout_only=True)
        data = _read_fd(fd, size, name)
    finally:
        os.close(fd)
    return StateFile(name, data)


def _read_small(path, limit, what):
    """A small file (a manifest, an index) whole, refused above limit bytes
    before any is read (C: ckpt__read_small_file)."""
    fd, size = open_regular(path, what)
    try:
        if size > limit:
            raise CorruptError("%s: %d bytes, more than the %d-byte limit" % (what, size, limit))
        return bytes(_read_fd(fd, size, what))
    finally:
        os.close(fd)


# ---- state files: writing ---------------------------------------------------

def _entry_of(key, v):
    """(kind, payload) for one value of a flat state dict."""
    if isinstance(v, RawTensor):
        return "tensor", (v.dtype, v.shape, v.data)
    if isinstance(v, np.ndarray):
        dt = dtype_of_array(v)
        a = v.astype(DTYPES[dt][1], order="C", copy=False)  # keeps 0-d arrays 0-d
        if a.ndim > MAX_NDIM:
            raise InvalidError("state dict: tensor '%s' has %d dimensions, at most %d"
                               % (key, a.ndim, MAX_NDIM))
        return "tensor", (dt, tuple(int(d) for d in a.shape), a.tobytes())
    if isinstance(v, (bool, np.bool_)):
        return "i64", int(v)
    if isinstance(v, (U64, np.uint64)):
        return "u64", int(v)
    if isinstance(v, (int, np.integer)):
        iv = int(v)
        if INT64_MAX < iv <= UINT64_MAX:
            return "u64", iv
        if not INT64_MIN <= iv <= INT64_MAX:
            raise InvalidError("state dict: '%s': %d does not fit in 64 bits" % (key, iv))
        return "i64", iv
    if isinstance(v, (float, np.floating)):
        return "f64", float(v)
    if isinstance(v, str):
        if "\0" in v:
            raise InvalidError("state dict: string '%s' contains a NUL character" % key)
        return "str", v
    if isinstance(v, (bytes, bytearray, memoryview)):
        return "bytes", bytes(v)
    raise TypeError("state dict: '%s': cannot store a %s" % (key, type(v).__name__))


def _align(dtype):
    bits = DTYPES[dtype][0]
    return bits // 8 if bits >= 8 else 1


def encode_state(flat, what="state dict"):
    """The bytes of one state file for a flat state dict (key -> numpy
    array / RawTensor / int / float / str / bytes), laid out exactly as the C
    writer lays it out. Returns (bytes, [(tensor name, xxh3)] in file order)."""
    tensors, doc, seen = [], [], {}
    for key, v in flat.items():
        check_key(key, what)
        if isinstance(v, (np.ndarray, RawTensor)) and id(v) in seen:
            # the very array of an earlier key: a tied name, saved once
            doc.append((key, "alias", seen[id(v)]))
            continue
        kind, payload = _entry_of(key, v)
        if kind == "tensor":
            tensors.append((key, payload))
            seen[id(v)] = key
        else:
            doc.append((key, kind, payload))
    tensors.sort(key=lambda t: (-_align(t[1][0]), t[0].encode("utf-8")))
    parts = []
    for key, kind, val in doc:
        if kind == "i64":
            vs = str(val)
        elif kind in ("u64", "alias"):
            vs = jstr(str(val))
        elif kind == "f64":
            if math.isnan(val):
                vs = '"nan"'
            elif math.isinf(val):
                vs = '"inf"' if val > 0 else '"-inf"'
            else:
                vs = jreal(val)
        elif kind == "str":
            vs = jstr(val)
        else:
            vs = jstr(base64.b64encode(val).decode("ascii"))
        parts.append('{"key":%s,"type":"%s","value":%s}' % (jstr(key), kind, vs))
    version = DOC_VERSION if any(k in ("u64", "alias") for _, k, _ in doc) else DOC_VERSION_BASE
    doc_text = '{"version":%d,"entries":[%s]}' % (version, ",".join(parts))
    # Hugging Face's record of each tied name left out (safetensors.torch's
    # save_model): __metadata__[alias] = the name kept
    hf = "".join(",%s:%s" % (jstr(k), jstr(v)) for k, kind, v in doc
                 if kind == "alias" and k not in ("format", "ckpt"))
    hdr = ['{"__metadata__":{"format":"pt","ckpt":%s%s}' % (jstr(doc_text), hf)]
    off = 0
    for key, (dt, shape, data) in tensors:
        hdr.append(',%s:{"dtype":"%s","shape":[%s],"data_offsets":[%d,%d]}'
                   % (jstr(key), dt, ",".join(str(d) for d in shape), off, off + len(data)))
        off += len(data)
    hdr.append("}")
    htext = "".join(hdr).encode("utf-8")
    padded = (8 + len(htext) + 7) // 8 * 8 - 8
    out = [struct.pack("<Q", padded), htext, b" " * (padded - len(htext))]
    digests = []
    for key, (dt, shape, data) in tensors:
        out.append(data)
        digests.append((key, xxh3_64(data)))
    return b"".join(out), digests


# ---- the manifest -----------------------------------------------------------

MAX_METRICS = 16
_METRIC_NAME = re.compile(r"[A-Za-z0-9_.:/-]{1,63}")


def _jreal(v):
    """A double as jansson writes it: %.17g, ".0" added when it reads as an
    integer, no '+' and no leading zeros in the exponent."""
    t = "%.17g" % v
    if "." not in t and "e" not in t:
        t += ".0"
    if "e" in t:
        mant, exp = t.split("e")
        sign = "-" if exp.startswith("-") else ""
        t = mant + "e" + sign + exp.lstrip("+-").lstrip("0")
    return t


def manifest_text(m):
    """checkpoint.json exactly as the C library writes it (docs/FORMAT.md:
    the top level's members one a line, each file's scalar members on one
    line, then each tensor digest on a line of its own), its manifest_xxh3
    filled in."""
    L = ["{"]
    top = [("format", jstr("ckpt")), ("format_version", str(m["format_version"])),
           ("library_version", jstr(m["library_version"])), ("iteration", str(m["iteration"])),
           ("step", str(m["step"])), ("process_index", str(m["process_index"])),
           ("num_processes", str(m["num_processes"])), ("created_unix", str(m["created_unix"])),
           ("created", jstr(m["created"]))]
    for k, v in top:
        L.append('  "%s": %s,' % (k, v))
    metrics = list(m.get("metrics", {}).items())
    if metrics:
        L.append('  "metrics": {')
        for j, (k, v) in enumerate(metrics):
            L.append('    %s: %s%s' % (jstr(k), _jreal(v), "," if j + 1 < len(metrics) else ""))
        L.append("  },")
    if not m["files"]:
        L.append('  "files": [],')
    else:
        L.append('  "files": [')
        for i, f in enumerate(m["files"]):
            head = '    {"name": %s, "kind": %s, "size": %d, "xxh3": "%s"' % (
                jstr(f["name"]), jstr(f["kind"]), f["size"], f["xxh3"])
            if f.get("xxh128"):
                head += ', "xxh128": "%s"' % f["xxh128"]
            if f.get("header_xxh3"):
                head += ', "header_xxh3": "%s"' % f["header_xxh3"]
            ts = ",".join('\n      %s: "%s"' % (jstr(k), h) for k, h in f["tensors"].items())
            L.append(head + ',\n     "tensors": {' + ts + "}}" +
                     ("," if i + 1 < len(m["files"]) else ""))
        L.append("  ],")
    L.append('  "%s": "%s"' % (_SUM_KEY, "0" * 16))
    L.append("}")
    text = ("\n".join(L) + "\n").encode("utf-8")
    pos = _find_sum_digits(text)
    assert pos is not None
    digest = _hex(xxh3_64(text)).encode("ascii")
    return text[:pos] + digest + text[pos + 16:]


def _find_sum_digits(text):
    """Where the 16 digits of manifest_xxh3 are: the one occurrence of the
    member's bytes followed by 16 characters and a quote, else None."""
    found, start = None, 0
    plen = len(_SUM_PREFIX)
    while True:
        q = text.find(_SUM_PREFIX, start)
        if q < 0 or q + plen + 17 > len(text):
            break
        if found is not None:
            return None
        found = q + plen
        start = q + 1
    if found is not None and text[found + 16:found + 17] != b'"':
        return None
    return found


def _plain_name(s):
    b = s.encode("utf-8")
    if not b or len(b) > 255 or s[0] == "." or ".." in s:
        return False
    if any(c in "/\\" or ord(c) < 0x20 or ord(c) == 0x7F for c in s):
        return False
    return s != MANIFEST_NAME


def _m_int(root, key, required, lo, hi, what):
    if key not in root:
        if not required:
            return None
        raise CorruptError('%s: "%s" is missing' % (what, key))
    v = root[key]
    if not _is_int(v):
        raise CorruptError('%s: "%s" must be an integer' % (what, key))
    if v < lo or v > hi:
        raise CorruptError('%s: "%s" is %d, expected %d..%d' % (what, key, v, lo, hi))
    return v


def _m_str(root, key, required, what):
    if key not in root:
        if not required:
            return None
        raise CorruptError('%s: "%s" is missing' % (what, key))
    v = root[key]
    if not isinstance(v, str):
        raise CorruptError('%s: "%s" must be a string' % (what, key))
    if "\0" in v:
        raise CorruptError('%s: "%s" contains a NUL character' % (what, key))
    return v


_HEX16 = re.compile(r"[0-9a-f]{16}")
_HEX32 = re.compile(r"[0-9a-f]{32}")


def _m_chunks(jf, tensors, where):
    """A shard file's "chunks": for each of its tensors, where the chunk sits
    in the whole tensor ({"dtype", "global_shape", "offsets", "shape"});
    None for other files."""
    jc = jf.get("chunks")
    if jc is None:
        return None
    if not isinstance(jc, dict) or set(jc) != set(tensors):
        raise CorruptError('%s: "chunks" must name exactly the file\'s tensors' % where)
    out = {}
    for k, c in jc.items():
        if not isinstance(c, dict) or c.get("dtype") not in DTYPES:
            raise CorruptError("%s: chunk of '%s': bad record" % (where, k[:128]))
        dims = [c.get(f) for f in ("global_shape", "offsets", "shape")]
        if not all(isinstance(d, list) and all(_is_int(x) and 0 <= x < 2**62 for x in d)
                   for d in dims) or not len(dims[0]) == len(dims[1]) == len(dims[2]) <= MAX_NDIM:
            raise CorruptError("%s: chunk of '%s': bad shapes" % (where, k[:128]))
        if any(o + n > g for g, o, n in zip(*dims)):
            raise CorruptError("%s: chunk of '%s': outside the tensor" % (where, k[:128]))
        out[k] = {"dtype": c["dtype"], "global_shape": tuple(dims[0]), "offsets": tuple(dims[1]),
                  "shape": tuple(dims[2])}
    return out


def parse_manifest(text, what):
    """Parses and checks checkpoint.json bytes as the C library does:
    structure, format version, then the self-checksum. Returns a dict."""
    if len(text) > MANIFEST_MAX_BYTES:
        raise CorruptError("%s: %d bytes, more than the %d a manifest may have"
                           % (what, len(text), MANIFEST_MAX_BYTES))
    try:
        root = _loads_strict(text.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise CorruptError("%s: invalid JSON: %s" % (what, e)) from None
    if not isinstance(root, dict):
        raise CorruptError("%s: not a JSON object" % what)
    fmt = _m_str(root, "format", True, what)
    if fmt != "ckpt":
        raise CorruptError('%s: "format" is "%s", expected "ckpt"' % (what, fmt[:32]))
    ver = _m_int(root, "format_version", True, 1, 2**31 - 1, what)
    if ver > FORMAT_VERSION:
        raise UnsupportedError("%s: checkpoint format version %d is newer than this library's "
                               "(%d); upgrade ckpt" % (what, ver, FORMAT_VERSION))
    m = {"format_version": ver}
    m["library_version"] = _m_str(root, "library_version", True, what)
    m["iteration"] = _m_int(root, "iteration", True, 0, INT64_MAX, what)
    m["step"] = _m_int(root, "step", True, INT64_MIN, INT64_MAX, what)
    m["num_processes"] = _m_int(root, "num_processes", True, 1, 1 << 24, what)
    pi = _m_int(root, "process_index", False, 0, m["num_processes"] - 1, what)
    m["process_index"] = 0 if pi is None else pi
    m["created_unix"] = _m_int(root, "created_unix", False, INT64_MIN, INT64_MAX, what) or 0
    m["created"] = _m_str(root, "created", False, what) or ""
    jm = root.get("metrics")
    if "metrics" in root and not isinstance(jm, dict):
        raise CorruptError('%s: "metrics" must be an object' % what)
    if jm is not None and len(jm) > MAX_METRICS:
        raise CorruptError('%s: "metrics" has %d entries, expected at most %d'
                           % (what, len(jm), MAX_METRICS))
    m["metrics"] = {}
    for k, v in (jm or {}).items():
        if not _METRIC_NAME.fullmatch(k):
            raise CorruptError("%s: metric name '%s' is not 1..63 bytes of [A-Za-z0-9_.:/-]"
                               % (what, k[:64]))
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise CorruptError("%s: metric '%s' must be a finite number" % (what, k))
        m["metrics"][k] = float(v)
    files = root.get("files")
    if not isinstance(files, list):
        raise CorruptError('%s: "files" must be an array' % what)
    m["files"] = []
    for i, jf in enumerate(files):
        where = "%s: files[%d]" % (what, i)
        if not isinstance(jf, dict):
            raise CorruptError("%s: must be an object" % where)
        name = _m_str(jf, "name", True, where)
        if not _plain_name(name):
            raise CorruptError('%s: name "%s" is not a plain file name' % (where, name[:64]))
        where = "%s: %s" % (what, name)
        kind = _m_str(jf, "kind", True, where)
        if not 1 <= len(kind.encode("utf-8")) <= 64:
            raise CorruptError('%s: "kind" must be 1..64 characters' % where)
        size = _m_int(jf, "size", True, 0, INT64_MAX, where)
        hx = _m_str(jf, "xxh3", True, where)
        if not _HEX16.fullmatch(hx):
            raise CorruptError('%s: "xxh3" must be 16 lowercase hex digits' % where)
        # the XXH3-128 an incremental save compares with (optional; kept so a
        # manifest written back is the same)
        wide = _m_str(jf, "xxh128", False, where)
        if wide is not None and not _HEX32.fullmatch(wide):
            raise CorruptError('%s: "xxh128" must be 32 lowercase hex digits' % where)
        # the XXH3-64 of the file's first 8 + header-length bytes (optional:
        # with the tensors' digests it covers the file, for one-pass loads)
        hhx = _m_str(jf, "header_xxh3", False, where)
        if hhx is not None and not _HEX16.fullmatch(hhx):
            raise CorruptError('%s: "header_xxh3" must be 16 lowercase hex digits' % where)
        jt = jf.get("tensors")
        if "tensors" in jf and not isinstance(jt, dict):
            raise CorruptError('%s: "tensors" must be an object' % where)
        tensors = {}
        for k, v in (jt or {}).items():
            if not k or len(k.encode("utf-8")) > MAX_KEY:
                raise CorruptError("%s: a tensor key is empty or too long" % where)
            if not isinstance(v, str) or not _HEX16.fullmatch(v):
                raise CorruptError("%s: tensor '%s': digest must be 16 lowercase hex digits"
                                   % (where, k[:128]))
            tensors[k] = v
        chunks = _m_chunks(jf, tensors, where)
        m["files"].append({"name": name, "kind": kind, "size": size, "xxh3": hx, "tensors": tensors,
                           "chunks": chunks, "xxh128": wide, "header_xxh3": hhx})
    seen = set()
    for f in sorted(m["files"], key=lambda f: f["name"].encode("utf-8")):
        if f["name"] in seen:
            raise CorruptError('%s: file "%s" is listed twice' % (what, f["name"]))
        seen.add(f["name"])
    # the self-checksum, after the structure and the version
    want = root.get(_SUM_KEY)
    if want is None and _SUM_KEY not in root:
        raise CorruptError('%s: "%s" is missing' % (what, _SUM_KEY))
    if not isinstance(want, str) or not _HEX16.fullmatch(want):
        raise CorruptError('%s: "%s" must be 16 hex digits' % (what, _SUM_KEY))
    pos = _find_sum_digits(text)
    if pos is None or text[pos:pos + 16] != want.encode("ascii"):
        raise CorruptError('%s: "%s" must appear exactly once, as written' % (what, _SUM_KEY))
    got = _hex(xxh3_64(text[:pos] + b"0" * 16 + text[pos + 16:]))
    if got != want:
        raise CorruptError("%s: checksum mismatch: the manifest was changed after it was written "
                           "(%s in the file, %s computed)" % (what, want, got))
    return m


def read_manifest(dir):
    if not os.path.exists(dir):
        raise NotFoundError(errno.ENOENT, "%s: No such file or directory" % dir)
    if not os.path.isdir(dir):
        raise InvalidError("%s: not a folder" % dir)
    path = os.path.join(dir, MANIFEST_NAME)
    if not os.path.exists(path) and not os.path.islink(path):
        # As the C library says it: a folder without a manifest is not a
        # checkpoint (an interrupted save leaves a hidden temporary folder,
        # never a visible one without its manifest).
        raise NotFoundError(errno.ENOENT, "%s: not a checkpoint (no %s)" % (dir, MANIFEST_NAME))
    try:
        text = _read_small(path, MANIFEST_MAX_BYTES, path)
    except FileNotFoundError:  # a link to nothing, or removed meanwhile
        raise CorruptError("%s: not a regular file (a link to nothing)" % path) from None
    return parse_manifest(text, path)


def _state_file(f):
    """Whether a listed file is a state file (parsed and kept by a load):
    not a save pre-hook's file, named .safetensors."""
    return f["kind"] != "extra" and f["name"].endswith(".safetensors")


def _name_mismatch(dir, f, fd, size):
    """The file's digest differs: say which tensor if the file still parses
    (its tensors hashed one by one from the file)."""
    if f["kind"] == "extra":
        raise CorruptError("%s: %s: checksum mismatch (a file a save pre-hook added)"
                           % (dir, f["name"]))
    try:
        sf = StateFile(f["name"], _read_head(fd, size, f["name"]), size=size, layout_only=True)
    except CkptError as e:
        raise CorruptError("%s: %s: checksum mismatch and the file does not parse: %s"
                           % (dir, f["name"], e)) from None
    for k, h in f["tensors"].items():
        if k not in sf.tensors:
            raise CorruptError("%s: %s: tensor '%s': missing (checksum mismatch)" % (dir, f["name"], k))
        _dt, _shape, b, e = sf.tensors[k]
        hasher = xxhash.xxh3_64()
        off = b
        while off < e:
            want = min(_PIECE, e - off)
            piece = bytearray(want)
            _pread_into(fd, memoryview(piece), off, size, "%s: %s" % (dir, f["name"]))
            hasher.update(piece)
            off += want
        if _hex(hasher.intdigest()) != h:
            raise CorruptError("%s: %s: tensor '%s': checksum mismatch" % (dir, f["name"], k))
    raise CorruptError("%s: %s: checksum mismatch in the header or metadata (tensor data intact)"
                       % (dir, f["name"]))


def verify_folder(dir, keep_data=False):
    """Checks a checkpoint folder as ckpt_load_state does before loading:
    the manifest; every listed file a regular file of the listed size (all
    of them stat'ed, and their sizes summed, before any byte is read); each
    state file's header and layout against that size; every file's XXH3-64
    (naming the tensor that changed when the file still parses); no unlisted
    .safetensors file. Files are read in pieces, hashed as they are read;
    with keep_data the state files' (and Hugging Face indexes') bytes are
    kept: exactly the bytes that were hashed. Returns (manifest, {name:
    bytes} if keep_data)."""
    m = read_manifest(dir)
    total = 0
    for f in m["files"]:
        path = os.path.join(dir, f["name"])
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise CorruptError("%s: %s is listed in the manifest but missing" % (dir, f["name"])) from None
        if not stat.S_ISREG(st.st_mode):
            raise CorruptError("%s: %s is not a regular file (%s)"
                               % (dir, f["name"], _kind_of(st.st_mode)))
        if st.st_size != f["size"]:
            raise CorruptError("%s: %s: size %d bytes, the manifest says %d%s"
                               % (dir, f["name"], st.st_size, f["size"],
                                  " (truncated)" if st.st_size < f["size"] else ""))
        total += f["size"]
        if total > INT64_MAX:
            raise CorruptError("%s: the listed files add up to more than 2^63-1 bytes (%s is "
                               "%d bytes)" % (dir, f["name"], f["size"]))
    datas = {}
    for f in m["files"]:
        name = f["name"]
        what = "%s: %s" % (dir, name)
        try:
            fd, size = open_regular(os.path.join(dir, name), what)
        except FileNotFoundError:
            raise CorruptError("%s: %s is listed in the manifest but missing"
                               % (dir, name)) from None
        try:
            if size != f["size"]:
                raise CorruptError("%s: size %d bytes, the manifest says %d"
                                   % (what, size, f["size"]))
            if _state_file(f):
                try:
                    StateFile(name, _read_head(fd, size, name), size=size, layout_only=True)
                except CkptError as e:
                    raise CorruptError("%s: %s: checksum mismatch and the file does not parse: %s"
                                       % (dir, name, e)) from None
            keep = keep_data and (_state_file(f) or name.endswith(".safetensors.index.json"))
            hasher = xxhash.xxh3_64() if xxhash is not None else xxh3_64(b"")
            data = _read_fd(fd, size, what, hasher, keep)
            if _hex(hasher.intdigest()) != f["xxh3"]:
                _name_mismatch(dir, f, fd, size)
        finally:
            os.close(fd)
        if keep:
            datas[name] = data
    listed = {f["name"] for f in m["files"]}
    for e in sorted(os.listdir(dir)):
        if e.endswith(".safetensors") and not e.startswith(".") and e not in listed:
            raise CorruptError("%s: %s is not listed in the manifest" % (dir, e))
    return m, datas


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
