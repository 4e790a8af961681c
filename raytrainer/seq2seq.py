"""``Seq2SeqTrainingArguments``: transformers' names, defaults and validation, with raytrainer's Ray
fields; and the generation config settled before the first ``generate`` (``raytrainer.Seq2SeqTrainer`` is
raytrainer/one_loop.py's: transformers' own ``Seq2SeqTrainer`` loop)."""

from __future__ import annotations

import dataclasses
import os

import transformers

from raytrainer.args import RayArgumentsMixin


@dataclasses.dataclass(repr=False)
class Seq2SeqTrainingArguments(RayArgumentsMixin, transformers.Seq2SeqTrainingArguments):
    """transformers' ``Seq2SeqTrainingArguments`` with raytrainer's Ray fields (``RayArgumentsMixin``)."""

    def __post_init__(self) -> None:
        for name in ("generation_max_length", "generation_num_beams"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}={value!r}: must be a positive integer or None; pass e.g. "
                                 f"--{name} 64")
        if isinstance(self.generation_config, os.PathLike):
            self.generation_config = os.fspath(self.generation_config)
        super().__post_init__()


def _settled_generation_config(model):
    """The model's generation config with its unset values filled with transformers' defaults, before the
    first ``generate``. transformers' Seq2SeqTrainer fills them after its first batch, so that batch alone
    (with ``max_length`` unset: ``20 + 1`` for an encoder-decoder) may run one token longer than every later
    one; on several ranks each rank's first batch would, and the ids would depend on the number of workers.
    Filled first, every batch of every rank generates as transformers' later batches do."""
    gen_config = model.generation_config
    if getattr(gen_config, "_from_model_config", False):
        gen_config._from_model_config = False
    if hasattr(gen_config, "_get_default_generation_params"):  # transformers 5: fill unset defaults
        gen_config.update(**gen_config._get_default_generation_params(), defaults_only=True)
    return gen_config
