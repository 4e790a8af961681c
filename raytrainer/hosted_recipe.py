"""How each rank of a hosted trainer's group builds it (raytrainer/hosted.py): the ``Recipe`` the driver
pickles once -- the trainer class and its constructor's arguments -- and the arguments turned back into
their original class on the rank (no Ray fields: transformers' own process view, which accelerate sets up
from the rank's torchrun-like environment)."""

from __future__ import annotations

import contextvars
import dataclasses
import inspect
import itertools
import sys
import uuid
from typing import Any

import cloudpickle

from raytrainer.args import RayArgumentsMixin, token_withheld

#: True while a rank of a worker group builds its trainer (worker/hosted_sharding.py): the trainer is one rank
#: of a run, and the rank's layer (worker/hosted.py) attaches raytrainer's additions, not the constructor.
building_on_a_rank = contextvars.ContextVar("building_on_a_rank", default=False)


#: Packages that transformers, evaluate and datasets create at run time from code under ``HF_HOME/modules``
#: (a Hub model's ``trust_remote_code`` classes, an ``evaluate.load`` metric, a data set's loading script).
#: A worker on another node has no such folder, and one on this node not on its ``sys.path``.
DYNAMIC_MODULE_PACKAGES = ("transformers_modules", "evaluate_modules", "datasets_modules")


def ship_dynamic_modules() -> None:
    """Let the classes and functions of those packages travel by value (their source with them), as
    cloudpickle does for ``__main__``: a ``compute_metrics`` holding an ``evaluate`` metric then unpickles on
    every worker (transformers' example scripts load theirs that way)."""
    for name in DYNAMIC_MODULE_PACKAGES:
        module = sys.modules.get(name)
        if module is not None:
            cloudpickle.register_pickle_by_value(module)


def base_config_class(args) -> type:
    """The arguments class the ranks build: the first class after ``RayArgumentsMixin`` in the MRO that is
    not itself a subclass of it (``trl.SFTConfig`` for ``raytrainer.trl.SFTConfig``)."""
    return next(c for c in type(args).__mro__
                if c is not RayArgumentsMixin and not issubclass(c, RayArgumentsMixin)
                and dataclasses.is_dataclass(c))


