"""torch objects and their state in the file's flat form: tensors between
numpy, torch and the file; the learning-rate lambdas the C library knows;
optimizers, schedulers and GradScalers to and from flat state dicts (the C
library's layout, docs/PYTORCH.md); and the state of a loaded file merged
into a model, an optimizer or a scheduler, matched as the C loader matches
it."""
import collections
import math
import warnings

import numpy as np

from ._format import (CorruptError, InvalidError, MismatchError, RawTensor, UnsupportedError,
                      check_key, shape_str)

try:  # torch is optional: without it load() returns numpy arrays
    import torch
except ImportError:  # pragma: no cover - exercised on machines without torch
    torch = None


# ---- tensors between numpy, torch and the file ------------------------------

def _need_torch(what):
    if torch is None:
        raise ImportError("%s needs PyTorch (python3-torch)" % what)


_TORCH_RAW = {"bfloat16": "BF16", "float8_e5m2": "F8_E5M2", "float8_e4m3fn": "F8_E4M3",
              "float8_e8m0fnu": "F8_E8M0", "float8_e4m3fnuz": "F8_E4M3FNUZ",
              "float8_e5m2fnuz": "F8_E5M2FNUZ"}


def _from_torch(t):
    """A torch tensor as a numpy array (or RawTensor) for the file."""
    t = t.detach().cpu().contiguous()
    name = str(t.dtype).replace("torch.", "")
    if name in _TORCH_RAW:
        view = t.view(torch.int16 if t.element_size() == 2 else torch.uint8)
        return RawTensor(_TORCH_RAW[name], tuple(t.shape), view.numpy().tobytes())
    return t.numpy().copy()


def _to_torch(v):
    if isinstance(v, RawTensor):
        tname = {b: a for a, b in _TORCH_RAW.items()}.get(v.dtype)
        tdt = getattr(torch, tname, None) if tname else None
        if tdt is None:
            raise UnsupportedError("a %s tensor has no torch dtype in this torch version" % v.dtype)
        if not v.data:
            return torch.empty(v.shape, dtype=tdt)
        return torch.frombuffer(bytearray(v.data), dtype=tdt).reshape(v.shape)
    try:
        return torch.from_numpy(np.array(v, copy=True))
    except TypeError:
        raise UnsupportedError("a %s tensor has no torch dtype in this torch version"
                               % _dtype_name(v)) from None


def _to_np(v):
    if torch is not None and isinstance(v, torch.Tensor):
        return _from_torch(v)
    if isinstance(v, (np.ndarray, RawTensor)):
        return v
    return v


def _dtype_name(v):
    if isinstance(v, RawTensor):
        return v.dtype
    from ._format import dtype_of_array
    return dtype_of_array(v)


# ---- learning-rate lambdas the C library knows --------------------------------

class _Schedule:
    """A LambdaLR lambda whose schedule the C library has (transformers'
    get_*_schedule_with_warmup, computed in the same order of operations),
    so that save() can name it and load() can check it."""
    kind = None

    def __init__(self, warmup, total=0):
        self.warmup, self.total = int(warmup), int(total)

    def __eq__(self, other):
        return (type(self) is type(other) and self.warmup == other.warmup and
                self.total == other.total)

    def __repr__(self):
        return "%s(%d, %d)" % (type(self).__name__, self.warmup, self.total)


class WarmupCosine(_Schedule):
    """Linear warmup over `warmup` steps, then half a cosine to 0 at `total`
    (transformers' get_cosine_schedule_with_warmup; C: ckpt_warmup_cosine_new)."""
    kind = "warmup_cosine"

    def __call__(self, step):
        if step < self.warmup:
            return float(step) / float(max(1, self.warmup))
        progress = float(step - self.warmup) / float(max(1, self.total - self.warmup))
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress)))


class WarmupLinear(_Schedule):
    """Linear warmup, then linear decay to 0 at `total`
    (get_linear_schedule_with_warmup; C: ckpt_warmup_linear_new)."""
    kind = "warmup_linear"

    def __call__(self, step):
        if step < self.warmup:
            return float(step) / float(max(1, self.warmup))
        return max(0.0, float(self.total - step) / float(max(1, self.total - self.warmup)))


