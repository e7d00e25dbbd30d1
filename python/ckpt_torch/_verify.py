"""The checkpoint.json manifest (its exact text, parsed as hostile input)
and the verification of a checkpoint folder against it, as the C library
does before a load (docs/FORMAT.md, docs/CHECKPOINTS.md)."""
import errno
import math
import os
import re
import stat

from ._format import (DTYPES, FORMAT_VERSION, INT64_MAX, INT64_MIN, MANIFEST_MAX_BYTES,
                      MANIFEST_NAME, MAX_KEY, MAX_NDIM, _PIECE, _SUM_KEY, _SUM_PREFIX, CkptError,
                      CorruptError, InvalidError, NotFoundError, StateFile, UnsupportedError, _hex,
                      _is_int, _kind_of, _loads_strict, _pread_into, _read_fd, _read_head,
                      _read_small, jstr, open_own, xxh3_64, xxhash)

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
    try:  # never through a link, as the C library reads it
        text = _read_small(path, MANIFEST_MAX_BYTES, path, own=True)
    except FileNotFoundError:  # removed meanwhile
        raise CorruptError("%s: missing (removed while read)" % path) from None
    return parse_manifest(text, path)


def _state_file(f):
    """Whether a listed file is a state file (parsed and kept by a load):
    not a save pre-hook's file, named .safetensors."""
    return f["kind"] != "extra" and f["name"].endswith(".safetensors")


def _index_mismatch(dir, f, fd, size):
    """A shard index whose digest differs: whether it still parses as JSON
    (not as a safetensors header, which it is not)."""
    what = "%s: %s" % (dir, f["name"])
    if size > MANIFEST_MAX_BYTES:
        raise CorruptError("%s: checksum mismatch in the shard index (%d bytes)" % (what, size))
    text = bytes(_read_fd(fd, size, what))
    try:
        _loads_strict(text.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise CorruptError("%s: checksum mismatch and the shard index does not parse: not valid "
                           "JSON: %s" % (what, e)) from None
    raise CorruptError("%s: checksum mismatch in the shard index (it still parses)" % what)


def _name_mismatch(dir, f, fd, size):
    """The file's digest differs: say which tensor if the file still parses
    (its tensors hashed one by one from the file)."""
    if f["kind"] == "extra":
        raise CorruptError("%s: %s: checksum mismatch (a file a save pre-hook added)"
                           % (dir, f["name"]))
    if f["name"].endswith(".index.json"):  # a Hugging Face shard index: JSON
        _index_mismatch(dir, f, fd, size)
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
        try:  # lstat: a checkpoint's file is never a link (C: check_size)
            st = os.lstat(path)
        except FileNotFoundError:
            raise CorruptError("%s: %s is listed in the manifest but missing" % (dir, f["name"])) from None
        if not stat.S_ISREG(st.st_mode):
            raise CorruptError("%s: %s: %s, expected a regular file"
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
            fd, size = open_own(os.path.join(dir, name), what)
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
