"""ckpt_torch: ckpt checkpoints from Python, with or without PyTorch.

    import ckpt_torch
    ckpt_torch.verify("runs/digits/checkpoints/checkpoint_4")
    ckpt_torch.load(ckpt_torch.latest("runs/digits"), model=net, optimizer=opt,
                    scheduler=sched, scaler=scaler)
    ckpt_torch.save("runs/torch/checkpoints/checkpoint_0", model=net, optimizer=opt,
                    scheduler=sched, scaler=scaler, step=100)

verify() checks a checkpoint folder exactly as the C library does before a
load; load() puts its state into torch objects (or returns it as numpy
arrays and plain dicts when there are none); save() writes a folder the C
library's ckpt_load_state resumes, byte for byte in the C writer's layout.
Nothing is unpickled: safetensors and JSON only. See docs/PYTORCH.md."""
import collections
import os
import re
import warnings

import numpy as np

# Some names are imported only to stay where they always were (ckpt_torch.StateFile, ...).
from ._folder import checkpoint_number, list_numbers, write_checkpoint
from ._format import (DTYPES, LIBRARY_VERSION, U64, BusyError, CkptError, CorruptError,
                      InvalidError, MismatchError, NotFoundError, RawTensor, StateFile,
                      TooLargeError, UnsupportedError, check_key, escape, read_state_file,
                      shape_str)
from ._read import _SHARD_NAME, _read_checkpoint
from ._torch_objects import (Constant, WarmupCosine, WarmupLinear, _adapt_model, _from_torch,
                             _keep_masters, _merge_optimizer, _merge_scheduler, _need_torch,
                             _param_names,
                             _prefix_pairs, _to_np, _to_torch, optimizer_from_flat,
                             optimizer_to_flat, scaler_from_flat, scaler_to_flat,
                             scheduler_from_flat, scheduler_to_flat, _storage_key, torch)
from ._verify import verify_folder

__version__ = LIBRARY_VERSION
__all__ = ["verify", "latest", "load", "load_state_dict", "save", "WarmupCosine", "WarmupLinear",
           "Constant", "CkptError", "CorruptError", "UnsupportedError", "MismatchError",
           "InvalidError", "NotFoundError", "BusyError", "TooLargeError", "RawTensor", "U64"]

# A damaged checkpoint: a project load falls back past it (with a warning).
_DAMAGE = (CorruptError, UnsupportedError, NotFoundError)

# ---- verify, latest, single files -------------------------------------------

def verify(dir):
    """Checks the checkpoint folder `dir` as ckpt_load_state does before it
    loads anything: the manifest (strict JSON, format version, its own
    manifest_xxh3), every listed file's size and XXH3-64 (naming the tensor
    whose digest differs when the file still parses), and no unlisted
    .safetensors file. Returns the manifest as a dict; raises CorruptError,
    UnsupportedError (a newer format) or NotFoundError naming the file."""
    m, _ = verify_folder(dir)
    return m


def _candidates(project_dir):
    cdir = os.path.join(project_dir, "checkpoints")
    nums = list_numbers(cdir)
    if not nums:
        raise NotFoundError(2, "load_state: no checkpoint in %s" % cdir)
    return cdir, [os.path.join(cdir, "checkpoint_%d" % n) for n in reversed(nums)]


def _skip(d, e, last):
    warnings.warn(escape("skipping %s: %s%s" % (d, e, "" if last else
                                                "; falling back to an older checkpoint")),
                  stacklevel=3)


def latest(project_dir):
    """The newest checkpoint of a project that verifies: the highest
    <project_dir>/checkpoints/checkpoint_<n> whose verify() passes, skipping
    (with a warning) the ones that do not, as ckpt_load_state(acc, NULL)
    does: damaged files, a checkpoint.json that is a FIFO, a folder or a link
    to a device, sizes that cannot be right. NotFoundError if there is none;
    CorruptError listing every reason if none is valid."""
    cdir, dirs = _candidates(project_dir)
    why = []
    for i, d in enumerate(dirs):
        try:
            verify_folder(d)
            return d
        except _DAMAGE as e:
            _skip(d, e, i + 1 == len(dirs))
            why.append(str(e))
    raise CorruptError("load_state: no valid checkpoint in %s: %s" % (cdir, "; ".join(why)))