class Constant(_Schedule):
    """Linear warmup, then constant (get_constant_schedule_with_warmup;
    C: ckpt_constant_new)."""
    kind = "constant"

    def __init__(self, warmup=0):
        super().__init__(warmup, 0)

    def __call__(self, step):
        if step < self.warmup:
            return float(step) / float(max(1, self.warmup))
        return 1.0


_SCHEDULES = {c.kind: c for c in (WarmupCosine, WarmupLinear, Constant)}


# ---- flat (file) <-> torch-style state dicts ------------------------------------

# Each optimizer kind as src/train/optim.c's descriptors have it: its own
# hyper-parameters in state-dict order ("betas.0" is element 0 of torch's
# pair "betas"), its state buffers (torch's names) and when each exists, and
# how torch 1.13 keeps state["step"] (SGD keeps none).
_ADAM_LIKE = dict(hparams=(("betas.0", float), ("betas.1", float), ("eps", float),
                           ("amsgrad", bool)),
                  buffers=("exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
                  needs=lambda b, g: b != "max_exp_avg_sq" or bool(g["amsgrad"]), step="tensor")
_OPT_KINDS = {
    "sgd": dict(hparams=(("momentum", float), ("dampening", float), ("nesterov", bool)),
                buffers=("momentum_buffer",), needs=lambda b, g: g["momentum"] != 0,
                step="none"),
    "adam": _ADAM_LIKE,
    "adamw": _ADAM_LIKE,
    "rmsprop": dict(hparams=(("alpha", float), ("eps", float), ("momentum", float),
                             ("centered", bool)),
                    buffers=("square_avg", "momentum_buffer", "grad_avg"),
                    needs=lambda b, g: (b == "square_avg" or (b == "momentum_buffer" and
                                                              g["momentum"] > 0) or
                                        (b == "grad_avg" and bool(g["centered"]))),
                    step="int"),
}
_OPT_BUFFERS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg",
                "grad_avg")


def _group_get(grp, key):
    """A torch param_group's hyper-parameter by its state-dict key."""
    if key.startswith("betas."):
        return grp["betas"][int(key[6:])]
    return grp[key]


def _group_set(grp, key, v):
    if key.startswith("betas."):
        b = list(grp.get("betas", (0.0, 0.0)))
        b[int(key[6:])] = v
        grp["betas"] = tuple(b)
    else:
        grp[key] = v


def _flat_get(flat, key, types, what):
    if key not in flat:
        raise MismatchError("%s: the state dict has no '%s'" % (what, key))
    v = flat[key]
    if not isinstance(v, types) or isinstance(v, bool):
        raise MismatchError("%s: '%s' has the wrong type (%s)" % (what, key, type(v).__name__))
    return v


def _count(flat, fmt):
    n = 0
    while fmt % n in flat:
        n += 1
    return n


def optimizer_from_flat(flat, what="optimizer.safetensors"):
    """(kind, torch-style nested state dict) from an optimizer file's flat
    dict: {'state': {i: {...}}, 'param_groups': [{..., 'params': [...]}]}."""
    kind = _flat_get(flat, "kind", str, what)
    if kind not in _OPT_KINDS:
        raise UnsupportedError("%s: optimizer kind '%s' is not sgd, adam, adamw or rmsprop"
                               % (what, kind))
    desc = _OPT_KINDS[kind]
    groups = []
    for g in range(_count(flat, "param_groups.%d.lr")):
        p = "param_groups.%d." % g
        grp = {"lr": float(_flat_get(flat, p + "lr", (float, int), what)),
               "weight_decay": float(_flat_get(flat, p + "weight_decay", (float, int), what))}
        for key, typ in desc["hparams"]:
            if typ is bool:
                _group_set(grp, key, bool(_flat_get(flat, p + key, int, what)))
            else:
                _group_set(grp, key, float(_flat_get(flat, p + key, (float, int), what)))
        grp["maximize"] = bool(_flat_get(flat, p + "maximize", int, what))
        params = _flat_get(flat, p + "params", np.ndarray, what)
        if params.dtype != np.int64 or params.ndim != 1:
            raise CorruptError("%s: %sparams: expected an I64 vector" % (what, p))
        grp["params"] = [int(i) for i in params]
        if "param_names.0" in flat:  # as PyTorch 2.6 on keeps them
            grp["param_names"] = [_flat_get(flat, "param_names.%d" % i, str, what)
                                  for i in grp["params"]]
        groups.append(grp)
    state = {}
    # a frozen parameter has no state (no state.<i>.step): as in PyTorch
    for i in sorted({i for grp in groups for i in grp["params"]}):
        if "state.%d.step" % i not in flat:
            continue
        step = _flat_get(flat, "state.%d.step" % i, np.ndarray, what)
        if step.dtype != np.float32 or step.shape != ():
            raise CorruptError("%s: state.%d.step: expected an F32 scalar" % (what, i))
        s = {"step": step}
        for b in _OPT_BUFFERS + ("master",):
            k = "state.%d.%s" % (i, b)
            if k in flat:
                s[b] = flat[k]
        state[i] = s
    return kind, {"state": state, "param_groups": groups}


