"""Checks on the driver before any worker starts: bad input fails here, clearly, with nothing started.

``check`` only checks (it changes neither the Trainer nor the call's arguments); the run spec is built after
it (driver/spec.py), where pickling -- and the error that names what cannot be pickled -- happens once.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Mapping

import torch
from torch.utils.data import IterableDataset

from raytrainer import data as rdata
from raytrainer import meta_model
from raytrainer.deps import require
from raytrainer.trainer_utils import has_length

logger = logging.getLogger(__name__)


def check(trainer, method: str, kwargs: dict) -> None:
    """Refuse, on the driver and before any worker starts, a call that cannot run: each error names the
    value and the fix. Only checks: the spec is built afterwards (driver/spec.py)."""
    args = trainer.args
    if args.num_workers > 0:
        require("ray.train", f"num_workers={args.num_workers} (training on Ray Train workers)")
    if args.deepspeed:
        require("deepspeed", "--deepspeed")
    if getattr(args, "parallelism_config", None) is not None:
        _check_parallelism(trainer)
    check_datasets(method, kwargs, args, trainer.train_dataset, trainer.eval_dataset)
    if method == "train":
        _check_train(trainer)
        _check_neftune(trainer)
        _check_gradient_checkpointing(trainer)
        _check_checkpointing(trainer, kwargs.get("resume_from_checkpoint"))
    elif method == "evaluate":
        dataset = kwargs.get("eval_dataset")
        _check_examples(trainer, trainer.eval_dataset if dataset is None else dataset, "eval_dataset")
    elif method == "predict":
        _check_examples(trainer, kwargs["test_dataset"], "test_dataset")
    if args.num_workers > 0 and method != "train" and _starts_a_group(trainer):
        from raytrainer.storage import Storage

        Storage.for_run(args).check_writable()  # the new group's Ray Train run folder lives there


def check_in_process(trainer, method: str, kwargs: dict, owner: str | None = None) -> None:
    """``check`` for a ``transformers.Trainer`` subclass run in the driver's process (raytrainer/one_loop.py;
    ``trainer.args`` with the Ray fields): what transformers' loop would refuse late or not at all, refused
    before it starts -- a call's data sets, and for ``train()`` the examples' label column, a model that
    returns no loss, gradient checkpointing or NEFTune a model cannot do, the checkpoint to resume
    (resolved: it fits this model) and the storage (writable). Also for raytrainer's Trainer on workers,
    given what its driver holds (``one_loop.DriverView``)."""
    check_datasets(method, kwargs, trainer.args, trainer.train_dataset, trainer.eval_dataset,
                   owner=owner or type(trainer).__name__)
    if method == "train":
        _check_train(trainer)
        _check_gradient_checkpointing(trainer)
        _check_neftune_hook(trainer)
        _check_checkpointing(trainer, kwargs.get("resume_from_checkpoint"))
    elif method == "evaluate":
        dataset = kwargs.get("eval_dataset")
        if isinstance(dataset, str):  # transformers' evaluate(eval_dataset="name") of a dict of data sets
            dataset = trainer.eval_dataset[dataset]
        _check_examples(trainer, trainer.eval_dataset if dataset is None else dataset, "eval_dataset")
    elif method == "predict":
        _check_examples(trainer, kwargs["test_dataset"], "test_dataset")


def _check_parallelism(trainer) -> None:
    """A tensor-parallel mesh needs the model's plan -- checked on the driver's model (model_init's too: the
    Trainer built it at construction, a skeleton when big) -- and reads a data set each tensor-parallel
    group shares."""
    from raytrainer import parallelism

    config = trainer.args.parallelism_config
    if rdata.is_ray_dataset(trainer.train_dataset) and parallelism.model_parallel_size(config) > 1:
        raise ValueError(
            "parallelism_config with tp_size > 1 reads each batch on every rank of a tensor-parallel group, "
            "and a Ray Dataset gives each worker a different shard. Fix: pass the training set as a "
            "datasets.Dataset or torch Dataset (raytrainer shards it by data-parallel rank), or drop "
            "tp_size.")
    model = vars(trainer).get("_model")  # not trainer.model: that would load a finished run's weights
    if model is not None:
        parallelism.check_plan(config, model)


# -- training ----------------------------------------------------------------------------------------
def check_datasets(method: str, kwargs: dict, args, train_dataset, eval_dataset, owner: str = "Trainer",
                   skip: frozenset = frozenset()) -> None:
    """What any trainer's loop needs of a call's data sets, whoever's loop it is: ``train()`` a
    ``train_dataset`` with a length or ``max_steps``, ``evaluate()`` an eval data set, ``predict()`` a test
    data set, none of them empty. ``skip``: the methods whose loader the trainer builds itself."""
    if method == "train" and "train" not in skip:
        if train_dataset is None:
            raise ValueError(f"train() needs a train_dataset: pass `train_dataset=` to {owner}.")
        sized = has_length(train_dataset) and not isinstance(train_dataset, IterableDataset)
        if not (sized or rdata.is_ray_dataset(train_dataset)) and args.max_steps <= 0:
            raise ValueError(
                f"train_dataset ({type(train_dataset).__name__}) has no length, so the number of steps is "
                "unknown: set max_steps to a positive value.")
        _check_not_empty(train_dataset, "train_dataset")
    elif method == "evaluate" and "evaluate" not in skip:
        dataset = kwargs.get("eval_dataset")
        dataset = eval_dataset if dataset is None else dataset
        if dataset is None:
            raise ValueError(f"evaluate() needs an eval_dataset: pass it to {owner} or to evaluate().")
        for name, one in (dataset.items() if isinstance(dataset, Mapping) else [(None, dataset)]):
            _check_not_empty(one, "eval_dataset" if name is None else f"eval_dataset[{name!r}]")
    elif method == "predict" and "predict" not in skip:
        if kwargs.get("test_dataset") is None:
            raise ValueError("predict() needs a test_dataset.")
        _check_not_empty(kwargs["test_dataset"], "test_dataset")


def _check_not_empty(dataset, name: str) -> None:
    if has_length(dataset) and not isinstance(dataset, IterableDataset) and len(dataset) == 0:
        raise ValueError(f"{name} is empty.")


def _check_train(trainer) -> None:
    dataset = trainer.train_dataset
    example = _check_examples(trainer, dataset, "train_dataset")
    if example is None or trainer.model is None:  # no model yet: a search's trial builds it in train()
        return
    if not trainer._overrides("compute_loss") and trainer.compute_loss_func is None:
        _check_labels(trainer, example, "train_dataset", dataset)
        _check_returns_loss(trainer, dataset)


def _check_gradient_checkpointing(trainer) -> None:
    wanted = trainer.args.gradient_checkpointing or trainer.args.activation_checkpointing
    if wanted and not hasattr(trainer.model, "gradient_checkpointing_enable") and not hasattr(
            trainer.model, "activation_checkpointing_enable"):
        flag = ("activation_checkpointing" if trainer.args.activation_checkpointing
                else "gradient_checkpointing")
        raise ValueError(
            f"{flag}=True, but {type(trainer.model).__name__} has no "
            "gradient_checkpointing_enable() (transformers models do). For another model use "
            "torch.utils.checkpoint in its forward, or fsdp_config={'activation_checkpointing': True} "
            "with FSDP."
        )


def _check_neftune(trainer) -> None:
    if trainer.args.neftune_noise_alpha:
        from raytrainer.worker.neftune import input_embeddings

        input_embeddings(trainer.model)  # raises, naming the fix, when there is none to hook


def _check_neftune_hook(trainer) -> None:
    """transformers' loop hooks NEFTune's noise on ``get_input_embeddings()`` (of a PEFT model's base): a
    model without it is refused here, not with an AttributeError once training has started."""
    model = trainer.model
    if not trainer.args.neftune_noise_alpha or model is None:
        return
    from transformers.trainer_utils import _is_peft_model

    base = model.base_model.model if _is_peft_model(model) else model
    if not callable(getattr(base, "get_input_embeddings", None)):
        raise ValueError(
            f"neftune_noise_alpha needs the model's input embeddings: {type(base).__name__} has no "
            "get_input_embeddings(), which transformers' loop hooks the noise on (transformers models have "
            "it). Define get_input_embeddings() returning the model's nn.Embedding, or unset "
            "neftune_noise_alpha.")


def _check_weights_fit(trainer, reader) -> None:
    """A checkpoint of another model is refused here, from its files' headers, not after the workers
    started. With model_init the driver has no model to compare (the workers check as they load)."""
    from raytrainer.checkpoint import check_fits, loads_its_own_way, weight_shapes

    if trainer.model_init is not None or trainer.model is None or loads_its_own_way(trainer.model):
        return
    shapes = weight_shapes(reader)
    if shapes:
        check_fits(trainer.model.state_dict(), shapes, reader.uri)


def check_resume_target(trainer, resume: str) -> None:
    """Can this run's strategy resume the committed checkpoint ``resume`` on this many workers, into this
    model? Read from its manifest, state and weight headers only."""
    from raytrainer.checkpoint import CheckpointReader, step_of
    from raytrainer.strategies import check_resume

    args = trainer.args
    reader = CheckpointReader(resume, args.storage_filesystem)
    world = max(args.num_workers, 1)
    step = reader.json("trainer_state.json").get("global_step", step_of(resume) or 0)
    check_resume(args, sorted(reader.files), step, world)
    _check_weights_fit(trainer, reader)
    saved = sum(1 for name in reader.files if name.startswith("rng_state_") and name.endswith(".safetensors"))
    if saved and saved != world:
        logger.warning(
            "resuming %s, written by %d workers, on %d: the data position carries over as the share of "
            "the epoch already seen, but the random number streams cannot (a rank without a saved one of "
            "its own starts from rank 0's), so dropout masks and data order differ from an uninterrupted "
            "run's.", resume, saved, world)


def _check_checkpointing(trainer, resume: str | None) -> None:
    """The checkpoint to resume (resolved by the runner to a committed one) fits; the storage is writable."""
    from raytrainer.storage import Storage

    args = trainer.args
    storage = Storage.for_run(args)
    if resume:
        check_resume_target(trainer, resume)
    if _writes_storage(args):
        storage.check_writable()


def _writes_storage(args) -> bool:
    """Whether ``train()`` writes under the storage root: checkpoints when it saves, and on Ray workers
    always (Ray Train's run folder, the final weights the driver loads) -- ``save_strategy="no"`` too."""
    return getattr(args.save_strategy, "value", args.save_strategy) != "no" or args.num_workers > 0


def _starts_a_group(trainer) -> bool:
    """Whether an ``evaluate()`` / ``predict()`` on workers starts a worker group (and so Ray Train's run
    folder in storage), not reuses the Trainer's live one."""
    group = trainer.__dict__.get("_group")
    return group is None or not (group.alive and group.usable_for(trainer.args))


def _first_examples(dataset, n: int) -> list:
    if rdata.is_ray_dataset(dataset):
        return dataset.take(n)
    if has_length(dataset) and not isinstance(dataset, IterableDataset):
        return [dataset[i] for i in range(min(n, len(dataset)))]
    out = []
    for example in dataset:
        out.append(example)
        if len(out) == n:
            break
    return out


def _check_examples(trainer, dataset, name: str):
    if isinstance(dataset, Mapping) and name == "eval_dataset":
        for key, ds in dataset.items():
            _check_examples(trainer, ds, f"{name}[{key!r}]")
        return None
    _check_not_empty(dataset, name)
    examples = _first_examples(dataset, 1)
    if not examples:
        raise ValueError(f"{name} yielded no example.")
    example = examples[0]
    if not isinstance(example, Mapping) and not hasattr(example, "__dataclass_fields__"):
        raise ValueError(
            f"{name}[0] is a {type(example).__name__}; each example must be a dict of model inputs "
            "(e.g. {'input_ids': ..., 'labels': ...}), as the HF Trainer expects."
        )
    return example


def _check_labels(trainer, example, name: str, dataset=None) -> None:
    forward = set(inspect.signature(trainer.model.forward).parameters)
    wanted = [n for n in trainer.label_names if n in forward]
    if not wanted:
        return
    keys = set(rdata._as_mapping(example))
    if dataset is not None and _missing_labels(wanted, keys):
        # the data collator may make them: DataCollatorForLanguageModeling's masked-token labels
        with torch.random.fork_rng(devices=[]):  # its masking draws leave the run's random stream as it was
            keys |= set(rdata.collator_for(trainer, dataset)([example]))
    missing = _missing_labels(wanted, keys)
    if missing:
        raise ValueError(
            f"{name}[0] has no {missing[0]!r} column (its keys: {sorted(keys)}), but "
            f"{type(trainer.model).__name__}.forward takes {missing[0]!r} to compute the loss. Add the "
            "column (as 'labels', 'label' or 'label_ids'), or set label_names= to the right names."
        )


def _missing_labels(wanted: list[str], keys: set) -> list[str]:
    if "labels" in wanted and keys & set(rdata.LABEL_KEYS):
        return []
    return [n for n in wanted if n not in keys]


#: Above this many parameters the driver does not run the model's forward to check it returns a loss: on a
#: CPU-only head node a forward of a multi-billion-parameter model costs minutes (the first training step
#: then reports a missing loss instead).
FORWARD_CHECK_MAX_PARAMS = 100_000_000


def _check_returns_loss(trainer, dataset) -> None:
    """Run forward once on (up to) two collated examples -- no more than the batch size: the model must
    return a loss. A driver's weightless skeleton (raytrainer.meta_model) runs it on the meta device: shapes
    only, at no cost. Skipped for a real model above FORWARD_CHECK_MAX_PARAMS, or one partly on meta."""
    from raytrainer.worker.loss import loss_from_outputs

    model = trainer.model
    params = list(model.parameters())
    skeleton = meta_model.is_skeleton(model)
    if any(p.is_meta for p in params) and not skeleton:
        return
    if not skeleton and sum(p.numel() for p in params) > FORWARD_CHECK_MAX_PARAMS:
        return
    with _leaves_no_trace(model):
        outputs = _forward_once(trainer, model, dataset, skeleton)
    if outputs is not None:
        loss_from_outputs(outputs, model)


def _forward_once(trainer, model, dataset, skeleton: bool):
    """The model's outputs on (up to) two collated examples, in eval mode, without gradient; None where a
    skeleton's forward cannot run without weights."""
    examples = _first_examples(dataset, max(1, min(2, trainer.args.per_device_train_batch_size)))
    batch = rdata.collator_for(trainer, dataset)(examples)
    device = next(model.parameters(), torch.empty(0)).device
    batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    model.eval()
    try:
        with torch.no_grad():
            return model(**batch)
    except TypeError as exc:
        raise ValueError(
            f"{type(model).__name__}.forward could not take a collated batch with keys {sorted(batch)}: "
            f"{exc}. Check remove_unused_columns, label_names and the data collator."
        ) from exc
    except (NotImplementedError, RuntimeError) as exc:
        if not skeleton:
            raise
        # a forward that reads values (``.item()``, data-dependent shapes) cannot run without weights
        logger.debug("the forward check does not run on the meta device: %s", exc)
        return None


@contextlib.contextmanager
def _leaves_no_trace(model):
    """The forward check is not training, and transformers' loop never runs it: what it changes is put back
    -- each module's attributes (``training`` too; the lists, dicts and sets among its own, as they were)
    and buffers, whether replaced (``self.seen = torch.cat(...)``) or changed in place, and the random
    streams the collator's masking or the forward draw from -- so the run's first step sees the model and
    the random state the script left. Costs a copy of the buffers (statistics, position tables: small beside
    the weights). Not put back: a parameter changed in place by a forward without gradient, and state
    outside the modules (a counter in a closure)."""
    saved = [(module, _attributes(module), dict(module._buffers)) for module in model.modules()]
    buffers = {id(t): (t, _version(t), t.detach().clone()) for _, _, held in saved for t in held.values()
               if t is not None}
    devices = sorted({t.device.index or 0 for t, _, _ in buffers.values() if t.device.type == "cuda"} |
                     {p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            for module, attributes, held in saved:
                vars(module).clear()
                vars(module).update(attributes)
                module._buffers.clear()
                module._buffers.update(held)
            with torch.no_grad():
                for tensor, version, before in buffers.values():
                    if _version(tensor) != version:
                        tensor.copy_(before)


def _attributes(module: torch.nn.Module) -> dict:
    """``module``'s attributes, the script's own lists, dicts and sets copied (torch's own, ``_``-named,
    are held by reference: hook handles find their dicts by identity)."""
    return {name: type(value)(value) if type(value) in (list, dict, set) and not name.startswith("_")
            else value for name, value in vars(module).items()}


def _version(tensor: torch.Tensor) -> int | None:
    """How many times ``tensor`` was changed in place (None for an inference tensor, which keeps no count
    and cannot be changed in place outside inference mode)."""
    try:
        return tensor._version
    except RuntimeError:
        return None
