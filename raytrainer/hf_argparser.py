"""`ArgumentParser`: transformers' `HfArgumentParser`, with three additions and four fixes.

    parser = ArgumentParser((ModelArguments, TrainingArguments))
    model_args, training_args = parser.parse_args_into_dataclasses()

Everything transformers' parser does (`--field_name` and `--field-name`, `--flag` / `--no_flag` bools,
Enum and Literal choices, `list[X]` with `nargs="+"`, args files, `parse_dict`, `parse_json_file`,
`parse_yaml_file`, an extra `argparse.Namespace` for arguments added by hand) is its own code. raytrainer
adds only what that code does not do:

- a `dict` field of a user's dataclass takes a JSON object on the command line (transformers' parser would
  call `dict("{...}")`; its own `TrainingArguments` declares such fields `dict | str` and parses the string
  itself);
- `parse_dict` (and so the JSON and YAML files) converts the strings of bool, int and float fields as the
  command line would: PyYAML reads `learning_rate: 5e-4` as the string "5e-4" (YAML 1.1 wants a dot);
- `python app.py config.json` (or `.yaml` / `.yml`), that file as the only argument, reads the arguments
  from the file, as transformers' example scripts do by hand before calling the parser.

The fixes, each to something transformers' parser gets wrong on a dataclass that is not its own: field
metadata keys that are not argparse's (another library's) are not handed to
argparse, which would refuse them; a `list[X]` field declared with `default=` keeps its default; and
`X | str | None` in an order other than transformers' `None | str | X`, or `dict | str`, is read as a string
(as transformers reads its own such fields) instead of raising. And one on transformers' own arguments: a
`str | bool` field (`include_num_input_tokens_seen`) takes its strings (`non_padding`), which transformers'
parser refuses, reading it as a bool; a bool word (`true`, `no`...) or the bare flag is still a bool.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import sys
import types
from typing import Any, Union, get_args, get_origin, get_type_hints

from transformers.hf_argparser import HfArgumentParser as _TransformersParser
from transformers.hf_argparser import string_to_bool

__all__ = ["ArgumentParser", "HfArgumentParser", "string_to_bool"]

_CONFIG_SUFFIXES = (".json", ".yaml", ".yml")
# The metadata keys argparse takes (plus transformers' "aliases"); others are left alone.
_ARGPARSE_KEYS = ("help", "choices", "metavar", "nargs", "const", "required", "type", "default", "aliases")


def _json_object(value: str) -> dict:
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {value!r} ({exc.msg})") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {value!r}")
    return parsed


def _without_none(hint: Any) -> Any:
    """``X`` for ``Optional[X]``; any other annotation as it is."""
    if get_origin(hint) in (Union, types.UnionType):
        members = [m for m in get_args(hint) if m is not type(None)]
        if len(members) == 1:
            return members[0]
    return hint


def _read_as_string(hint: Any) -> bool:
    """A union with str that transformers' parser mishandles: `X | str | None` in an order other than its
    own `None | str | X` (a TypeError), or `dict | str` (it would call `dict("...")`)."""
    members = get_args(hint) if get_origin(hint) in (Union, types.UnionType) else ()
    others = [m for m in members if m not in (str, type(None))]
    if str not in members or not others:
        return False
    return (len(members) > 2 and type(None) in members) or any(_is_dict(m) for m in others)


def _bool_or_string(value: str) -> bool | str:
    """A `str | bool` field's value: True / False for a bool word (as transformers reads a bool flag), else
    the string."""
    try:
        return string_to_bool(value)
    except argparse.ArgumentTypeError:
        return value


def _is_dict(hint: Any) -> bool:
    return hint is dict or get_origin(hint) is dict


class ArgumentParser(_TransformersParser):
    """transformers' `HfArgumentParser` (see the module docstring for what raytrainer adds)."""

    @staticmethod
    def _parse_dataclass_field(parser: argparse.ArgumentParser, field: dataclasses.Field):
        field = copy.copy(field)  # transformers' parser rewrites field.type; keep the class's Field intact
        metadata = {k: v for k, v in field.metadata.items() if k in _ARGPARSE_KEYS}
        if field.default is not dataclasses.MISSING and not isinstance(field.default, str):
            # transformers drops the default of a `list[X]`-typed field declared with `default=` (not a
            # factory): without this, no flag gives None, not the default. (A string default, as
            # transformers' own `debug: str | list[DebugOption] = ""`, would be run through X by argparse.)
            metadata.setdefault("default", field.default)
        if field.type == str | bool or field.type == bool | str:
            field.type = _bool_or_string  # `--field`, `--field no`, `--field non_padding`
            metadata.setdefault("nargs", "?")
            metadata.setdefault("const", True)
        field.metadata = types.MappingProxyType(metadata)
        if _is_dict(_without_none(field.type)):
            field.type = _json_object  # transformers' fallback branch hands field.type to argparse as is
        elif _read_as_string(field.type) or dataclasses.is_dataclass(_without_none(field.type)):
            # as transformers reads its own `None | str | X` fields; a dataclass-typed field (accelerate's
            # ParallelismConfig) as its JSON, which the arguments' __post_init__ builds the object from
            field.type = str | None
        _TransformersParser._parse_dataclass_field(parser, field)

    def parse_args_into_dataclasses(self, args=None, return_remaining_strings=False, **kwargs) -> tuple:
        argv = sys.argv[1:] if args is None else list(args)
        if len(argv) == 1 and argv[0].lower().endswith(_CONFIG_SUFFIXES) and not argv[0].startswith("-"):
            path = argv[0]
            read = self.parse_json_file if path.lower().endswith(".json") else self.parse_yaml_file
            outputs = read(path)
            return (*outputs, []) if return_remaining_strings else outputs
        return super().parse_args_into_dataclasses(args, return_remaining_strings, **kwargs)

    def parse_dict(self, args: dict[str, Any], allow_extra_keys: bool = False) -> tuple:
        return super().parse_dict(self._coerced(args or {}), allow_extra_keys=allow_extra_keys)

    def _coerced(self, args: dict[str, Any]) -> dict[str, Any]:
        """``args`` with the string values of bool, int and float fields converted as on the command line
        (a value that does not convert is left for the dataclass to refuse)."""
        hints: dict[str, Any] = {}
        for dtype in self.dataclass_types:
            hints.update(get_type_hints(dtype))
        converted = dict(args)
        for name, value in args.items():
            target = _without_none(hints.get(name))
            if not isinstance(value, str) or target not in (bool, int, float):
                continue
            try:
                converted[name] = string_to_bool(value) if target is bool else target(value)
            except (ValueError, argparse.ArgumentTypeError):
                pass
        return converted


# The name used in Hugging Face scripts, so that they only need their import changed.
HfArgumentParser = ArgumentParser