def _optim_kind(opt):
    if isinstance(opt, torch.optim.AdamW):
        return "adamw"
    if isinstance(opt, torch.optim.Adam):
        decoupled = any(g.get("decoupled_weight_decay") for g in opt.param_groups)
        return "adamw" if decoupled else "adam"
    if isinstance(opt, torch.optim.SGD):
        return "sgd"
    if isinstance(opt, torch.optim.RMSprop):
        return "rmsprop"
    raise UnsupportedError("optimizer: %s is not supported (SGD, Adam, AdamW and RMSprop are)"
                           % type(opt).__name__)


def _param_names(opt, models):
    """Each optimized parameter's name (id(param) -> name): from the
    optimizer's own param_names (PyTorch 2.6 on) or the models'
    named_parameters(); None unless every parameter has one."""
    names = {}
    for m in models:
        if torch is not None and isinstance(m, torch.nn.Module):
            for n, p in m.named_parameters():
                names.setdefault(id(p), n)
    for g in opt.param_groups:
        for n, p in zip(g.get("param_names") or [], g["params"]):
            names[id(p)] = n
    if all(id(p) in names for g in opt.param_groups for p in g["params"]):
        return names
    return None


def _group_view(grp, desc):
    """A torch param_group's hyper-parameters by state-dict key (a bool a
    torch version lacks, such as amsgrad, is False)."""
    out = {}
    for key, typ in desc["hparams"]:
        try:
            out[key] = _group_get(grp, key)
        except KeyError:
            if typ is not bool:
                raise
            out[key] = False
    return out


