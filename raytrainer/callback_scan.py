"""Whether a callback can change the run's flow, read from its code.

On a Ray run every rank calls the callbacks, and a decision one rank takes (stop, save, evaluate, log) must
be every rank's in the same step. Where a callback might decide differently on different ranks, the ranks
agree on the control flags after each step's events: one all-reduce and one host sync per step (a fifth
of a 2-worker CPU run's throughput on a small model). A callback that never writes a control flag needs no
agreement, and most user callbacks only look: they log, time, record, print.

``leaves_control_alone(callback)`` reads the bytecode of every function the callback's class defines
(methods, helpers, properties, nested functions and lambdas) and says yes only when none of it

- stores or deletes an attribute named as a control flag, or ``control``;
- reads an attribute named ``control`` or one of ``TrainerControl``'s resetting methods, or the names
  ``setattr``, ``delattr`` or ``TrainerControl``;
- uses an event's ``control`` argument other than to read a flag from it or to return it unchanged;
- returns from an event anything but ``None`` or that ``control`` (a mapping of flags is a decision);

and no event takes ``*args``, is not a plain function (a ``functools.partial``, a builtin) or is set on the
instance. It cannot see into functions defined outside the class: a callback that changes the flags
through one (a module's function given the trainer) declares ``same_on_every_rank = False``.
"""

from __future__ import annotations

import dataclasses
import dis
import functools
import inspect
import types

from transformers.trainer_callback import TrainerCallback, TrainerControl

_FLAGS = frozenset(f.name for f in dataclasses.fields(TrainerControl))
_WRITES = _FLAGS | {"control"}
_READS = frozenset({"control", "_new_training", "_new_epoch", "_new_step"})
_NAMES = frozenset({"setattr", "delattr", "TrainerControl"})


def leaves_control_alone(callback) -> bool:
    if any(name.startswith("on_") for name in getattr(callback, "__dict__", {})):
        return False  # an event set on the instance
    return _class_leaves_control_alone(type(callback))


@functools.cache
def _class_leaves_control_alone(cls: type) -> bool:
    if "__getattr__" in vars(cls) or "__getattribute__" in vars(cls):
        return False
    for klass in cls.__mro__:
        if klass in (TrainerCallback, object):
            continue
        for name, attr in vars(klass).items():
            event = name.startswith("on_")
            functions = _functions(attr)
            if functions is None:  # a callable that is not a Python function: its code is not readable
                return False
            if not all(_code_leaves_control_alone(f.__code__, event) for f in functions):
                return False
    return True


def _functions(attr) -> list[types.FunctionType] | None:
    """The Python functions behind a class attribute ([] for data); None for another callable."""
    if isinstance(attr, (staticmethod, classmethod)):
        attr = attr.__func__
    if isinstance(attr, property):
        return [f for f in (attr.fget, attr.fset, attr.fdel) if f is not None]
    if isinstance(attr, types.FunctionType):
        return [attr]
    return None if callable(attr) else []


def _names(argval) -> tuple:
    return argval if isinstance(argval, tuple) else (argval,)


def _code_leaves_control_alone(code: types.CodeType, event: bool) -> bool:
    control = None
    if event:
        if code.co_flags & inspect.CO_VARARGS or code.co_argcount < 4:
            return False
        control = code.co_varnames[3]  # (self, args, state, control, **kwargs)
        if control in code.co_cellvars:  # a nested function uses it
            return False
    instructions = list(dis.get_instructions(code))
    for i, ins in enumerate(instructions):
        after = instructions[i + 1] if i + 1 < len(instructions) else None
        if ins.opname in ("STORE_ATTR", "DELETE_ATTR") and ins.argval in _WRITES:
            return False
        if ins.opname in ("LOAD_ATTR", "LOAD_METHOD") and ins.argval in _READS:
            return False
        if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME", "LOAD_DEREF") and ins.argval in _NAMES:
            return False
        if control is not None and ins.opname.startswith("LOAD_FAST") and control in _names(ins.argval):
            # only ``return control`` or ``control.<flag>`` (a pair of locals loaded at once: another use)
            read = after is not None and (after.opname == "RETURN_VALUE"
                                          or (after.opname == "LOAD_ATTR" and after.argval in _FLAGS))
            if ins.argval != control or not read:
                return False
        if ins.opname in ("STORE_FAST", "DELETE_FAST") and control is not None and ins.argval == control:
            return False
        if event and ins.opname == "RETURN_CONST" and ins.argval is not None:
            return False
        if event and ins.opname == "RETURN_VALUE":
            before = instructions[i - 1] if i else None
            returns_none = before is not None and before.opname == "LOAD_CONST" and before.argval is None
            returns_control = before is not None and before.opname.startswith("LOAD_FAST") \
                and before.argval == control
            if not (returns_none or returns_control):
                return False
    return all(_code_leaves_control_alone(const, event=False)
               for const in code.co_consts if isinstance(const, types.CodeType))