def load_state_dict(path, as_torch=False):
    """One state file (any .safetensors file, every rule of the format
    checked) as a flat dict in the file's terms: tensors (numpy arrays,
    RawTensor for dtypes numpy lacks, or torch tensors with as_torch=True)
    in file order, then the non-tensor entries in the order they were
    written (int for i64, float for f64, str, bytes)."""
    flat = read_state_file(path).flat()
    if as_torch:
        _need_torch("load_state_dict(as_torch=True)")
        flat = _tensorize(flat, True)
    return flat


# ---- load ----------------------------------------------------------------------

_STEMS = ("model", "optimizer", "scheduler", "dataloader", "scaler")


def _file_name(stem, i):
    return "%s.safetensors" % stem if i == 0 else "%s_%d.safetensors" % (stem, i)


def _as_list(x):
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _tensorize(obj, as_torch, memo=None):
    """numpy arrays (and RawTensor) in a nested state dict as torch tensors;
    one array under two names (a tied name) becomes one tensor."""
    if not as_torch:
        return obj
    memo = {} if memo is None else memo
    if isinstance(obj, (np.ndarray, RawTensor)):
        if id(obj) not in memo:
            try:
                memo[id(obj)] = _to_torch(obj)
            except UnsupportedError:
                memo[id(obj)] = obj  # U32 and the like in an older torch: kept as numpy
        return memo[id(obj)]
    if isinstance(obj, dict) and not isinstance(obj, collections.Counter):
        return {k: _tensorize(v, as_torch, memo) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_tensorize(v, as_torch, memo) for v in obj]
    return obj


def _stem(name):
    return name[:-len(".safetensors")]


