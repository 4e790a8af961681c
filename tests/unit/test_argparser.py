"""ArgumentParser: command line, dict, JSON and YAML into dataclasses."""

import dataclasses
import json
import logging
import sys
from dataclasses import dataclass, field
from enum import Enum
from typing import Literal, Optional

import pytest
import yaml

from raytrainer.args import IntervalStrategy, TrainingArguments
from raytrainer.hf_argparser import ArgumentParser, HfArgumentParser, string_to_bool


class Color(str, Enum):
    RED = "red"
    BLUE = "blue"


@dataclass
class ModelArguments:
    model_name: str = field(metadata={"help": "The model to train."})
    hidden_size: int = 16
    dropout: Optional[float] = None
    color: Color = Color.RED
    mode: Literal["fast", "slow"] = "fast"
    level: Literal[1, 2] = 1
    layers: list[int] = field(default_factory=lambda: [1, 2])
    config: dict = field(default_factory=dict)
    use_bias: bool = True
    tie: Optional[bool] = None
    _private: int = 0
    derived: int = field(default=0, init=False)


def parse(*argv, types=TrainingArguments, **kwargs):
    return ArgumentParser(types).parse_args_into_dataclasses(list(argv), look_for_args_file=False, **kwargs)


def test_log_level_flags_and_process_levels():
    (args,) = parse("--log_level", "warning", "--log_level_replica", "error", "--log_on_each_node", "0")
    assert (args.log_level, args.log_level_replica, args.log_on_each_node) == ("warning", "error", False)
    assert args.get_process_log_level() == logging.WARNING
    args._set_process(2, 1, 1, 0)
    assert args.get_process_log_level() == logging.ERROR


def test_log_on_each_node_true_gives_a_local_main_on_node_1_the_main_level():
    (args,) = parse("--log_level", "info", "--log_level_replica", "error")
    assert args.log_on_each_node is True
    args._set_process(4, 2, 0, 1)
    assert args.get_process_log_level() == logging.INFO
    args._set_process(4, 3, 1, 1)
    assert args.get_process_log_level() == logging.ERROR


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], False),
        (["--do_train"], True),
        (["--do-train"], True),
        (["--do_train", "true"], True),
        (["--do_train", "yes"], True),
        (["--do_train", "1"], True),
        (["--do_train", "False"], False),
        (["--do_train", "no"], False),
        (["--do_train", "0"], False),
    ],
)
def test_bool_flag_forms(argv, expected):
    (args,) = parse(*argv)
    assert args.do_train is expected


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], True),
        (["--no_remove_unused_columns"], False),
        (["--no-remove-unused-columns"], False),
        (["--remove_unused_columns", "false"], False),
        (["--remove_unused_columns"], True),
    ],
)
def test_negative_flags_for_fields_defaulting_to_true(argv, expected):
    (args,) = parse(*argv)
    assert args.remove_unused_columns is expected


@pytest.mark.parametrize(("argv", "expected"), [
    ([], "no"), (["--include_num_input_tokens_seen"], "all"),
    (["--include_num_input_tokens_seen", "true"], "all"),
    (["--include_num_input_tokens_seen", "no"], "no"), (["--include_num_input_tokens_seen", "all"], "all"),
    (["--include-num-input-tokens-seen", "non_padding"], "non_padding"),
])
def test_a_str_or_bool_field_takes_its_strings_and_bool_words(argv, expected):
    """include_num_input_tokens_seen is `str | bool`: transformers' parser reads it as a bool and refuses
    `non_padding`, one of the field's three values."""
    (args,) = parse(*argv)
    assert args.include_num_input_tokens_seen == expected


def test_bad_bool_value_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit):
        parse("--do_train", "maybe")
    assert "Truthy value expected: got maybe" in capsys.readouterr().err


def test_typed_values_from_the_command_line():
    (args,) = parse(
        "--output_dir", "out",
        "--per-device-train-batch-size", "4",
        "--learning_rate", "1e-3",
        "--eval_strategy", "steps",
        "--eval_steps", "25",
        "--label_names", "labels", "start_positions",
        "--report_to", "tensorboard",
        "--lr_scheduler_kwargs", '{"num_cycles": 3}',
        "--resources_per_worker", '{"CPU": 2}',
        "--eval_accumulation_steps", "4",
        "--greater_is_better", "true",  # bool | None: transformers wants the value
        "--num_workers", "2",
    )  # fmt: skip
    assert args.output_dir == "out"
    assert args.per_device_train_batch_size == 4
    assert args.learning_rate == pytest.approx(1e-3)
    assert args.eval_strategy is IntervalStrategy.STEPS
    assert args.eval_steps == 25 and isinstance(args.eval_steps, int)
    assert args.label_names == ["labels", "start_positions"]
    assert args.report_to == ["tensorboard"]
    assert args.lr_scheduler_kwargs == {"num_cycles": 3}
    assert args.resources_per_worker == {"CPU": 2}
    assert args.eval_accumulation_steps == 4
    assert args.greater_is_better is True
    assert args.world_size == 2


