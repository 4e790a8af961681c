"""The driver's ``model_init`` model, without its weights, when the workers build the real one.

transformers' ``Trainer.__init__`` calls ``model_init()``, and its checks read the model (the forward's
signature, the label names, the config). On Ray (``num_workers > 0``) the workers build their own model
(sharded where the strategy shards), so a real one on the driver is pure cost: at 1.1B parameters 26 s of
CPU initialisation and 4.4 GB on the head node before any worker starts, at 70B 280 GB, which a CPU-only
head node does not have. Above ``DRIVER_META_ABOVE_PARAMS`` the driver therefore keeps the model that
``model_init`` builds under ``torch.device("meta")``: the same modules, shapes and config, no storage. Below
it (any model a driver-side forward check still covers) the driver builds the real model, as transformers.

On a worker, ranks that receive their weights from rank 0 (FSDP's rank-0 way) build the same skeleton even
where ``model_init`` loads weights: ``weightless_loading`` (transformers' ``from_pretrained`` builds the model
on the meta device from its config and the files' headers, reading no tensor).

The skeleton becomes real on first use of the trained weights (``materialise``): ``model_init`` runs again,
for real, and the final weights are loaded into it (``raytrainer.final_weights``). A ``model_init`` that
cannot run under the meta device (``from_pretrained`` refuses to) is simply called for real.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

logger = logging.getLogger(__name__)

#: Above this many parameters (with num_workers > 0) the driver keeps model_init's model on the meta device.
DRIVER_META_ABOVE_PARAMS = 100_000_000


def is_skeleton(model) -> bool:
    """Every parameter of ``model`` is on the meta device (holds no storage)."""
    params = list(model.parameters()) if isinstance(model, torch.nn.Module) else []
    return bool(params) and all(p.is_meta for p in params)


def driver_model(build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """``build()`` on the meta device when the model is big enough to matter, else for real."""
    model = build_on_meta(build)
    if model is None:
        return build()
    if not is_skeleton(model):
        return model  # it chose its own device: that build is the real one, not repeated
    n = sum(p.numel() for p in model.parameters())
    if n <= DRIVER_META_ABOVE_PARAMS:
        return build()
    logger.info("model_init's %s has %.2fB parameters: the driver keeps it on the meta device (no weights); "
                "the workers build the real one, and trainer.model gets the trained weights after train()",
                type(model).__name__, n / 1e9)
    return model


def materialise(model: torch.nn.Module, build: Callable[[], torch.nn.Module]) -> None:
    """Make the skeleton ``model`` real in place (the same object, which callbacks and ``model_wrapped``
    hold): ``build()`` for real, then take over the built module's state. Its weights are the init's until
    the caller loads the trained ones."""
    real = build()
    if type(real) is not type(model):
        raise TypeError(f"model_init returned a {type(real).__name__} this time, a {type(model).__name__} "
                        "before: it must build the same model on every call.")
    vars(model).clear()
    vars(model).update(vars(real))


def build_on_meta(build) -> torch.nn.Module | None:
    """``build()`` under the meta device (the driver's skeleton; FSDP's per-shard construction on a worker);
    None where it fails there. Unless the model came out real (a
    ``model_init`` that names its device), every random generator's state is put back after, so the real
    build that may follow draws what it would have drawn."""
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    model = None
    try:
        with torch.device("meta"):
            model = build()
    except Exception as exc:  # any failure only means: build it for real
        logger.debug("model_init cannot run on the meta device (%s: %s); the driver builds it for real",
                     type(exc).__name__, exc)
    finally:
        if model is None or is_skeleton(model):
            random.setstate(states[0])
            np.random.set_state(states[1])
            torch.set_rng_state(states[2])
    return model


#: The methods by which a model initialises its own weights, in torch's convention (``reset_parameters``) and
#: transformers' (``_init_weights`` and the calls that run it): what redoing the initialisation on each
#: shard of a model built on the meta device can redo (strategies/fsdp.py ``initialiser_methods``).
INIT_METHODS = frozenset({"reset_parameters", "_init_weights", "init_weights", "initialize_weights",
                          "_initialize_weights", "post_init"})


class InPlaceWrites(TorchDispatchMode):
    """Meanwhile, every in-place write to a tensor (``nn.init``'s draws, ``fill_``, a ``load_state_dict``'s
    ``copy_``), on any device, meta included: ``writes`` lists ``(storage key, the INIT_METHODS and
    ``__init__`` of the modules it ran inside)``, the second empty for a write from anywhere else (a
    ``model_init`` that sets weights itself after building the model)."""

    def __init__(self):
        super().__init__()
        self.writes: list[tuple[int, frozenset]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for i, argument in enumerate(func._schema.arguments):
            if argument.alias_info is not None and argument.alias_info.is_write:
                tensor = args[i] if i < len(args) else kwargs.get(argument.name)
                key = storage_key(tensor)
                if key is not None:
                    self.writes.append((key, _init_methods_running()))
        return func(*args, **kwargs)

    def outside(self, model: torch.nn.Module, methods: frozenset) -> list[str]:
        """The names of ``model``'s parameters and buffers whose last write was not inside ``methods`` (one
        that ``methods`` write again after, as transformers' ``_init_weights`` redraws what GPT-2's
        ``Conv1D.__init__`` drew, is theirs)."""
        last = dict(self.writes)
        beyond = {key for key, running in last.items() if not running & methods}
        return [name for name, tensor in (*model.named_parameters(), *model.named_buffers())
                if storage_key(tensor) in beyond]


def storage_key(tensor) -> int | None:
    """What tells a tensor's storage from another's (views share it), meta tensors' too; None for what has
    none."""
    try:
        return tensor.untyped_storage()._cdata if isinstance(tensor, torch.Tensor) else None
    except (RuntimeError, NotImplementedError):
        return None


def _init_methods_running() -> frozenset:
    """The INIT_METHODS and ``__init__`` of a module that run in the caller's stack."""
    import sys

    found, frame = set(), sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_name
        if (name in INIT_METHODS or name == "__init__") and isinstance(frame.f_locals.get("self"),
                                                                        torch.nn.Module):
            found.add(name)
        frame = frame.f_back
    return frozenset(found)