def optimizer_to_flat(opt, names=None):
    """The flat state dict the C library writes for a torch SGD, Adam or
    AdamW: keys, order and zero-filled buffers exactly as src/train/optim.c.
    names (id(param) -> name, see _param_names) adds each state index's
    parameter name (param_names.<i>), so a C load maps state by name."""
    kind = _optim_kind(opt)
    sd = opt.state_dict()
    params = [p for g in opt.param_groups for p in g["params"]]
    indices = [i for g in sd["param_groups"] for i in g["params"]]
    by_index = dict(zip(indices, params))
    flat = {"kind": kind}
    if names is not None:
        for i in sorted(by_index):
            flat["param_names.%d" % i] = names[id(by_index[i])]
    group_of = {}
    for g, grp in enumerate(sd["param_groups"]):
        for i in grp["params"]:
            group_of[i] = grp
    for i in sorted(by_index):
        p = by_index[i]
        st = sd["state"].get(i, {})
        master = st.get("master")
        if p.dtype != torch.float32 and not (
                p.dtype in (torch.bfloat16, torch.float16) and isinstance(master, torch.Tensor)):
            raise UnsupportedError("optimizer: parameter %d is %s; the C optimizers take float32 "
                                   "(or bfloat16/float16 with an fp32 'master' in its state)"
                                   % (i, p.dtype))
        grp = group_of[i]
        zeros = np.zeros(tuple(p.shape), dtype=np.float32)

        def buf(name):
            v = st.get(name)
            if v is None:
                return zeros
            # (a bfloat16/float16 parameter's moments: torch keeps them in its dtype)
            a = _from_torch(v.float()) if isinstance(v, torch.Tensor) else np.asarray(v)
            return np.array(a, dtype=np.float32, order="C").reshape(tuple(p.shape))
        if kind == "sgd":
            has_buf = st.get("momentum_buffer") is not None
            step = float(st["step"]) if "step" in st else (1.0 if has_buf else 0.0)
            if has_buf and step == 0:
                step = 1.0
            if not has_buf:
                step = 0.0
        else:
            step = float(st["step"]) if "step" in st else 0.0
        flat["state.%d.step" % i] = np.array(step, dtype=np.float32)
        desc = _OPT_KINDS[kind]
        for b in desc["buffers"]:
            if desc["needs"](b, _group_view(grp, desc)):
                flat["state.%d.%s" % (i, b)] = buf(b)
        if isinstance(master, torch.Tensor):
            flat["state.%d.master" % i] = np.array(_from_torch(master.float()), dtype=np.float32,
                                                   order="C").reshape(tuple(p.shape))
    for g, grp in enumerate(sd["param_groups"]):
        p = "param_groups.%d." % g
        flat[p + "lr"] = float(grp["lr"])
        flat[p + "weight_decay"] = float(grp["weight_decay"])
        flat[p + "maximize"] = int(bool(grp.get("maximize", False)))
        for key, typ in _OPT_KINDS[kind]["hparams"]:
            v = _group_view(grp, _OPT_KINDS[kind])[key]
            flat[p + key] = int(bool(v)) if typ is bool else float(v)
        flat[p + "params"] = np.array(grp["params"], dtype=np.int64)
    return flat


_SCHED_CLASSES = (("StepLR", "steplr"), ("MultiStepLR", "multisteplr"),
                  ("ExponentialLR", "exponentiallr"), ("CosineAnnealingLR", "cosineannealinglr"))


# transformers' schedule functions (transformers.optimization, given to
# LambdaLR as functools.partial objects) and the C schedules they compute
_HF_LAMBDAS = {"_get_cosine_schedule_with_warmup_lr_lambda": "warmup_cosine",
               "_get_linear_schedule_with_warmup_lr_lambda": "warmup_linear",
               "_get_constant_schedule_with_warmup_lr_lambda": "constant"}


def _describe(f):
    fn = getattr(f, "func", f)
    mod = getattr(fn, "__module__", None) or type(fn).__module__
    qual = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return "%s.%s%s" % (mod, qual, " (a functools.partial)" if hasattr(f, "func") else "")


def _schedule_of(f, g):
    """The ckpt_torch schedule a LambdaLR lambda computes, or
    UnsupportedError saying why it cannot be mapped."""
    if isinstance(f, _Schedule):
        return f
    fn, kw = getattr(f, "func", None), getattr(f, "keywords", None) or {}
    kind = _HF_LAMBDAS.get(getattr(fn, "__name__", None))
    if kind is not None and getattr(fn, "__module__", "").startswith("transformers") and \
            not getattr(f, "args", ()):
        try:
            if kind == "warmup_cosine":
                if float(kw.get("num_cycles", 0.5)) != 0.5:
                    raise UnsupportedError(
                        "scheduler: LambdaLR group %d: transformers' cosine schedule with "
                        "num_cycles=%r; the C warmup_cosine is half a cosine (num_cycles=0.5)"
                        % (g, kw.get("num_cycles")))
                return WarmupCosine(kw["num_warmup_steps"], kw["num_training_steps"])
            if kind == "warmup_linear":
                return WarmupLinear(kw["num_warmup_steps"], kw["num_training_steps"])
            return Constant(kw["num_warmup_steps"])
        except KeyError as e:
            raise UnsupportedError("scheduler: LambdaLR group %d: %s has no keyword %s"
                                   % (g, _describe(f), e)) from None
    raise UnsupportedError(
        "scheduler: LambdaLR group %d: its lambda %s is not a schedule the C library has, so it "
        "cannot be saved or checked; build the LambdaLR with ckpt_torch.WarmupCosine(warmup, "
        "total), WarmupLinear(warmup, total) or Constant(warmup) (transformers' "
        "get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup and "
        "get_constant_schedule_with_warmup map too), or use StepLR, MultiStepLR, ExponentialLR "
        "or CosineAnnealingLR" % (g, _describe(f)))