def load(dir=None, model=None, optimizer=None, scheduler=None, scaler=None, *, project_dir=None,
         as_torch=None, strict=True, prefix_map=None, rename=None, match_by_position=False):
    """Loads the checkpoint folder `dir` (or, with dir=None, the newest valid
    checkpoint of project_dir: a damaged newer one, including one whose
    files do not parse, is skipped with a warning, as ckpt_load_state(acc,
    NULL) does).

    The folder is verified first (verify()), every state file is parsed
    with every rule of the format, and every given object is checked against
    its file (model: the same keys, dtypes and shapes; optimizer: the same
    kind, groups and parameter indices; scheduler: the same kind and
    schedule) before any of them is changed. Then:
      model      (nn.Module, or a list for model.safetensors, model_1, ...)
                 .load_state_dict of the file's tensors;
      optimizer  (torch SGD, Adam, AdamW, RMSprop, or a list) .load_state_dict with
                 the nested structure rebuilt from the flattened keys; each
                 parameter gets the state the file names it with (the names
                 come from the optimizer's own param_names or the given
                 models' named_parameters()); state the file does not name,
                 or an optimizer whose parameters have no names, is refused
                 (MismatchError) unless match_by_position=True, which maps
                 state index i to the i-th parameter, with a warning;
      scheduler  (StepLR, MultiStepLR, ExponentialLR, CosineAnnealingLR, or
                 LambdaLR with a ckpt_torch schedule) .load_state_dict;
      scaler     (GradScaler) .load_state_dict; a disabled GradScaler (torch
                 without CUDA) holds no state: it is left alone, with a warning.

    The models' keys adapt as ckpt_load_state_ex's options do: prefix_map
    (a dict or (from, to) pairs; the first whose `from` starts a file key
    rewrites it), then rename(object, key) -> new key or None (object is
    "model", "model_1", ...); two file keys becoming one are MismatchError.
    strict=False: model keys the file lacks keep their values and file keys
    no model has are ignored, both reported; shapes and dtypes must still
    match. The optimizer, scheduler and scaler always match exactly.

    Returns a dict: 'dir', 'step', 'iteration', 'manifest'; one entry per
    state file keyed by its stem ('model', 'optimizer', 'scheduler',
    'scaler', 'dataloader', 'random_states_0', 'custom_checkpoint_0', ...)
    holding its state in PyTorch's structure (the optimizer nested, the
    scheduler as lr_scheduler's dict, the scaler as GradScaler's); 'files':
    every state file's flat dict as stored, under the same stems; and the
    key report: 'missing' [(object, key)], 'unexpected' [(object, file
    key)], 'renamed' [(object, key, file key)]. Tensors are torch tensors
    when torch is importable (as_torch=None) or as_torch=True, else numpy
    arrays."""
    if as_torch is None:
        as_torch = torch is not None
    if as_torch or model is not None or optimizer is not None or scheduler is not None or \
            scaler is not None:
        _need_torch("load into torch objects")
    pairs = _prefix_pairs(prefix_map)
    if rename is not None and not callable(rename):
        raise InvalidError("load: rename must be a callable (object, key) -> new key or None")
    if dir is None:
        if project_dir is None:
            raise InvalidError("load: give a checkpoint folder or project_dir")
        cdir, dirs = _candidates(project_dir)
        why = []
        for i, d in enumerate(dirs):
            try:
                m, flats, kinds = _read_checkpoint(d)
                dir = d
                break
            except _DAMAGE as e:
                _skip(d, e, i + 1 == len(dirs))
                why.append(str(e))
        else:
            raise CorruptError("load_state: no valid checkpoint in %s: %s" % (cdir, "; ".join(why)))
    else:
        m, flats, kinds = _read_checkpoint(dir)

    def file_for(stem, i):
        name = _file_name(stem, i)
        if name not in flats:
            raise MismatchError("load: %s: checkpoint has no %s (for %s %d)" % (dir, name, stem, i))
        if kinds[name] != stem:
            raise MismatchError("load: %s: %s holds a %s, expected a %s" % (dir, name, kinds[name], stem))
        return name

    # every check before any change
    report = {"missing": [], "unexpected": [], "renamed": []}
    plan = []
    for i, mod in enumerate(_as_list(model)):
        name = file_for("model", i)
        sd = _adapt_model(mod, flats[name], name, _stem(name), strict, pairs, rename, report)
        plan.append(("model", mod, name, sd))
    for i, opt in enumerate(_as_list(optimizer)):
        name = file_for("optimizer", i)
        kind, nested = optimizer_from_flat(flats[name], name)
        plan.append(("optimizer", opt, name,
                     _merge_optimizer(opt, kind, nested, name, _param_names(opt, _as_list(model)),
                                      match_by_position)))
    for i, sch in enumerate(_as_list(scheduler)):
        name = file_for("scheduler", i)
        kind, lam, sd = scheduler_from_flat(flats[name], name)
        plan.append(("scheduler", sch, name, _merge_scheduler(sch, kind, lam, sd, name)))
    for i, sc in enumerate(_as_list(scaler)):
        name = file_for("scaler", i)
        plan.append(("scaler", sc, name, scaler_from_flat(flats[name], name)))

    for what, obj, name, sd in plan:
        if what == "model":
            obj.load_state_dict({k: _to_torch(v) for k, v in sd.items()}, strict=strict)
        elif what == "scaler":
            if obj.is_enabled():
                obj.load_state_dict(sd)
            else:
                warnings.warn("%s: the GradScaler is disabled (no CUDA) and takes no state; "
                              "its state is in the result's 'scaler'" % name, stacklevel=2)
        else:
            obj.load_state_dict(sd)
            if what == "optimizer":
                _keep_masters(obj, sd)

    out = {"dir": dir, "step": m["step"], "iteration": m["iteration"], "manifest": m,
           "files": {_stem(n): f for n, f in flats.items()}}
    out.update(report)
    for name, flat in flats.items():
        kind = kinds[name]
        if kind == "model":
            val = dict(flat)
        elif kind == "optimizer":
            val = optimizer_from_flat(flat, name)[1]
        elif kind == "scheduler":
            val = scheduler_from_flat(flat, name)[2]
        elif kind == "scaler":
            val = scaler_from_flat(flat, name)
        else:
            val = dict(flat)
        out[_stem(name)] = _tensorize(val, as_torch)
    return out


# ---- save ----------------------------------------------------------------------

def _model_flat(x):
    """A model's flat state dict; tied weights (two names on one storage, as
    model.state_dict() gives them) are one array under both names, which
    the file keeps once with an alias record."""
    if torch is not None and isinstance(x, torch.nn.Module):
        x = x.state_dict()
    out, seen = {}, {}
    for k, v in x.items():
        if torch is not None and isinstance(v, torch.Tensor):
            sk = _storage_key(v) if v.numel() > 0 else None
            if sk is not None and sk in seen:
                out[k] = out[seen[sk]]
                continue
            out[k] = _from_torch(v)
            if sk is not None:
                seen[sk] = k
        elif isinstance(v, (np.ndarray, RawTensor)):
            out[k] = v
        else:
            raise TypeError("model: '%s' is a %s, not a tensor" % (k, type(v).__name__))
    return out


def _is_flat(x):
    return isinstance(x, dict) and "kind" in x and "state" not in x


def _plain_flat(x):
    """A flat state dict given by the caller, torch tensors made numpy."""
    return {k: _to_np(v) for k, v in x.items()}