class FileSlice(NamedTuple):
    """Where a weight of a ``from_pretrained`` model lies: a safetensors file and the tensor's key in it."""

    path: str
    key: str
    shape: tuple[int, ...]


@contextlib.contextmanager
def weightless_loading(sources: dict | None = None):
    """Meanwhile, ``model_init`` builds a weightless skeleton even where it loads pretrained weights: for a
    rank whose weights come from another (FSDP's rank-0 way), or from the files read shard by shard.

    Everything is created under ``torch.device("meta")``, and transformers' ``from_pretrained`` -- which
    refuses a meta device context (it wants to load the weights) -- is called with ``device_map="meta"``, a
    mode it supports: its own loading path builds the model on meta, with the dtype, tied weights, renamed
    keys and adapters a real load gives (so the skeleton's parameters match rank 0's one for one, which a
    ``from_config`` rebuild cannot promise: ``dtype="auto"`` follows the files). That mode still reads every
    tensor from the files before moving it to meta; here each is made from its header instead (shape and
    dtype), so the files' data is never read on this rank. What ``model_init`` does after (PEFT's
    ``get_peft_model``, a new head) runs on meta too. Where transformers lacks the function this relies on
    (``core_model_loading._materialize_copy``, 5.x), the tensors are read once and dropped: slower, still
    never held.

    ``sources``, when given, is filled with ``id(tensor) -> (tensor, FileSlice)`` for each parameter and
    buffer of the skeleton that transformers set straight from one tensor of a safetensors file (a renamed
    key, a dtype cast): the weights a rank can later read slice by slice (``sources_by_name``). A weight that
    a conversion made from several tensors (fused experts, permuted heads), or one ``model_init`` made after
    (a new head, LoRA adapters), has none."""
    patches = []
    try:
        import transformers.modeling_utils as modeling_utils
    except ImportError:
        modeling_utils = None
    tags: dict = {}  # id(safetensors slice) -> (slice, FileSlice)
    made: dict = {}  # id(meta tensor made from a tagged slice) -> (tensor, FileSlice)
    if modeling_utils is not None:
        pretrained = modeling_utils.PreTrainedModel.from_pretrained.__func__

        def from_pretrained(cls, *args, **kwargs):
            kwargs["device_map"] = "meta"  # whatever was asked: this rank's weights come from elsewhere
            # transformers >= 5.25 kernelizes a loaded model by default where the `kernels` package is
            # installed, which refuses the meta device: a skeleton keeps torch's layers
            kwargs["use_kernels"] = False
            return pretrained(cls, *args, **kwargs)

        patches.append((modeling_utils.PreTrainedModel, "from_pretrained", classmethod(from_pretrained)))
        try:
            import transformers.core_model_loading as loading
        except ImportError:
            loading = None
        if loading is not None and callable(getattr(loading, "_materialize_copy", None)):
            header_only = _header_only(loading._materialize_copy, tags, made)
            patches.append((loading, "_materialize_copy", header_only))
            if sources is not None and callable(getattr(modeling_utils, "safe_open", None)) \
                    and callable(getattr(loading, "set_param_for_module", None)):
                patches.append((modeling_utils, "safe_open", _tagging_open(modeling_utils.safe_open, tags)))
                patches.append((loading, "set_param_for_module",
                                _recording_set(loading.set_param_for_module, made, sources)))
    saved = [(owner, name, vars(owner)[name]) for owner, name, _ in patches]
    try:
        for owner, name, value in patches:
            setattr(owner, name, value)
        with torch.device("meta"):
            yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def sources_by_name(model: torch.nn.Module, sources: dict) -> dict[str, FileSlice]:
    """Name -> FileSlice of each of ``model``'s parameters and buffers that ``weightless_loading(sources)``
    saw set from a file (the names as the model has them now, after whatever ``model_init`` did; a tensor
    it reshaped since, such as a resized embedding, has none)."""
    out = {}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        found = sources.get(id(tensor))
        if found is not None and found[0] is tensor and tuple(tensor.shape) == found[1].shape:
            out[name] = found[1]
    return out