def _sched_kind(s):
    L = torch.optim.lr_scheduler
    for cls, kind in _SCHED_CLASSES:
        if type(s) is getattr(L, cls):
            return kind, None
    if type(s) is L.LambdaLR:
        lams = [_schedule_of(f, g) for g, f in enumerate(s.lr_lambdas)]
        if not lams:
            raise UnsupportedError("scheduler: a LambdaLR without parameter groups")
        for g, f in enumerate(lams):
            if f != lams[0]:
                raise UnsupportedError(
                    "scheduler: LambdaLR group 0 has %r, group %d %r; the C scheduler has one "
                    "schedule for every group" % (lams[0], g, f))
        return lams[0].kind, lams[0]
    raise UnsupportedError("scheduler: %s is not supported (StepLR, MultiStepLR, ExponentialLR, "
                           "CosineAnnealingLR, LambdaLR with a ckpt_torch schedule)" % type(s).__name__)


def scheduler_to_flat(s):
    """The flat state dict src/train/sched.c writes for a torch scheduler."""
    kind, lam = _sched_kind(s)
    sd = s.state_dict()
    flat = {"kind": kind, "last_epoch": int(sd["last_epoch"]), "_step_count": int(sd["_step_count"])}
    last = sd.get("_last_lr") or [g["lr"] for g in s.optimizer.param_groups]
    for g, base in enumerate(sd["base_lrs"]):
        flat["base_lrs.%d" % g] = float(base)
        flat["_last_lr.%d" % g] = float(last[g])
    if kind == "steplr":
        flat["step_size"] = int(sd["step_size"])
        flat["gamma"] = float(sd["gamma"])
    elif kind == "multisteplr":
        flat["milestones"] = np.array(sorted(collections.Counter(sd["milestones"]).elements()),
                                      dtype=np.int64)
        flat["gamma"] = float(sd["gamma"])
    elif kind == "exponentiallr":
        flat["gamma"] = float(sd["gamma"])
    elif kind == "cosineannealinglr":
        flat["T_max"] = int(sd["T_max"])
        flat["eta_min"] = float(sd["eta_min"])
    elif kind in ("warmup_cosine", "warmup_linear"):
        flat["warmup"], flat["total"] = lam.warmup, lam.total
    else:
        flat["warmup"] = lam.warmup
    return flat


def scheduler_from_flat(flat, what="scheduler.safetensors"):
    """(kind, schedule parameters, torch-style scheduler state dict)."""
    kind = _flat_get(flat, "kind", str, what)
    sd = {"last_epoch": _flat_get(flat, "last_epoch", int, what),
          "_step_count": _flat_get(flat, "_step_count", int, what)}
    n = _count(flat, "base_lrs.%d")
    sd["base_lrs"] = [float(_flat_get(flat, "base_lrs.%d" % g, (float, int), what)) for g in range(n)]
    sd["_last_lr"] = [float(_flat_get(flat, "_last_lr.%d" % g, (float, int), what)) for g in range(n)]
    lam = None
    if kind == "steplr":
        sd["step_size"] = _flat_get(flat, "step_size", int, what)
        sd["gamma"] = float(_flat_get(flat, "gamma", (float, int), what))
    elif kind == "multisteplr":
        ms = _flat_get(flat, "milestones", np.ndarray, what)
        sd["milestones"] = collections.Counter(int(x) for x in ms.reshape(-1))
        sd["gamma"] = float(_flat_get(flat, "gamma", (float, int), what))
    elif kind == "exponentiallr":
        sd["gamma"] = float(_flat_get(flat, "gamma", (float, int), what))
    elif kind == "cosineannealinglr":
        sd["T_max"] = _flat_get(flat, "T_max", int, what)
        sd["eta_min"] = float(_flat_get(flat, "eta_min", (float, int), what))
    elif kind in _SCHEDULES:
        warmup = _flat_get(flat, "warmup", int, what)
        total = _flat_get(flat, "total", int, what) if kind != "constant" else 0
        lam = WarmupCosine(warmup, total) if kind == "warmup_cosine" else \
            WarmupLinear(warmup, total) if kind == "warmup_linear" else Constant(warmup)
        sd["lr_lambdas"] = [None] * n
    else:
        raise UnsupportedError("%s: scheduler kind '%s' is unknown" % (what, kind))
    return kind, lam, sd