def test_enum_choices_are_enforced(capsys):
    with pytest.raises(SystemExit):
        parse("--eval_strategy", "sometimes")
    assert "invalid choice: 'sometimes'" in capsys.readouterr().err


def test_defaults_match_the_dataclass():
    (args,) = parse()
    assert args == TrainingArguments()


def test_user_dataclass_beside_training_arguments_with_remaining_strings():
    model_args, training_args, remaining = parse(
        "--model_name", "tiny",
        "--hidden_size", "32",
        "--dropout", "0.1",
        "--color", "blue",
        "--mode", "slow",
        "--level", "2",
        "--layers", "3", "4", "5",
        "--config", '{"a": [1, 2]}',
        "--no_use_bias",
        "--tie", "true",
        "--max_steps", "7",
        "--unknown_flag", "x",
        types=(ModelArguments, TrainingArguments),
        return_remaining_strings=True,
    )  # fmt: skip
    assert isinstance(model_args, ModelArguments) and isinstance(training_args, TrainingArguments)
    assert model_args.model_name == "tiny" and model_args.hidden_size == 32
    assert model_args.dropout == pytest.approx(0.1)
    assert model_args.color == "blue"
    assert model_args.mode == "slow"
    assert model_args.level == 2 and isinstance(model_args.level, int)
    assert model_args.layers == [3, 4, 5]
    assert model_args.config == {"a": [1, 2]}
    assert model_args.use_bias is False and model_args.tie is True
    assert training_args.max_steps == 7
    assert remaining == ["--unknown_flag", "x"]


def test_remaining_strings_are_an_error_unless_asked_for():
    with pytest.raises(ValueError, match=r"not used by the HfArgumentParser: \['--bogus'\]"):
        parse("--bogus")


def test_required_fields_and_skipped_fields(capsys):
    with pytest.raises(SystemExit):
        parse(types=ModelArguments)
    assert "--model_name" in capsys.readouterr().err
    # init=False fields are not arguments; transformers' parser takes a field named with "_" like any other.
    model_args, remaining = parse(
        "--model_name", "m", "--_private", "3", "--derived", "4", types=ModelArguments,
        return_remaining_strings=True,
    )
    assert model_args._private == 3 and model_args.derived == 0
    assert remaining == ["--derived", "4"]


def test_bad_json_for_a_dict_field(capsys):
    with pytest.raises(SystemExit):
        parse("--model_name", "m", "--config", "{not json}", types=ModelArguments)
    assert "expected a JSON object" in capsys.readouterr().err


def test_extra_arguments_come_back_as_a_namespace():
    parser = ArgumentParser(TrainingArguments)
    parser.add_argument("--extra", type=int, default=1)
    args, extra = parser.parse_args_into_dataclasses(
        ["--extra", "5", "--seed", "3"], look_for_args_file=False
    )
    assert args.seed == 3 and extra.extra == 5


def test_argument_group_name():
    @dataclass
    class Grouped:
        _argument_group_name = "Grouped options"
        size: int = 1

    parser = ArgumentParser(Grouped)
    assert "Grouped options" in parser.format_help()
    assert parser.parse_args_into_dataclasses(["--size", "4"], look_for_args_file=False)[0].size == 4


def test_help_lists_every_field():
    text = ArgumentParser(TrainingArguments).format_help()
    assert "--per_device_train_batch_size" in text and "--placement_strategy" in text
    assert "--no_log_on_each_node" in text


# --- Files and dicts ---


def _custom_args():
    return TrainingArguments(
        output_dir="out", eval_strategy="steps", eval_steps=5, save_steps=10, load_best_model_at_end=True,
        learning_rate=3e-4, lr_scheduler_type="cosine", lr_scheduler_kwargs={"num_cycles": 2},
        report_to=["tensorboard"], num_workers=2, resources_per_worker={"CPU": 2}, log_on_each_node=False,
    )  # fmt: skip


def test_json_file_round_trip(tmp_path):
    original = _custom_args()
    path = tmp_path / "args.json"
    path.write_text(original.to_json_string())
    (parsed,) = ArgumentParser(TrainingArguments).parse_json_file(path)
    assert parsed.hub_token == "<HUB_TOKEN>"  # transformers' to_dict masks every token
    assert dataclasses.replace(parsed, hub_token=None) == original
    assert parsed.metric_for_best_model == "loss" and parsed.log_on_each_node is False