def fresh_random_states(seed=0, process_index=0):
    """The state of the accelerator's Philox generator right after
    ckpt_set_seed(seed): what save() writes when no random_states is given."""
    return {"key": np.array([seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF], dtype=np.uint32),
            "counter": np.array([0, 0, process_index & 0xFFFFFFFF, process_index >> 32],
                                dtype=np.uint32),
            "block": np.zeros(4, dtype=np.uint32),
            "pos": 4, "has_normal": 0, "normal": 0.0}


def loader_batches(flat):
    """Global batches a data loader state has consumed: epoch x batches per
    epoch + batches_yielded, batches per epoch computed from its dataset
    length, batch size, process count and drop_last / even_batches as
    src/train/dataloader.c does. None if the state lacks a field or holds
    impossible values (the C load reports those)."""
    try:
        n, b, p = (int(flat[k]) for k in ("dataset_length", "batch_size", "num_processes"))
        e, pos, pi = (int(flat[k]) for k in ("epoch", "batches_yielded", "process_index"))
        drop, even = bool(flat["drop_last"]), bool(flat["even_batches"])
    except (KeyError, TypeError, ValueError):
        return None
    p = max(p, 1)
    if n < 0 or b < 1 or e < 0 or pos < 0:
        return None
    g = b * p
    full, rem = n // g, n % g
    if drop or rem == 0:
        nb = full
    elif even or p == 1:
        nb = full + 1
    else:
        nb = full + (1 if rem > pi * b else 0)
    return e * nb + pos


def _check_position(loaders, step, batches_per_step):
    """Refuses a data loader state whose position is not where `step`
    optimizer steps of batches_per_step batches each leave it: a C resume
    would continue the data at another batch than the step says."""
    if batches_per_step is None:
        return
    if not isinstance(batches_per_step, int) or isinstance(batches_per_step, bool) or \
            batches_per_step < 1:
        raise InvalidError("save: batches_per_step must be a positive int or None, got %r"
                           % (batches_per_step,))
    for i, flat in enumerate(loaders):
        got = loader_batches(flat)
        want = int(step) * batches_per_step
        if got is not None and got != want:
            raise MismatchError(
                "save: %s: the data loader has consumed %d batches (epoch %d, batches_yielded "
                "%d) but step %d x batches_per_step %d is %d batches; a resume would continue "
                "the data at another batch than the step says. Save the loader state of this "
                "step, pass batches_per_step=k when each step takes k batches, or "
                "batches_per_step=None to skip this check"
                % (_file_name("dataloader", i), got, int(flat["epoch"]),
                   int(flat["batches_yielded"]), int(step), batches_per_step, want))


_OWN_STEMS = ("model", "optimizer", "scheduler", "dataloader", "scaler", "custom_checkpoint",
              "random_states")


def _check_object_name(name, taken):
    """The rules of ckpt_register_for_checkpointing_named."""
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
        raise InvalidError("save: custom object name %r is not 1 to 64 bytes of [A-Za-z0-9_.-]"
                           % (name,))
    if name.startswith("."):
        raise InvalidError("save: custom object name '%s' starts with '.' (a hidden file)" % name)
    low = name.lower()
    if ".safetensors" in low:
        raise InvalidError("save: custom object name '%s' contains '.safetensors'" % name)
    if any(low == s or re.fullmatch(re.escape(s) + r"_[0-9]+", low) for s in _OWN_STEMS):
        raise InvalidError("save: custom object name '%s' is taken by the library's own files"
                           % name)
    if _SHARD_NAME.fullmatch(name + ".safetensors"):
        raise InvalidError("save: custom object name '%s' ends like a shard file's" % name)
    if (name + ".safetensors").lower() in (t.lower() for t in taken):
        raise InvalidError("save: custom object name '%s' is taken (letter case aside)" % name)


def _optimizer_step(flats):
    """The step a save records when none is given, as the C library's
    accelerator counts it: the first optimizer's step count, the largest
    `state.<i>.step` of its parameters (frozen ones have none); 0 without an
    optimizer or before its first step."""
    if not flats:
        return 0
    steps = [int(float(v)) for k, v in flats[0].items()
             if k.startswith("state.") and k.endswith(".step")]
    return max(steps) if steps else 0