_SCALER_KEYS = (("scale", float), ("growth_factor", float), ("backoff_factor", float),
                ("growth_interval", int), ("_growth_tracker", int))


def scaler_to_flat(sc):
    """The flat state dict src/train/scaler.c writes, from a torch GradScaler
    or its state_dict() (a dict with the same five keys)."""
    if isinstance(sc, dict):
        sd = sc
    else:
        sd = sc.state_dict()
        if not sd:
            raise UnsupportedError(
                "scaler: this GradScaler is disabled (torch without CUDA) and holds no state; "
                "pass its state as a dict: scale, growth_factor, backoff_factor, growth_interval, "
                "_growth_tracker")
    out = {}
    for k, t in _SCALER_KEYS:
        if k not in sd:
            raise InvalidError("scaler: the state has no '%s'" % k)
        out[k] = t(sd[k])
    return out


def scaler_from_flat(flat, what="scaler.safetensors"):
    return {k: t(_flat_get(flat, k, (float, int) if t is float else int, what))
            for k, t in _SCALER_KEYS}


# ---- loading into torch objects -------------------------------------------------

def _prefix_pairs(prefix_map):
    if prefix_map is None:
        return []
    pairs = list(prefix_map.items()) if isinstance(prefix_map, dict) else list(prefix_map)
    for i, pr in enumerate(pairs):
        if not (isinstance(pr, (tuple, list)) and len(pr) == 2 and all(isinstance(x, str)
                                                                       for x in pr)):
            raise InvalidError("load: prefix_map[%d] is not a (from, to) pair of strings" % i)
    return pairs


def _map_key(pairs, rename, obj, key):
    """A file key under its name in memory, as ckpt__keymap_apply: the first
    prefix_map entry whose `from` starts it rewrites it, then rename(object,
    key) (None or the key itself: kept)."""
    out = key
    for i, (a, b) in enumerate(pairs):
        if key.startswith(a):
            out = b + key[len(a):]
            break
    if rename is not None:
        r = rename(obj, out)
        if r is not None:
            if not isinstance(r, str):
                raise InvalidError("%s: rename returned %r for key '%s', expected a string or "
                                   "None" % (obj, r, out))
            out = r
    if out != key:
        try:
            check_key(out, "key map")
        except InvalidError as e:
            raise InvalidError("%s: file key '%s' renamed to '%s': %s"
                               % (obj, key, out, e)) from None
    return out