def test_yaml_file_round_trip(tmp_path):
    original = _custom_args()
    path = tmp_path / "args.yaml"
    path.write_text(yaml.safe_dump(original.to_dict()))
    (parsed,) = ArgumentParser(TrainingArguments).parse_yaml_file(path)
    assert dataclasses.replace(parsed, hub_token=None) == original


def test_yaml_strings_are_converted_like_the_command_line(tmp_path):
    path = tmp_path / "args.yml"
    path.write_text("learning_rate: 5e-4\nlog_on_each_node: 'no'\nmax_steps: '20'\n")
    (parsed,) = ArgumentParser(TrainingArguments).parse_yaml_file(path)
    assert parsed.learning_rate == pytest.approx(5e-4)
    assert parsed.log_on_each_node is False and parsed.max_steps == 20


def test_parse_dict_extra_keys():
    parser = ArgumentParser((ModelArguments, TrainingArguments))
    with pytest.raises(ValueError, match=r"not used by the HfArgumentParser: \['nope'\]"):
        parser.parse_dict({"model_name": "m", "seed": 1, "nope": 2})
    model_args, training_args = parser.parse_dict(
        {"model_name": "m", "seed": 1, "nope": 2}, allow_extra_keys=True
    )
    assert model_args.model_name == "m" and training_args.seed == 1


def test_parse_dict_validates_through_the_dataclass():
    with pytest.raises(ValueError, match=r"per_device_train_batch_size=0"):
        ArgumentParser(TrainingArguments).parse_dict({"per_device_train_batch_size": 0})


def test_a_single_config_file_argument_is_read(tmp_path, monkeypatch):
    path = tmp_path / "train.json"
    path.write_text(json.dumps({"model_name": "from_file", "max_steps": 9}))
    parser = ArgumentParser((ModelArguments, TrainingArguments))
    monkeypatch.setattr(sys, "argv", ["app.py", str(path)])
    model_args, training_args = parser.parse_args_into_dataclasses()
    assert model_args.model_name == "from_file" and training_args.max_steps == 9

    yaml_path = tmp_path / "train.yaml"
    yaml_path.write_text("model_name: from_yaml\nseed: 7\n")
    model_args, training_args, remaining = parser.parse_args_into_dataclasses(
        [str(yaml_path)], return_remaining_strings=True
    )
    assert (model_args.model_name, training_args.seed, remaining) == ("from_yaml", 7, [])


def test_args_files_are_prepended_and_the_command_line_wins(tmp_path):
    defaults = tmp_path / "defaults.args"
    defaults.write_text("--learning_rate 0.1 --seed 5")
    extra = tmp_path / "extra.args"
    extra.write_text("--seed 6 --max_steps 3")
    parser = ArgumentParser(TrainingArguments)
    (args,) = parser.parse_args_into_dataclasses(
        ["--args_file", str(extra), "--max_steps", "4"], args_filename=defaults, args_file_flag="--args_file"
    )
    assert args.learning_rate == pytest.approx(0.1)
    assert args.seed == 6  # the flagged file comes after the default one
    assert args.max_steps == 4  # the command line comes last


def test_script_args_file_next_to_the_entry_point(tmp_path, monkeypatch):
    script = tmp_path / "train.py"
    (tmp_path / "train.args").write_text("--seed 11")
    monkeypatch.setattr(sys, "argv", [str(script)])
    (args,) = ArgumentParser(TrainingArguments).parse_args_into_dataclasses([])
    assert args.seed == 11
    (args,) = ArgumentParser(TrainingArguments).parse_args_into_dataclasses([], look_for_args_file=False)
    assert args.seed == 42


def test_string_to_bool_and_alias():
    import transformers

    assert string_to_bool("YES") is True and string_to_bool("f") is False and string_to_bool(True) is True
    assert HfArgumentParser is ArgumentParser
    assert issubclass(ArgumentParser, transformers.HfArgumentParser)


@dataclass
class OddUnions:
    targets: str | list[str] | None = None  # transformers' parser raises TypeError in this order
    options: dict | str = field(default_factory=dict)  # transformers' parser would call dict("{...}")
    python_object: object = field(default=None, metadata={"cli": False, "other_library": 1})


def test_unions_transformers_parser_mishandles_are_read_as_strings():
    (args,) = parse("--targets", "q_proj", "--options", '{"a": 1}', types=OddUnions)
    assert args.targets == "q_proj" and args.options == '{"a": 1}'  # the dataclass parses its strings
    assert args.python_object is None
    (args,) = parse(types=OddUnions)
    assert args == OddUnions()