def save(dir, model=None, optimizer=None, scheduler=None, scaler=None, step=None, *, iteration=None,
         dataloader=None, custom=None, named=None, random_states=None, seed=0, warn=None,
         metrics=None, batches_per_step=1):
    """Writes a ckpt checkpoint folder `dir` that the C library's
    ckpt_load_state (and `ckpt verify`, `ckpt inspect`) accepts, in exactly
    the layout and metadata document the C writer produces.

      model       nn.Module or a dict of tensors (a list: model, model_1, ...)
      optimizer   torch SGD, Adam, AdamW or RMSprop, or a flat dict as load_state_dict()
                  returns it (a list for several)
      scheduler   StepLR, MultiStepLR, ExponentialLR, CosineAnnealingLR or a
                  LambdaLR whose lambdas are ckpt_torch.WarmupCosine /
                  WarmupLinear / Constant, or a flat dict
      scaler      GradScaler, or its state dict (the five GradScaler keys)
      step        the manifest's step (ckpt_accelerator_step after a load);
                  None (default): as in C, the first optimizer's step count
                  (its parameters' `step`), 0 without an optimizer; a step
                  given that differs from that count is kept, with a warning
      dataloader, custom, random_states
                  flat dicts (as load_state_dict() returns) for the C objects
                  PyTorch has no counterpart of: the data loader's position,
                  custom objects (custom_checkpoint_<i>), and the
                  accelerator's Philox generator;
      named       {name: flat dict}: custom objects under names of their own
                  (<name>.safetensors, what ckpt_register_for_checkpointing_named
                  registers; the same name rules); without random_states a
                  fresh generator seeded with `seed` is written, since every
                  C load expects random_states_0.safetensors.
      iteration   the manifest's iteration; default n + 1 for a folder named
                  checkpoint_<n>, else 0.
      metrics     {name: number} recorded in the manifest as ckpt_set_metric
                  records them (at most 16; names of 1..63 bytes of
                  [A-Za-z0-9_.:/-]; finite values): `ckpt ls` shows them and
                  --keep-best ranks by them.
      batches_per_step
                  each data loader state must have consumed exactly step x
                  batches_per_step global batches (epoch x batches per epoch +
                  batches_yielded), else MismatchError before anything is
                  written: a C resume continues the data from that position
                  while counting from that step. 1 (default) for one batch
                  per optimizer step; k with gradient accumulation over k
                  batches; None skips the check.

    As ckpt_save_state with an explicit folder: the lock of the folder, a
    hidden temporary folder beside it, every file fsynced, the manifest
    (with its self-checksum) written last, the folder fsynced and renamed
    into place; a folder already holding a checkpoint is exchanged
    atomically; a non-empty folder without a manifest is never replaced.
    Returns the manifest written."""
    files = []
    for i, x in enumerate(_as_list(model)):
        files.append((_file_name("model", i), "model", _model_flat(x)))
    for i, x in enumerate(_as_list(optimizer)):
        flat = _plain_flat(x) if _is_flat(x) else optimizer_to_flat(x, _param_names(x, _as_list(model)))
        files.append((_file_name("optimizer", i), "optimizer", flat))
    opt_step = _optimizer_step([f[2] for f in files if f[1] == "optimizer"])
    if step is None:
        step = opt_step
    elif any(f[1] == "optimizer" for f in files) and opt_step and step != opt_step:
        # as the C accelerator's save: said once, and the given step is kept
        msg = ("step %d differs from the optimizer's step count %d; the checkpoint records %d"
               % (step, opt_step, step))
        (warn or (lambda m: warnings.warn(m, stacklevel=3)))(msg)
    loaders = [_plain_flat(x) for x in _as_list(dataloader)]
    _check_position(loaders, step, batches_per_step)
    for i, x in enumerate(_as_list(scheduler)):
        flat = _plain_flat(x) if _is_flat(x) else scheduler_to_flat(x)
        files.append((_file_name("scheduler", i), "scheduler", flat))
    for i, x in enumerate(loaders):
        files.append((_file_name("dataloader", i), "dataloader", x))
    for i, x in enumerate(_as_list(scaler)):
        files.append((_file_name("scaler", i), "scaler", scaler_to_flat(x)))
    for i, x in enumerate(_as_list(custom)):
        files.append(("custom_checkpoint_%d.safetensors" % i, "custom", _plain_flat(x)))
    for name, x in (named or {}).items():
        _check_object_name(name, [f[0] for f in files])
        files.append(("%s.safetensors" % name, "custom", _plain_flat(x)))
    rs = fresh_random_states(seed) if random_states is None else _plain_flat(random_states)
    files.append(("random_states_0.safetensors", "random_states", rs))
    if iteration is None:
        n = checkpoint_number(os.path.basename(os.path.abspath(dir)))
        iteration = 0 if n is None else n + 1
    return write_checkpoint(dir, files, step, iteration, warn=warn, metrics=metrics)