def _storage_key(t):
    """Where a torch tensor's elements are: two tensors with one key are one
    tensor under two names (tied weights)."""
    try:
        base = t.untyped_storage().data_ptr()
    except AttributeError:  # torch before 2.0
        base = t.storage().data_ptr()
    return (base, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


def _adapt_model(module, flat, name, obj, strict, pairs, rename, report):
    """The model's schema against the file, as the C loader matches it: the
    file's keys renamed (prefix map, then rename), two file keys becoming
    one refused; same keys (strict) or the common ones (non-strict: memory
    keys the file lacks keep their values, file keys nothing uses are
    ignored, both reported); a common key must be a tensor of the same dtype
    and shape. Returns {memory key: file value} to load."""
    named, orig = {}, {}
    for k, v in flat.items():
        nk = _map_key(pairs, rename, obj, k) if pairs or rename else k
        if nk in named:
            raise MismatchError("%s: file keys '%s' and '%s' both become '%s'"
                                % (name, orig[nk], k, nk))
        named[nk], orig[nk] = v, k
    mine = module.state_dict()
    # a tied name the file leaves out (Hugging Face's files): its partner on
    # the same storage fills the one parameter, as in the C library
    first = {}
    for k, t in mine.items():
        if t.numel() > 0:
            first.setdefault(_storage_key(t), k)
    for k, t in mine.items():
        partner = first.get(_storage_key(t)) if t.numel() > 0 else None
        if k not in named and partner is not None and partner != k and partner in named:
            named[k], orig[k] = named[partner], k
    for k, t in mine.items():
        if k not in named:
            if strict:
                raise MismatchError("%s: key '%s' missing in file (memory has a tensor); a "
                                    "non-strict load would keep its value" % (name, k))
            report["missing"].append((obj, k))
            continue
        v = named[k]
        if orig[k] != k:
            report["renamed"].append((obj, k, orig[k]))
        if not isinstance(v, (np.ndarray, RawTensor)):
            raise MismatchError("%s: key '%s': %s in file, tensor in memory"
                                % (name, k, type(v).__name__))
        fd, md = _dtype_name(v), _dtype_name(_from_torch(t.reshape(-1)[:0]))
        fs, ms = tuple(v.shape), tuple(t.shape)
        if fs != ms:
            raise MismatchError("%s: tensor '%s': shape %s in file, %s in memory"
                                % (name, k, shape_str(fs), shape_str(ms)))
        if fd != md:
            raise MismatchError("%s: tensor '%s': dtype %s in file, %s in memory"
                                % (name, k, fd, md))
    for k in named:
        if k not in mine:
            if strict:
                raise MismatchError("%s: key '%s' in file but not in memory; a non-strict load "
                                    "would ignore it" % (name, orig[k]))
            report["unexpected"].append((obj, orig[k]))
    return {k: v for k, v in named.items() if k in mine}


def _merge_optimizer(opt, kind, nested, name, names=None, by_position=False):
    """The optimizer's own state_dict() with the file's values: every
    param_groups field this torch version has is kept, the file's
    hyper-parameters and state replace the rest. When the file names its
    parameters and names (id(param) -> name) covers the optimizer's, each
    parameter gets the state of its own name, wherever the file has it.
    Otherwise which state belongs to which parameter is not known, and two
    same-shaped parameters registered in another order would silently get
    each other's moments: refused unless by_position (then state index i
    goes to the optimizer's i-th parameter, as PyTorch does, with a
    warning), as ckpt_optimizer_set_match_by_position in C."""
    mine_kind = _optim_kind(opt)
    if mine_kind != kind:
        raise MismatchError("%s: the state dict is for a%s %s optimizer, this one is %s"
                            % (name, "n" if kind[0] == "a" else "", kind, mine_kind))
    cur = opt.state_dict()
    if len(cur["param_groups"]) != len(nested["param_groups"]):
        raise MismatchError("%s: the file has %d parameter groups, the optimizer %d"
                            % (name, len(nested["param_groups"]), len(cur["param_groups"])))
    params = {}
    for g, (mg, fg) in enumerate(zip(opt.param_groups, nested["param_groups"])):
        cg = cur["param_groups"][g]
        if list(cg["params"]) != fg["params"]:
            raise MismatchError("%s: param_groups.%d.params: file %s, optimizer %s"
                                % (name, g, fg["params"], list(cg["params"])))
        for i, p in zip(cg["params"], mg["params"]):
            params[i] = p
    if not set(nested["state"]) <= set(params):
        raise MismatchError("%s: the file has state for %d parameters, the optimizer has %d"
                            % (name, len(nested["state"]), len(params)))
    src = {i: i for i in params}  # torch index -> the file's state index
    file_named = all("param_names" in fg for fg in nested["param_groups"])
    named = names is not None and file_named
    if not named and params:
        if not file_named:
            why = ("%s: the state dict does not name its parameters (no param_names.<i>, as in "
                   "state imported from a torch 1.13 optimizer.bin), so which state belongs to "
                   "which parameter is not known; import again with the names (ckpt import "
                   "--param-names FILE), or, if this model registers its parameters in the "
                   "file's order, allow a load by position (match_by_position=True)" % name)
        else:
            why = ("%s: the file names its parameters but this optimizer's parameters have no "
                   "names: give the model they belong to (model=...) so each parameter gets "
                   "its own state, or allow a load by position (match_by_position=True)" % name)
        if not by_position:
            raise MismatchError(why)
        warnings.warn("%s: its state was matched by position (match_by_position=True)" % name,
                      stacklevel=3)
    if named:
        where = {}
        for g, fg in enumerate(nested["param_groups"]):
            for j, n in zip(fg["params"], fg["param_names"]):
                where[n] = (g, j)
        for g, mg in enumerate(opt.param_groups):
            for i, p in zip(cur["param_groups"][g]["params"], mg["params"]):
                n = names[id(p)]
                if n not in where:
                    raise MismatchError("%s: the file has no state for parameter '%s'" % (name, n))
                if where[n][0] != g:
                    raise MismatchError("%s: parameter '%s' is in group %d in the file, %d here"
                                        % (name, n, where[n][0], g))
                src[i] = where[n][1]
    groups = []
    for g, (cg, fg) in enumerate(zip(cur["param_groups"], nested["param_groups"])):
        ng = dict(cg)
        # param_names only where this torch version's optimizer keeps them
        ng.update({k: v for k, v in fg.items() if k not in ("params", "param_names")})
        if named and "param_names" in cg:
            ng["param_names"] = [names[id(p)] for p in opt.param_groups[g]["params"]]
        groups.append(ng)
    state = {}
    for i in sorted(params):
        if src[i] not in nested["state"]:
            continue  # frozen when saved: no state, as a fresh torch optimizer
        s = nested["state"][src[i]]
        p = params[i]
        st = {}
        for b in _OPT_BUFFERS + ("master",):
            if b in s:
                if tuple(s[b].shape) != tuple(p.shape) or s[b].dtype != np.float32:
                    raise MismatchError("%s: state.%d.%s: file has %s %s, the parameter is %s"
                                        % (name, i, b, s[b].dtype, list(s[b].shape), list(p.shape)))
        if kind == "sgd":
            step = float(s["step"])
            if "momentum_buffer" in s:
                st["momentum_buffer"] = _to_torch(s["momentum_buffer"]) if step > 0 else None
            st["step"] = _to_torch(s["step"])
        else:
            # torch 1.13 keeps RMSprop's step as an int, Adam's as a tensor
            st["step"] = (int(float(s["step"])) if _OPT_KINDS[kind]["step"] == "int"
                          else _to_torch(s["step"]))
            for b in _OPT_KINDS[kind]["buffers"]:
                if b in s:
                    st[b] = _to_torch(s[b])
        if "master" in s:  # master_weights: the fp32 master, kept under its key
            st["master"] = _to_torch(s["master"])
        state[i] = st
    return {"state": state, "param_groups": groups}


def _keep_masters(opt, sd):
    """torch's load_state_dict casts every state tensor but step to its
    parameter's dtype: an fp32 master (master_weights) of a bfloat16 or
    float16 parameter is put back as the file has it."""
    params = [p for g in opt.param_groups for p in g["params"]]
    for i, st in sd["state"].items():
        if "master" in st and 0 <= i < len(params):
            opt.state[params[i]]["master"] = st["master"].detach().float().clone()


def _merge_scheduler(sched, kind, lam, sd, name):
    mine, mine_lam = _sched_kind(sched)
    if mine != kind:
        raise MismatchError("%s: the state dict is for a %s scheduler, this one is %s"
                            % (name, kind, mine))
    if lam is not None and mine_lam != lam:
        raise MismatchError("%s: the file's schedule is %r, this scheduler's is %r"
                            % (name, lam, mine_lam))
    cur = sched.state_dict()
    if len(cur["base_lrs"]) != len(sd["base_lrs"]):
        raise MismatchError("%s: the file has %d groups, the scheduler %d"
                            % (name, len(sd["base_lrs"]), len(cur["base_lrs"])))
    cur.update(sd)
    return cur
