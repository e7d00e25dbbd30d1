"""A verified checkpoint folder read into one flat state dict per object:
the bytes parsed are the bytes hashed (verify_folder keeps them); a model
saved as Hugging Face shards is put together from the parts its index
names, and the chunks several processes saved into whole tensors."""
import os
import re

import numpy as np

from ._format import (DTYPES, CorruptError, RawTensor, StateFile, UnsupportedError, _loads_strict,
                      resolve_aliases)
from ._verify import verify_folder


def _hf_index(dir, name, data):
    """The weight_map of a model saved as Hugging Face shards (its
    <stem>.safetensors.index.json), checked as the C reader checks it."""
    try:
        doc = _loads_strict(bytes(data).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise CorruptError("%s: %s: not valid JSON: %s" % (dir, name, e)) from None
    wm = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wm, dict) or not wm:
        raise CorruptError("%s: %s: expected an object with a non-empty \"weight_map\" object"
                           % (dir, name))
    for k, v in wm.items():
        if not isinstance(v, str) or "/" in v or v.startswith(".") or not v.endswith(".safetensors"):
            raise CorruptError("%s: %s: weight_map['%s'] is not a .safetensors file name in the "
                               "folder" % (dir, name, k))
    return wm


def _object_flats(dir, m, datas, kinds):
    """Every object's flat dict by its file name; a model saved as Hugging
    Face shards is one object, '<stem>.safetensors', read from the parts its
    index names (each a model file of the manifest)."""
    indexes = {f["name"]: _hf_index(dir, f["name"], datas[f["name"]]) for f in m["files"]
               if f["name"].endswith(".safetensors.index.json")}
    parts = {p for wm in indexes.values() for p in wm.values()}
    flats, aliases = {}, {}
    for f in m["files"]:
        name = f["name"]
        if name in parts or f["kind"] == "extra":  # a save pre-hook's file is no object
            continue
        if name in indexes:
            wm = indexes[name]
            pf, tied = {}, {}
            for p in sorted(set(wm.values())):
                if kinds.get(p) != "model":
                    raise CorruptError("%s: %s names %s, which the manifest does not list as a "
                                       "model file" % (dir, name, p))
                pf[p] = StateFile(os.path.join(dir, p), datas[p]).flat(tied)
            flat = {}
            for k, p in wm.items():
                if k not in pf[p]:
                    raise CorruptError("%s: the index puts tensor '%s' in %s, which has no such "
                                       "tensor" % (dir, k, p))
                flat[k] = pf[p][k]
            for p, part in pf.items():
                extra = set(part) - {k for k, q in wm.items() if q == p} - set(tied)
                if extra:
                    raise CorruptError("%s: %s holds '%s', which the index does not name"
                                       % (dir, p, sorted(extra)[0]))
            for k in tied:
                flat[k] = None  # its target's array, below
            obj = name[:-len(".index.json")]
            flats[obj] = flat
            aliases[obj] = tied  # tied names: in their target's part, not in the index
            kinds[obj] = "model"
        elif f.get("chunks") is None:
            aliases[name] = {}
            flats[name] = StateFile(os.path.join(dir, name), datas[name]).flat(aliases[name])
    _assemble_chunks(dir, m, datas, flats)
    for obj, tied in aliases.items():  # a target may be chunks of shard files
        resolve_aliases(flats[obj], tied, "%s: %s" % (dir, obj))
    return flats


# a process's shard file; version 3 names a one-process model's frozen
# tensors '<stem>.frozen.safetensors' (version 2: '<stem>-00001-of-00001')
_SHARD_NAME = re.compile(r"(.+?)(?:-[0-9]{5,}-of-[0-9]{5,}|\.frozen)\.safetensors")


def _assemble_chunks(dir, m, datas, flats):
    """Format versions 2 and 3: tensors saved as chunks in shard files
    ('<stem>-0000k-of-0000N.safetensors': the sharded tensors, and the
    replicated ones the save plan split over the ranks;
    '<stem>.frozen.safetensors': a one-process model's frozen tensors,
    whole) are put together whole into their object's flat dict."""
    parts = {}
    for f in m["files"]:
        if f.get("chunks") is None:
            continue
        mt = _SHARD_NAME.fullmatch(f["name"])
        obj = (mt.group(1) if mt else "") + ".safetensors"
        if not mt or obj not in flats:
            raise CorruptError("%s: %s has chunks but belongs to no object of the checkpoint"
                               % (dir, f["name"]))
        sf = StateFile(os.path.join(dir, f["name"]), datas[f["name"]])
        for k, c in f["chunks"].items():
            parts.setdefault((obj, k), []).append((c, sf, f["name"]))
    for (obj, k), chunks in parts.items():
        c0 = chunks[0][0]
        g, dt = c0["global_shape"], c0["dtype"]
        npdt = DTYPES[dt][1]
        if k in flats[obj]:
            raise CorruptError("%s: '%s' is both a tensor of %s and a chunk in %s"
                               % (dir, k, obj, chunks[0][2]))
        if any(c["global_shape"] != g or c["dtype"] != dt for c, _sf, _n in chunks):
            raise CorruptError("%s: %s: the chunks of '%s' disagree on the tensor" % (dir, obj, k))
        bits = DTYPES[dt][0]
        raw = npdt is None and bits in (8, 16)  # BF16, F8: assembled as their bytes
        if npdt is None and not raw:
            raise UnsupportedError("%s: %s: '%s' is %s in chunks; only dtypes of whole bytes "
                                   "are put together" % (dir, obj, k, dt))
        if raw:
            npdt = np.dtype("<u1" if bits == 8 else "<u2")
        whole = np.zeros(g, dtype=npdt)
        seen = np.zeros(g, dtype=bool)
        for c, sf, name in chunks:
            a = sf.array(k)
            if isinstance(a, RawTensor):
                if not raw:
                    raise CorruptError("%s: %s: '%s' has an empty shape numpy cannot hold"
                                       % (dir, name, k))
                a = np.frombuffer(a.data, dtype=npdt).reshape(a.shape)
            if tuple(a.shape) != c["shape"]:
                raise CorruptError("%s: %s: '%s' has shape %s, the manifest says %s"
                                   % (dir, name, k, list(a.shape), list(c["shape"])))
            box = tuple(slice(o, o + n) for o, n in zip(c["offsets"], c["shape"]))
            if seen[box].any():
                raise CorruptError("%s: %s: chunks of '%s' overlap" % (dir, obj, k))
            whole[box] = a
            seen[box] = True
        if not seen.all():
            raise CorruptError("%s: %s: the chunks of '%s' leave a hole" % (dir, obj, k))
        flats[obj][k] = RawTensor(dt, tuple(g), whole.tobytes()) if raw else whole


def _read_checkpoint(dir):
    """(manifest, {file name: flat dict}, {file name: kind}) of a verified
    checkpoint folder: the bytes parsed are the bytes hashed."""
    m, datas = verify_folder(dir, keep_data=True)
    kinds = {f["name"]: f["kind"] for f in m["files"]}
    flats = _object_flats(dir, m, datas, kinds)
    datas.clear()
    return m, flats, kinds