class _TaggedFile:
    """A safetensors file handle whose slices are remembered with the file and key they come from."""

    def __init__(self, handle, path: str, tags: dict):
        self._handle, self._path, self._tags = handle, os.path.abspath(os.fspath(path)), tags

    def get_slice(self, key):
        view = self._handle.get_slice(key)
        self._tags[id(view)] = (view, FileSlice(self._path, key, tuple(view.get_shape())))
        return view

    def __getattr__(self, name):
        return getattr(self._handle, name)

    def __enter__(self):
        self._handle.__enter__()
        return self

    def __exit__(self, *exc):
        return self._handle.__exit__(*exc)


def _tagging_open(safe_open, tags: dict):
    def tagging_open(path, *args, **kwargs):
        return _TaggedFile(safe_open(path, *args, **kwargs), path, tags)
    return tagging_open


def _recording_set(set_param_for_module, made: dict, sources: dict):
    """transformers' ``set_param_for_module``; where the value set is a meta tensor made from one file's
    tensor, the parameter (or buffer) now in the model is recorded with that tensor's FileSlice."""

    def set_param(model, target_name, param_value, *args, **kwargs):
        module_path, _, name = target_name.rpartition(".")
        module = model.get_submodule(module_path) if module_path else model
        before = getattr(module, name, None)
        set_param_for_module(model, target_name, param_value, *args, **kwargs)
        found = made.get(id(param_value))
        now = getattr(module, name, None)
        fresh = now is not before and isinstance(now, torch.Tensor)
        if found is not None and found[0] is param_value and fresh:
            sources[id(now)] = (now, found[1])
    return set_param


def _header_only(materialise, tags: dict | None = None, made: dict | None = None):
    """transformers' ``_materialize_copy(tensor, device, dtype)``, but a safetensors slice bound for the meta
    device becomes an empty meta tensor of its shape and dtype, without reading its bytes (remembered in
    ``made`` with the slice's FileSlice where ``tags`` knows it)."""
    from safetensors.torch import _getdtype

    def materialise_copy(tensor, device=None, dtype=None):
        if device is not None and torch.device(device).type == "meta" and hasattr(tensor, "get_shape"):
            dtype = dtype or _getdtype(tensor.get_dtype())
            out = torch.empty(tensor.get_shape(), dtype=dtype, device="meta")
            tagged = tags.get(id(tensor)) if tags is not None else None
            if tagged is not None and tagged[0] is tensor:
                made[id(out)] = (out, tagged[1])
            return out
        return materialise(tensor, device, dtype)
    return materialise_copy
