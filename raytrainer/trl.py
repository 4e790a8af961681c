"""TRL on Ray: ``from raytrainer.trl import SFTTrainer, SFTConfig`` instead of ``from trl import ...``.

Every trainer TRL exports (``SFTTrainer``, ``DPOTrainer``, ``RewardTrainer``, ``GRPOTrainer``, ...) is here
as its twin (``raytrainer.hosted.on_ray``), and every config (``SFTConfig``, ...) with raytrainer's Ray
fields (``num_workers``, ``use_gpu``, ``resources_per_worker``, ...; ``config_on_ray``); everything else
(``TrlParser``, ``ModelConfig``, ``get_peft_config``, ``get_dataset``...) is TRL's own object. With
``--num_workers 2`` a TRL script trains on two Ray workers, each running TRL's trainer as it runs under
``accelerate launch``; with ``num_workers=0`` it is TRL's trainer in this process.
"""

from __future__ import annotations

import functools


@functools.cache
def __getattr__(name: str):
    import transformers
    import trl

    from raytrainer.hosted import config_on_ray, on_ray
    from raytrainer.import_scratch import imports_in_own_folder

    with imports_in_own_folder():  # wandb's temporary folders, when a trainer's module imports it
        value = getattr(trl, name)  # AttributeError for a name TRL lacks, as `from trl import` would raise
    if isinstance(value, type) and issubclass(value, transformers.Trainer):
        return _here(on_ray(value), name)
    if isinstance(value, type) and issubclass(value, transformers.TrainingArguments):
        return _here(config_on_ray(value), name)
    return value


def _here(cls: type, name: str) -> type:
    """A twin that pickles by reference, as ``raytrainer.trl.<name>``."""
    cls.__module__, cls.__qualname__ = __name__, name
    return cls
