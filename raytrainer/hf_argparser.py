"""`ArgumentParser`: fill dataclasses such as `TrainingArguments` from the command line, a dict, or a
JSON/YAML file, with the semantics of `HfArgumentParser` as in the Hugging Face Trainer docs.

    parser = ArgumentParser((ModelArguments, TrainingArguments))
    model_args, training_args = parser.parse_args_into_dataclasses()

Each dataclass field becomes `--field_name` (and `--field-name`):

- `bool` fields take `--flag` (True) or `--flag true/false/yes/no/1/0`; those that default to True
  also get `--no_flag`;
- `Enum` and `Literal` fields get `choices`;
- `Optional[X]` is parsed as `X`; `X | str` as `X` when X is an Enum or a list, else as a string
  that the dataclass converts itself (e.g. a JSON string for `dict | str`);
- `list[X]` fields take one or more values (`nargs="+"`); `dict` fields take a JSON object;
- fields declared with `init=False` or whose name starts with "_" are not arguments.

`python app.py config.json` (or `.yaml` / `.yml`), with that file as the only argument, reads the
arguments from the file.
"""

import argparse
import dataclasses
import json
import os
import sys
import types
from collections.abc import Callable, Iterable
from enum import Enum
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import yaml

__all__ = ["ArgumentParser", "HfArgumentParser", "string_to_bool"]

_TRUE = ("yes", "true", "t", "y", "1")
_FALSE = ("no", "false", "f", "n", "0")
_CONFIG_SUFFIXES = (".json", ".yaml", ".yml")
# The field metadata keys handed to argparse; others (say, another library's) are left alone.
_ARGPARSE_KEYS = ("help", "choices", "metavar", "nargs", "const", "required", "type", "default")


def string_to_bool(value: str | bool) -> bool:
    """Parse yes/no, true/false, t/f, y/n, 1/0 (any case) into a bool."""
    if isinstance(value, bool):
        return value
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise argparse.ArgumentTypeError(
        f"expected a truth value, got {value!r}: use one of yes/no, true/false, t/f, y/n, 1/0"
    )


def _json_object(value: str) -> dict:
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {value!r} ({exc.msg})") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {value!r}")
    return parsed


def _choice_type(choices: Iterable) -> Callable[[str], Any]:
    """Map a choice's string form back to the choice (so that Literal[1, 2] gives ints)."""
    by_string = {str(choice): choice for choice in choices}
    return lambda text: by_string.get(text, text)


def _is_enum(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, Enum)


def _is_list(tp: Any) -> bool:
    return tp is list or get_origin(tp) is list


def _is_dict(tp: Any) -> bool:
    return tp is dict or get_origin(tp) is dict


def _argument_type(name: str, hint: Any) -> Any:
    """Reduce a field's annotation to the single type its command-line value is parsed as."""
    if get_origin(hint) not in (Union, types.UnionType):
        return hint
    members = [m for m in get_args(hint) if m is not type(None)]
    if len(members) == 1:
        return _argument_type(name, members[0])
    for preferred in (_is_enum, _is_list):
        for member in members:
            if preferred(member):
                return member
    if str in members:
        return str
    raise TypeError(
        f"field {name!r}: cannot parse {hint} from the command line; use Optional[X] or X | str "
        "where X is one type"
    )


def _field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _argument_kwargs(f: dataclasses.Field, hint: Any) -> dict[str, Any]:
    """The add_argument keyword arguments for one dataclass field."""
    tp = _argument_type(f.name, hint)
    default = _field_default(f)
    kwargs: dict[str, Any] = {}
    if tp is bool:
        kwargs.update(type=string_to_bool, nargs="?", const=True)
        default = False if default is dataclasses.MISSING else default
    elif get_origin(tp) is Literal or _is_enum(tp):
        choices = list(get_args(tp)) if get_origin(tp) is Literal else [m.value for m in tp]
        kwargs.update(choices=choices, type=_choice_type(choices))
    elif _is_list(tp):
        inner = _argument_type(f.name, get_args(tp)[0]) if get_args(tp) else str
        if _is_enum(inner):
            inner = _choice_type([m.value for m in inner])
        kwargs.update(type=inner, nargs="+")
    elif _is_dict(tp):
        kwargs.update(type=_json_object)
    elif callable(tp) and tp is not Any:
        kwargs.update(type=tp)
    if default is dataclasses.MISSING:
        kwargs["required"] = True
    else:
        kwargs["default"] = default
    kwargs.update({k: v for k, v in f.metadata.items() if k in _ARGPARSE_KEYS})
    return kwargs