def plain_config(args, **overrides):
    """``args`` as an instance of its base class (no Ray fields): transformers' own process view, set up by
    accelerate from the environment it runs in."""
    import warnings

    cls = base_config_class(args)
    given = args.given_values()
    values = {f.name: given[f.name] for f in dataclasses.fields(cls) if f.init}
    if "parallelism_config" in values:  # as given it may be a dict or JSON: accelerate takes the object
        values["parallelism_config"] = getattr(args, "parallelism_config", None)
    values.update(overrides)
    if values.get("deepspeed"):
        from raytrainer.strategies.deepspeed_config import with_precision_sections

        values["deepspeed"] = with_precision_sections(values["deepspeed"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers warned when the user made them
        plain = cls(**values)
    for name in _own_fields(type(args)):  # a script's own fields (``class MyArgs(TrainingArguments)``)
        object.__setattr__(plain, name, given.get(name, getattr(args, name)))
    return plain


def _own_fields(cls: type) -> list[str]:
    """The dataclass fields the classes of a script add to raytrainer's arguments classes (read on the ranks
    by the script's own trainer subclass, as ``self.args.<field>``)."""
    fields = {f.name for f in dataclasses.fields(cls)}
    return [name for klass in cls.__mro__
            if issubclass(klass, RayArgumentsMixin) and not klass.__module__.startswith("raytrainer")
            for name in vars(klass).get("__annotations__", {}) if name in fields]


def constructor_signature(cls: type) -> inspect.Signature:
    """The signature ``cls``'s constructor takes the trainer's arguments by. A constructor that passes its
    positional arguments through (``def __init__(self, *args, scale=1.0, **kwargs): super().__init__(*args,
    **kwargs)``, or a wrapper that counts or logs) takes them by the first constructor up its classes that
    names them, with the keyword-only parameters of those on the way. Otherwise a subclass given
    ``(model, args)`` by position had no ``args`` to find, and ran in this process whatever its
    ``num_workers``."""
    kinds = inspect.Parameter
    extra: dict[str, inspect.Parameter] = {}  # the keyword-only parameters of the pass-through ones
    for klass in cls.__mro__:
        init = vars(klass).get("__init__")
        if init is None:
            continue
        signature = inspect.signature(init)
        params = list(signature.parameters.values())
        if not any(p.kind is kinds.VAR_POSITIONAL for p in params):
            if not extra:
                return signature
            named = [p for p in params if p.kind is not kinds.VAR_KEYWORD and p.name not in extra]
            rest = [p for p in params if p.kind is kinds.VAR_KEYWORD] or [
                inspect.Parameter("kwargs", kinds.VAR_KEYWORD)]
            return signature.replace(parameters=[*named, *extra.values(), *rest])
        extra.update((p.name, p) for p in params if p.kind is kinds.KEYWORD_ONLY and p.name not in extra)
    return inspect.signature(cls.__init__)


def _find_args(signature: inspect.Signature, bound: inspect.BoundArguments, name: str = "args"):
    """The constructor's argument ``name`` as given, by name or inside its ``**kwargs``; None if absent."""
    if name in bound.arguments and name in signature.parameters:
        return bound.arguments[name]
    for var, param in signature.parameters.items():
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            return bound.arguments.get(var, {}).get(name)
    return None


@dataclasses.dataclass
class Recipe:
    """How each rank builds the trainer: the class and the constructor's arguments, pickled once on the
    driver (``payload``); ``key`` names this trainer, so a rank builds it once and keeps it across calls.

    The payload goes into Ray's object store once per trainer (``for_command``); each command carries this
    recipe without it (a few hundred bytes) and the payload's reference, which a rank fetches only when it
    builds the trainer: at the first command, and on the new workers after a restart."""

    key: str
    payload: bytes | None
    use_gpu: bool
    ref: list | None = dataclasses.field(default=None, repr=False)  # [ObjectRef] of the payload
    #: the driver's edits of the trainer's callback list (raytrainer/hosted_callbacks.py), pickled
    edits: bytes | None = None
    #: ``trainer.args`` as the script changed it after the constructor (``trainer.args.seed = 314``),
    #: pickled: the ranks build the trainer with it in place of the payload's (``with_arguments``)
    arguments: bytes | None = None
    #: the driver's: the arguments as this recipe holds them (``arguments_mark``); not sent to the ranks
    mark: bytes = dataclasses.field(default=b"", repr=False, compare=False)

    _numbers = itertools.count()

    @classmethod
    def make(cls, trainer_cls: type, args: tuple, kwargs: dict, edits: tuple = ()) -> Recipe:
        signature = constructor_signature(trainer_cls)
        targs = _find_args(signature, signature.bind(None, *args, **kwargs))
        with token_withheld(targs):  # the hub token stays on the driver, which pushes
            payload = _pickled(trainer_cls, args, kwargs)
        return cls(_new_key(), payload, bool(targs.use_gpu), edits=_pickled_edits(edits),
                   mark=arguments_mark(targs))

    def with_arguments(self, targs) -> Recipe:
        """This recipe with the arguments ``targs`` as they are now, in place of those its payload holds
        (the script set a field after the constructor): a new trainer (new ``key``), from the same payload
        in the object store, with the trained weights and state, as after an edit of the callback list."""
        with token_withheld(targs):
            arguments = cloudpickle.dumps(targs)
        return dataclasses.replace(self, key=_new_key(), arguments=arguments, mark=arguments_mark(targs))

    def with_edits(self, edits: tuple) -> Recipe:
        """This recipe, its trainer's callback list edited by ``edits`` (``hosted_callbacks.Edit``) after
        it is built; a new trainer (new ``key``), from the same payload in the object store."""
        return dataclasses.replace(self, key=_new_key(), edits=_pickled_edits(edits))

    def callback_edits(self) -> tuple:
        """The driver's edits of the callback list, for a rank that has just built the trainer."""
        from raytrainer.import_scratch import imports_in_own_folder

        if self.edits is None:
            return ()
        with imports_in_own_folder():
            return cloudpickle.loads(self.edits)

    def for_command(self) -> tuple[bytes, list]:
        """This recipe without its payload, pickled, and ``[reference]`` of the payload, put into the object
        store at the first command (the driver's recipe holds it, so it lives as long as the trainer). The
        reference travels in the ``Spec``, where Ray's serializer tracks it, never inside pickled bytes."""
        import ray

        if self.ref is None:
            self.ref = [ray.put(self.payload)]
        return cloudpickle.dumps(dataclasses.replace(self, payload=None, ref=None, mark=b"")), self.ref

    def fetched(self, ref: list) -> Recipe:
        """The recipe with its payload, fetched from the object store (a rank about to build the trainer)."""
        import ray

        return self if self.payload is not None else dataclasses.replace(self, payload=ray.get(ref[0]))

    def unpack(self, world_size: int = 1) -> tuple[type, tuple, dict, Any, Any]:
        """The class and the constructor's arguments, ``args=`` as an instance of its base class (no Ray
        fields: transformers' own process view, which accelerate sets up from this rank's environment), that
        instance, and the arguments as given (with the Ray fields: ``storage_path``...)."""
        from raytrainer.import_scratch import imports_in_own_folder

        with imports_in_own_folder():
            trainer_cls, args, kwargs = cloudpickle.loads(self.payload)
            changed = None if self.arguments is None else cloudpickle.loads(self.arguments)
        signature = constructor_signature(trainer_cls)
        if changed is not None:  # trainer.args as the script changed it after the constructor
            args, kwargs = _replace_args(signature, args, kwargs, changed)
        targs = _find_args(signature, signature.bind(None, *args, **kwargs))
        overrides = {"push_to_hub": False}  # the driver pushes (raytrainer/hosted.py)
        if not self.use_gpu:
            overrides["use_cpu"] = True  # a CPU worker, whatever CUDA this node has
            mesh = getattr(targs, "parallelism_config", None)
            if mesh is not None and mesh.dp_shard_enabled and not targs.fsdp:
                # a mesh that shards is FSDP's, as raytrainer's strategies read it (worker/hosted_mesh.py)
                overrides["fsdp"] = "full_shard"
        if getattr(targs, "enable_jit_checkpoint", False):
            # transformers' SIGTERM handler needs the main thread, a rank trains on another; every rank
            # saves on a SIGTERM anyway (worker/signals.py)
            overrides["enable_jit_checkpoint"] = False
        if getattr(targs, "elastic", False):  # the global batch of max workers, on this many
            from raytrainer.elastic import batch_at

            overrides["per_device_train_batch_size"], overrides["gradient_accumulation_steps"] = (
                batch_at(targs, world_size))
        plain = plain_config(targs, **overrides)
        args, kwargs = _replace_args(signature, args, kwargs, plain)
        return trainer_cls, args, kwargs, plain, targs


def arguments_mark(targs) -> bytes:
    """The arguments' values as the ranks would build them (``given_values``), pickled: what tells that the
    script changed one after the constructor. The hub token is left out (it stays on the driver)."""
    with token_withheld(targs):
        return cloudpickle.dumps(targs.given_values())


def module_mark(module) -> tuple | None:
    """What a script can change in a module between the constructor and a call, cheaply (no values read):
    each parameter's and buffer's name, shape, dtype, device, ``requires_grad``, storage and in-place writes
    (the tensor's version counter, which ``load_state_dict``, ``fill_`` and an optimizer step move), and a
    transformers config's values. None for anything but a module."""
    import torch

    if not isinstance(module, torch.nn.Module):
        return None
    tensors = [*module.named_parameters(remove_duplicate=False),
               *module.named_buffers(remove_duplicate=False)]
    config = getattr(module, "config", None)
    try:
        config = config.to_json_string(use_diff=False) if hasattr(config, "to_json_string") else repr(config)
    except Exception:  # a value JSON cannot write: the values' repr
        config = repr(getattr(config, "__dict__", config))
    return (tuple((name, tuple(t.shape), t.dtype, t.device, t.requires_grad, t.data_ptr(), _writes(t))
                  for name, t in tensors), config)


def _writes(tensor) -> int:
    """The tensor's version counter; -1 for one made under ``torch.inference_mode``, which keeps none."""
    try:
        return tensor._version
    except RuntimeError:
        return -1


def _new_key() -> str:
    return f"{uuid.uuid4().hex[:8]}-{next(Recipe._numbers)}"


def _pickled_edits(edits: tuple) -> bytes | None:
    """The driver's edits of the callback list for the workers; on failure, the error names the callback."""
    try:
        return cloudpickle.dumps(tuple(edits)) if edits else None
    except Exception as exc:
        culprit = next((e.added for e in edits if not _picklable(e.added)), edits)
        raise ValueError(
            f"add_callback({culprit!r}): the callback cannot be pickled to send it to the Ray workers "
            f"({type(exc).__name__}: {exc}). Define callback classes at module level and keep locks, "
            "open files and generators out of them, or give it `on_driver = True` to run it in this "
            "process on rank 0's events.") from exc


def _replace_args(signature: inspect.Signature, args: tuple, kwargs: dict, new,
                  name: str = "args") -> tuple[tuple, dict]:
    """The constructor's arguments with the argument ``name`` (``args=``) replaced by ``new``."""
    names = [n for n in signature.parameters if n != "self"]
    if name in names and names.index(name) < len(args):
        args = list(args)
        args[names.index(name)] = new
        return tuple(args), kwargs
    return args, {**kwargs, name: new}


def _pickled(trainer_cls: type, args: tuple, kwargs: dict) -> bytes:
    """The constructor's class and arguments for the workers; on failure, the error names the argument."""
    try:
        return cloudpickle.dumps((trainer_cls, args, kwargs))
    except Exception as exc:
        owner = trainer_cls.__name__
        named = [*((f"{owner}(...) argument {i}", v) for i, v in enumerate(args)),
                 *((f"{owner}.{k}", v) for k, v in kwargs.items())]
        culprit = next((_culprit(label, value) for label, value in named if not _picklable(value)),
                       f"{owner}(...)'s arguments")
        raise ValueError(
            f"{culprit} cannot be pickled to send it to the Ray workers ({type(exc).__name__}: {exc}). "
            "Define functions and classes at module level, and keep locks, open files and generators out of "
            "models, datasets and callbacks (or give the model as a path or model_init, which the workers "
            "call)."
        ) from exc


def _culprit(label: str, value) -> str:
    """``label`` with what the value is, or for a list (the callbacks) its first element that does not
    pickle, with its type."""
    if isinstance(value, (list, tuple)):
        for i, element in enumerate(value):
            if not _picklable(element):
                return f"{label}[{i}] ({type(element).__name__})"
    return f"{label} ({getattr(value, '__qualname__', None) or type(value).__name__})"


def _picklable(value) -> bool:
    try:
        cloudpickle.dumps(value)
        return True
    except Exception:
        return False
