"""The ckpt file format in pure Python: safetensors state files with the
__metadata__["ckpt"] document (docs/FORMAT.md), read and written, and the
rules every reader shares (errors, dtypes, keys, strict JSON, regular files
read sizes first). The manifest and folder verification are in _verify.py,
checkpoint folders (numbering, lock, publish) in _folder.py. Files are
hostile input: every rule the C library enforces is enforced here, and a
violation raises an error naming the file, tensor or key. numpy is the only
dependency besides XXH3-64 (python3-xxhash)."""
import base64
import errno
import json
import math
import os
import re
import stat
import struct

import numpy as np

try:
    import xxhash
except ImportError:  # pragma: no cover - reported when a checksum is needed
    xxhash = None

LIBRARY_VERSION = "0.1.0"
FORMAT_VERSION = 3  # the newest read; several processes write 2 (chunks of replicated
# tensors), one process that keeps a model's frozen tensors apart 3 (<model>.frozen.safetensors)
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
               (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symlink"))


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


def open_own(path, what=None):
    """(fd, size) of a file a checkpoint holds (its manifest, a state file,
    a shard index), open for reading, as the C library opens one
    (ckpt__open_read, own): never through a symbolic link (lstat, then
    O_NOFOLLOW: ckpt writes none, and a link could lead anywhere), a regular
    file only, never blocking (a FIFO is never opened; O_NONBLOCK if one is
    swapped in). CorruptError in the C library's words otherwise ("<what>: a
    symlink, expected a regular file"); FileNotFoundError passes through."""
    what = what or path
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise CorruptError("%s: %s, expected a regular file" % (what, _kind_of(st.st_mode)))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as e:
        if e.errno == errno.ELOOP:  # a link put there since the look
            raise CorruptError("%s: a symlink, expected a regular file" % what) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CorruptError("%s: %s, expected a regular file" % (what, _kind_of(st.st_mode)))
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


def _read_small(path, limit, what, own=False):
    """A small file (a manifest, an index) whole, refused above limit bytes
    before any is read (C: ckpt__read_small_file); own: a checkpoint's own
    file, opened as open_own does."""
    fd, size = (open_own if own else open_regular)(path, what)
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