def _cli_fields(dtype: type, python_only: bool = False) -> list[tuple[dataclasses.Field, Any]]:
    """The fields of `dtype` that are arguments, each with its resolved annotation (with `python_only`,
    also those marked ``cli: False``, which take Python objects: a dict may hold them)."""
    try:
        hints = get_type_hints(dtype)
    except NameError as exc:
        raise RuntimeError(
            f"cannot resolve the type annotations of {dtype.__name__} ({exc}); define the dataclass at "
            "module level with importable types"
        ) from exc
    return [(f, hints[f.name]) for f in dataclasses.fields(dtype) if f.init and not f.name.startswith("_")
            and (python_only or f.metadata.get("cli", True))]


def _coerce(value: Any, hint: Any, name: str) -> Any:
    """Convert a string from a dict/JSON/YAML config the way the command line would (e.g. YAML's
    "5e-5" stays a string, but a float field wants 5e-05). Other values are left to the dataclass."""
    if not isinstance(value, str):
        return value
    tp = _argument_type(name, hint)
    try:
        if tp is bool:
            return string_to_bool(value)
        if tp in (int, float):
            return tp(value)
    except (ValueError, argparse.ArgumentTypeError):
        pass
    return value


class ArgumentParser(argparse.ArgumentParser):
    """An `argparse.ArgumentParser` whose arguments are the fields of one or more dataclasses.

    Args:
        dataclass_types: a dataclass type or several; parsing returns one instance of each, in order.
        **kwargs: passed to `argparse.ArgumentParser` (the default help formatter shows defaults).

    Arguments added with `add_argument` after construction come back as one extra
    `argparse.Namespace` after the dataclasses. A dataclass with an `_argument_group_name` class
    attribute gets its own group in `--help`.
    """

    def __init__(self, dataclass_types: type | Iterable[type] | None = None, **kwargs: Any):
        kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        super().__init__(**kwargs)
        if dataclass_types is None:
            dataclass_types = []
        elif dataclasses.is_dataclass(dataclass_types) or not isinstance(dataclass_types, Iterable):
            dataclass_types = [dataclass_types]
        self.dataclass_types = list(dataclass_types)
        for dtype in self.dataclass_types:
            self._add_dataclass_arguments(dtype)

    def _add_dataclass_arguments(self, dtype: type) -> None:
        group_name = getattr(dtype, "_argument_group_name", None)
        target = self.add_argument_group(group_name) if group_name else self
        for f, hint in _cli_fields(dtype):
            names = [f"--{f.name}"]
            if "_" in f.name:
                names.append(f"--{f.name.replace('_', '-')}")
            aliases = f.metadata.get("aliases", [])
            names += [aliases] if isinstance(aliases, str) else list(aliases)
            kwargs = _argument_kwargs(f, hint)
            target.add_argument(*names, **kwargs)
            # The negative flag comes after the positive one, which owns the destination's default.
            if kwargs.get("type") is string_to_bool and kwargs.get("default") is True:
                negatives = [f"--no_{f.name}"]
                if "_" in f.name:
                    negatives.append(f"--no-{f.name.replace('_', '-')}")
                target.add_argument(
                    *negatives,
                    action="store_false",
                    dest=f.name,
                    default=argparse.SUPPRESS,
                    help=f"Set {f.name} to False.",
                )

    # --- Parsing -----------------------------------------------------------------------------------------

    def parse_args_into_dataclasses(
        self,
        args: list[str] | None = None,
        return_remaining_strings: bool = False,
        look_for_args_file: bool = True,
        args_filename: str | os.PathLike | None = None,
        args_file_flag: str | None = None,
    ) -> tuple:
        """Parse command-line strings into one instance of each dataclass.

        Args:
            args: the strings to parse; defaults to `sys.argv[1:]`. A single `*.json`, `*.yaml` or
                `*.yml` path is read as a config file instead.
            return_remaining_strings: also return the strings no argument consumed; otherwise they
                are an error.
            look_for_args_file: prepend the arguments found in `<script>.args` beside the running
                script, when that file exists.
            args_filename: read this file instead of `<script>.args`.
            args_file_flag: a flag (e.g. "--args_file") naming more args files on the command line;
                it may be repeated, and later files win.

        Returns:
            The dataclass instances in order, then a Namespace with any extra arguments (when
            arguments were added by hand), then the remaining strings (when asked for).
        """
        argv = list(sys.argv[1:] if args is None else args)
        if len(argv) == 1 and argv[0].lower().endswith(_CONFIG_SUFFIXES) and not argv[0].startswith("-"):
            outputs = self._parse_config_file(argv[0])
            return (*outputs, []) if return_remaining_strings else outputs

        argv = self._read_args_files(argv, look_for_args_file, args_filename, args_file_flag)
        namespace, remaining = self.parse_known_args(args=argv)
        values = vars(namespace)
        outputs: list[Any] = []
        for dtype in self.dataclass_types:
            names = [f.name for f, _ in _cli_fields(dtype)]
            outputs.append(dtype(**{name: values.pop(name) for name in names if name in values}))
        if values:
            outputs.append(argparse.Namespace(**values))
        if return_remaining_strings:
            return (*outputs, remaining)
        if remaining:
            raise ValueError(f"Some arguments are not used by the ArgumentParser: {remaining}")
        return tuple(outputs)

    def _read_args_files(
        self,
        argv: list[str],
        look_for_args_file: bool,
        args_filename: str | os.PathLike | None,
        args_file_flag: str | None,
    ) -> list[str]:
        """Prepend the arguments of args files, so that the command line wins over them."""
        files: list[Path] = []
        if args_filename:
            files.append(Path(args_filename))
        elif look_for_args_file and sys.argv and sys.argv[0]:
            files.append(Path(sys.argv[0]).with_suffix(".args"))
        if args_file_flag:
            flag_parser = argparse.ArgumentParser(add_help=False)
            flag_parser.add_argument(args_file_flag, type=str, action="append", dest="args_files")
            found, argv = flag_parser.parse_known_args(args=argv)
            files += [Path(p) for p in found.args_files or []]
        file_args: list[str] = []
        for path in files:
            if path.is_file():
                file_args += path.read_text(encoding="utf-8").split()
        return file_args + argv

    def _parse_config_file(self, path: str | os.PathLike) -> tuple:
        if str(path).lower().endswith(".json"):
            return self.parse_json_file(path)
        return self.parse_yaml_file(path)

    def parse_dict(self, args: dict[str, Any], allow_extra_keys: bool = False) -> tuple:
        """Build one instance of each dataclass from a dict, without argparse.

        String values of bool, int and float fields are converted as on the command line. Keys that
        no dataclass has are an error unless `allow_extra_keys`.
        """
        unused = set(args)
        outputs = []
        for dtype in self.dataclass_types:
            inputs = {
                f.name: _coerce(args[f.name], hint, f.name)
                for f, hint in _cli_fields(dtype, python_only=True)
                if f.name in args
            }
            unused -= inputs.keys()
            outputs.append(dtype(**inputs))
        if unused and not allow_extra_keys:
            raise ValueError(f"Some keys are not used by the ArgumentParser: {sorted(unused)}")
        return tuple(outputs)

    def parse_json_file(self, json_file: str | os.PathLike, allow_extra_keys: bool = False) -> tuple:
        """Build the dataclasses from a JSON file holding one object (see `parse_dict`)."""
        data = json.loads(Path(json_file).read_text(encoding="utf-8"))
        return self.parse_dict(_require_mapping(data, json_file), allow_extra_keys=allow_extra_keys)

    def parse_yaml_file(self, yaml_file: str | os.PathLike, allow_extra_keys: bool = False) -> tuple:
        """Build the dataclasses from a YAML file holding one mapping (see `parse_dict`)."""
        data = yaml.safe_load(Path(yaml_file).read_text(encoding="utf-8"))
        return self.parse_dict(_require_mapping(data, yaml_file), allow_extra_keys=allow_extra_keys)


def _require_mapping(data: Any, path: str | os.PathLike) -> dict:
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(
            f"{os.fspath(path)}: expected a mapping of argument names to values, got {type(data).__name__}"
        )
    return data


# The name used in Hugging Face scripts, so that they only need their import changed.
HfArgumentParser = ArgumentParser
