"""DeepSpeed ZeRO stages 0-3: the engine owns backward scaling, the optimizer step, clipping and precision.

Chosen the HF way with ``TrainingArguments(deepspeed=<path or dict>)``; "auto" values are filled from the
arguments (``deepspeed_config``). How the per-rank loop maps onto the engine:

- ``setup_model`` only places the module; ``setup_optimizer`` builds the optimizer (raytrainer's from
  ``optim`` unless the config has an ``optimizer`` section) and scheduler (likewise ``scheduler``), then
  ``deepspeed.initialize`` wraps all three. The engine steps the scheduler it was given.
- Micro-steps: the loop tells the engine where an accumulation window ends
  (``set_gradient_accumulation_boundary``), so a short last window of an epoch steps like any other; the
  loss arrives already divided by the window's micro-batches, so ``backward`` does not scale it again.
- Precision: fp16 / bf16 are the engine's (the module itself is cast); raytrainer's autocast is off and
  floating inputs are cast to the engine's dtype, as HF does.
- Checkpoints: the engine's own format in ``checkpoint-<step>/global_step<step>/`` (every rank writes its
  ZeRO partition), in the background: the step waits for a host copy of the state, a thread writes it
  (``deepspeed_writes``, where the config keeps DeepSpeed's default checkpoint engine). ZeRO-3's
  checkpoints hold the model only there, nothing gathered (unless the config sets
  ``stage3_gather_16bit_weights_on_model_save``: then rank 0 also writes the gathered ``model.safetensors``,
  as ZeRO-0/1/2 always do); ``raytrainer consolidate`` makes safetensors of the partitions. For a PEFT
  model, its adapter files and the engine's state of the adapter only, no frozen base weight. A ZeRO
  checkpoint resumes on the same number of workers as written; on another number rank 0 first converts it
  with DeepSpeed's ``ds_to_universal`` and every rank loads its new partition from the universal folder
  (``resuming_on_any_world_size``, around transformers' ``deepspeed_load_checkpoint``). DeepSpeed's
  loaders run under ``deepspeed_load.weights_only_loads``: nothing in the files is executed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import tempfile

import torch

from raytrainer.strategies.base import Strategy
from raytrainer.strategies.deepspeed_config import fill_for_run, fill_from_args, load_config, zero_stage
from raytrainer.strategies.deepspeed_load import weights_only_loads
from raytrainer.strategies.deepspeed_writes import in_background, take_pending, write_in_background
from raytrainer.strategies.precision import CastPrecision

logger = logging.getLogger(__name__)

_PARTITION = "_optim_states.pt"


def tag_of(step: int) -> str:
    return f"global_step{step}"


class DeepSpeedStrategy(Strategy):
    name = "deepspeed"
    sharded_state_dir = "global_step"  # + the step: DeepSpeed's tag

    def __init__(self, ctx, args):
        super().__init__(ctx, args)
        self.config = fill_from_args(load_config(args.deepspeed), args, ctx.world_size)
        self.stage = zero_stage(self.config)
        self.gathers_in_forward = self.stage == 3  # ZeRO-3 gathers each layer's partitions in forward
        dtype = None
        if (self.config.get("bf16") or {}).get("enabled"):
            dtype = torch.bfloat16
        elif (self.config.get("fp16") or {}).get("enabled"):
            dtype = torch.float16
        self.precision = CastPrecision(dtype)  # the engine casts the module; inputs follow
        self.engine = None

    # -- setup -------------------------------------------------------------------------------------------
    def model_init_context(self):
        """ZeRO-3 with ``model_init`` on several workers: the model is built partitioned
        (``deepspeed.zero.Init``): each parameter is cut into world_size pieces as its module is constructed,
        so no rank ever holds the whole model. transformers sees ZeRO-3 enabled (``HfDeepSpeedConfig``, kept
        for the run as transformers.Trainer keeps it), so ``from_pretrained`` inside loads partition-wise."""
        if self.stage != 3 or self.ctx.world_size == 1:
            return contextlib.nullcontext()
        import deepspeed

        # zero.Init replaces torch.Tensor.__new__ while it is active, and torch._dynamo refuses to import then
        # (its polyfill for Tensor.__new__ checks the signature): a model_init whose from_pretrained imports
        # the model's module for the first time (transformers' lazy imports reach torch._dynamo through
        # masking_utils) would fail inside the context. Imported here first, once per process.
        import torch._dynamo  # noqa: F401

        config = self._zero_init_config()
        try:
            from transformers.integrations.deepspeed import HfDeepSpeedConfig

            self._hf_deepspeed_config = HfDeepSpeedConfig(config)  # transformers holds a weak reference
        except ImportError:
            pass
        return deepspeed.zero.Init(config_dict_or_path=config)

    def holds_whole_model(self, model: torch.nn.Module) -> bool:
        """Not when deepspeed.zero.Init partitioned it (the engine's checkpoint fills the partitions)."""
        return super().holds_whole_model(model) and not any(hasattr(p, "ds_id") for p in model.parameters())

    def build_model(self, factory, fresh: bool = True) -> torch.nn.Module:
        """ZeRO-3 on several workers: ``model_init`` runs under ``zero.Init`` (``model_init_context``) where
        it builds a model from code or a config. Where it loads pretrained weights (``from_pretrained``, found
        as on FSDP: it refuses the meta device) or adapts the model with PEFT, it runs as in
        transformers.Trainer instead: with ``HfDeepSpeedConfig`` alone, so that ``from_pretrained`` loads
        partition-wise under transformers' own ``zero.Init`` while what ``model_init`` adds afterwards (LoRA
        adapters) is built whole and initialised as written -- under an outer ``zero.Init`` PEFT's
        initialisation would write into already-partitioned (empty) tensors and be lost, leaving LoRA's B
        random instead of zero -- and the engine partitions it. A probe on the meta device decides (no
        storage, random generators put back)."""
        if self.stage != 3 or self.ctx.world_size == 1:
            return factory()
        from raytrainer.meta_model import build_on_meta, is_skeleton

        probe = build_on_meta(factory)
        if probe is not None and not is_skeleton(probe):
            return probe  # model_init chose its own device: built for real, not again
        if probe is None or hasattr(probe, "peft_config"):
            del probe
            with self._transformers_zero3():
                return factory()
        del probe
        with self.model_init_context():
            return factory()

    def _zero_init_config(self) -> dict:
        config = _without_autos(self.config)  # the run's lengths are not known yet: DeepSpeed's defaults
        for key in ("train_batch_size", "gradient_accumulation_steps"):  # checked against a world size of 1
            config.pop(key, None)  # before deepspeed.comm is set up; the engine checks them
        return config

    @contextlib.contextmanager
    def _transformers_zero3(self):
        """transformers sees ZeRO-3 enabled (``HfDeepSpeedConfig``, kept for the run as transformers.Trainer
        keeps it): its ``from_pretrained`` / ``from_config`` build partitioned, under their own zero.Init."""
        import torch._dynamo  # noqa: F401  (see model_init_context)

        try:
            from transformers.integrations.deepspeed import HfDeepSpeedConfig

            self._hf_deepspeed_config = HfDeepSpeedConfig(self._zero_init_config())  # a weak reference there
        except ImportError:
            pass
        yield

    def setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        if any(hasattr(p, "ds_id") for p in model.parameters()):
            return model  # partitioned by zero.Init, each piece already where the engine wants it
        return model.to(self.ctx.device)

    def setup_optimizer(self, model: torch.nn.Module, optimizers) -> tuple:
        import deepspeed

        hidden = getattr(getattr(model, "config", None), "hidden_size", None)
        # filled again: auto_find_batch_size may have changed the batch size since __init__
        config = fill_from_args(load_config(self.args.deepspeed), self.args, self.ctx.world_size)
        config = fill_for_run(config, self.args, optimizers.num_training_steps, hidden)
        optimizer = scheduler = None
        if "optimizer" not in config:
            optimizer = optimizers.optimizer()
            # DeepSpeed drops the optimizer's empty parameter groups (a no-decay group when every trainable
            # parameter decays, as with LoRA adapters); a scheduler made before would step one group more
            # than the optimizer has. Dropped here first, as DeepSpeed will.
            optimizer.param_groups[:] = [g for g in optimizer.param_groups if g["params"]]
            config.setdefault("zero_allow_untested_optimizer", True)
            if _offloads_optimizer(config):  # a torch optimizer on offloaded state (no DeepSpeedCPUAdam)
                config.setdefault("zero_force_ds_cpu_optimizer", False)
        elif self.ctx.device.type == "cpu":
            # DeepSpeed's fused Adam kernels need CUDA; on CPU its Adam/AdamW run torch's implementation.
            config["optimizer"].setdefault("params", {}).setdefault("torch_adam", True)
        if "scheduler" not in config and optimizer is not None:
            scheduler = optimizers.scheduler(optimizer)
        plateau = isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
        engine, ds_optimizer, _, ds_scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=None if plateau else scheduler, config=config,
            dist_init_required=False)
        if ds_scheduler is None and scheduler is None:
            # The config's optimizer, raytrainer's schedule (lr_scheduler_type) stepped by the engine.
            scheduler = optimizers.scheduler(_base_optimizer(ds_optimizer))
            engine.lr_scheduler = scheduler
        self.engine = engine
        write_in_background(engine)  # checkpoints: the step waits for a host copy, a thread writes it
        self._owns_scheduler = not plateau
        return engine, ds_optimizer, ds_scheduler or scheduler

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return getattr(model, "module", model)

    def eval_model(self, model: torch.nn.Module) -> torch.nn.Module:
        # ZeRO-3 gathers partitioned parameters inside forward: every rank runs it (raytrainer's evaluation
        # sharding gives every rank the same number of batches).
        return self.unwrap(model)

    # -- one optimizer step ------------------------------------------------------------------------------
    def no_sync(self, model: torch.nn.Module, sync: bool):
        if self.engine is not None:
            self.engine.set_gradient_accumulation_boundary(sync)
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss, scale_wrt_gas=False)

    def clip_grad_norm(self, model: torch.nn.Module, max_norm: float):
        return None  # the engine clips in step() ("gradient_clipping"); its norm comes from optimizer_step

    def optimizer_step(self, model: torch.nn.Module, optimizer):
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else None

    def scheduler_step(self, scheduler) -> None:
        if not self._owns_scheduler:
            super().scheduler_step(scheduler)

    def zero_grad(self, model: torch.nn.Module) -> None:
        pass  # the engine zeroes gradients at the end of each step

    # -- state -------------------------------------------------------------------------------------------
    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        adapter = _peft_state(model.module) if self.stage == 3 else None
        return adapter if adapter is not None else self.whole_state_dict(model)

    def whole_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        if self.stage == 3:
            state = model._zero3_consolidated_16bit_state_dict()  # a collective; complete on rank 0
            return {k: v.detach().cpu() for k, v in (state or {}).items()}
        return super().full_state_dict(model)

    def saves_model_sharded(self, model) -> bool:
        """ZeRO-3: a checkpoint holds the model as the engine's partitions (``global_step<N>/``), nothing
        gathered -- as transformers.Trainer saves under ZeRO-3 -- unless the config asks for gathered weights
        (``stage3_gather_16bit_weights_on_model_save: true``, transformers' switch for the same), or the
        model is a PEFT model, whose adapter files stay consolidated (a few MB)."""
        gather = (self.config.get("zero_optimization") or {}).get("stage3_gather_16bit_weights_on_model_save")
        return self.stage == 3 and gather is not True and not _is_peft(model)

    def save_sharded(self, model, optimizer, scheduler, folder: str, step: int) -> str:
        # A PEFT model's frozen base is model_init's to build, not the checkpoint's (as transformers.Trainer
        # saves it): otherwise every checkpoint would hold the whole base model, its ZeRO partitions.
        model.save_checkpoint(folder, tag=tag_of(step), save_latest=False,
                              exclude_frozen_parameters=_is_peft(model))
        return tag_of(step)

    def take_pending_writes(self) -> list:
        """The last ``save_sharded``'s writes, going on in the background (``deepspeed_writes``)."""
        return take_pending(self.engine) if self.engine is not None else []

    def names_its_writes(self) -> bool:
        return self.engine is not None and in_background(self.engine)

    @classmethod
    def check_resume(cls, args, files: list[str], step: int, world_size: int) -> None:
        """A ZeRO checkpoint holds one optimizer partition per rank: resuming on another number of ranks
        needs DeepSpeed's conversion to a universal checkpoint first. Called on the driver."""
        if zero_stage(load_config(args.deepspeed)) != 3:
            super().check_resume(args, files, step, world_size)  # a model that only ZeRO-3 reads: refused
        saved = _partitions(files, step)
        if saved and len(saved) != world_size:
            logger.warning("resume_from_checkpoint: this DeepSpeed ZeRO checkpoint was saved by %d workers "
                           "and this run has %d: rank 0 converts it to DeepSpeed's universal format first "
                           "(reads every partition once)", len(saved), world_size)


@contextlib.contextmanager
def resuming_on_any_world_size(args, ctx):
    """Meanwhile transformers' DeepSpeed resume (``deepspeed_load_checkpoint``, called by its
    ``_inner_training_loop``) also takes a ZeRO checkpoint written by another number of ranks, which
    DeepSpeed's own loader refuses ("Automatic adjustment of ZeRO's optimizer state partitioning with a new
    world size is not currently supported"): rank 0 converts it with DeepSpeed's ``ds_to_universal`` and
    every rank loads its new partition from the universal folder (``_load_resharded``). A checkpoint of as
    many ranks loads as transformers loads it. ``args``: the run's arguments (its storage)."""
    from transformers import trainer as hf_trainer

    own = hf_trainer.deepspeed_load_checkpoint

    def load(engine, checkpoint_path, load_module_strict=True):
        tag = _latest_tag(checkpoint_path)
        if tag is None:  # transformers names what is missing
            return own(engine, checkpoint_path, load_module_strict=load_module_strict)
        saved = [n for n in os.listdir(os.path.join(checkpoint_path, tag)) if n.endswith(_PARTITION)]
        if not saved or len(saved) == ctx.world_size:
            return own(engine, checkpoint_path, load_module_strict=load_module_strict)
        logger.info("a ZeRO checkpoint of %d ranks on %d: converting it to DeepSpeed's universal format",
                    len(saved), ctx.world_size)
        return _load_resharded(engine, checkpoint_path, tag, args, ctx, load_module_strict)

    hf_trainer.deepspeed_load_checkpoint = load
    try:
        yield
    finally:
        hf_trainer.deepspeed_load_checkpoint = own


def _latest_tag(folder: str) -> str | None:
    """The tag DeepSpeed's ``load_checkpoint`` reads in ``folder`` (its ``latest`` file, else the one
    ``global_step*`` folder)."""
    latest = os.path.join(folder, "latest")
    if os.path.isfile(latest):
        with open(latest) as f:
            return f.read().strip()
    tags = sorted(n for n in os.listdir(folder) if re.fullmatch(r"global_step\d+", n))
    return tags[-1] if tags else None


def _load_resharded(engine, folder: str, tag: str, args, ctx, strict: bool) -> tuple:
    """A ZeRO checkpoint (``folder/tag``) of another number of ranks into ``engine``: rank 0 reads every
    partition (the resume copied them all to its node, verified) and converts them into DeepSpeed's universal
    checkpoint (one folder per parameter, cut by no rank count) in the run's storage
    (``.raytrainer-universal-<step>/``); every rank then loads its new partition from it, and rank 0 removes
    it. At full size that is the whole optimizer state read and written once by one process: minutes, paid
    only when the number of workers changed."""
    from raytrainer.storage import Storage

    storage = Storage.for_run(args)
    dest = storage.path(f".raytrainer-universal-{tag.removeprefix('global_step')}")
    error = None
    if ctx.is_world_zero:
        try:
            with tempfile.TemporaryDirectory(prefix="raytrainer-universal-") as out:
                _convert_to_universal(os.path.join(folder, tag), os.path.join(out, f"{tag}_universal"))
                if storage.exists(dest):
                    storage.delete_dir(dest)
                storage.upload_dir(out, dest)
        except Exception as exc:  # shared below: no rank waits for a conversion that failed
            error = exc
    if ctx.any_flags([error is not None])[0]:
        raise error or RuntimeError("rank 0 could not convert the DeepSpeed checkpoint (see its log)")
    stage3 = engine.zero_optimization_partition_weights()
    if not stage3:  # ZeRO-1/2, bf16: a rank holding no parameter of a group (deepspeed_universal)
        from raytrainer.strategies.deepspeed_universal import repair

        repair(engine.optimizer)
    engine._config.load_universal_checkpoint = True  # read by its loads only (engine.py)
    try:
        with tempfile.TemporaryDirectory(prefix="raytrainer-universal-") as local:
            storage.download_dir(dest, local)
            with weights_only_loads():
                loaded = engine.load_checkpoint(local, tag=f"{tag}_universal", load_optimizer_states=True,
                                                load_lr_scheduler_states=True, load_module_strict=strict)
            if loaded[0] is not None and stage3:
                _repair_zero3_load(engine.optimizer, os.path.join(local, f"{tag}_universal"))
    finally:
        engine._config.load_universal_checkpoint = False
    if loaded[0] is None:
        raise RuntimeError(f"DeepSpeed could not load the universal checkpoint made from {folder}")
    ctx.barrier()
    if ctx.is_world_zero:
        storage.delete_dir(dest)
    return loaded


def _is_peft(engine) -> bool:
    """The engine trains a PEFT model: its checkpoints leave out the frozen base (see ``save_sharded``)."""
    return hasattr(engine.module, "peft_config")


def _peft_state(module: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """A PEFT model's saved entries (its adapters), gathered alone from the ZeRO-3 partitions: the frozen
    base, the size of the model, stays partitioned. None for any other model (a collective: every rank
    calls it)."""
    if not hasattr(module, "peft_config"):
        return None
    import deepspeed

    from raytrainer.saving import peft_saved_keys

    state = module.state_dict(keep_vars=True)  # the partitioned parameters themselves
    keys = peft_saved_keys(module, state)
    if keys is None:
        return None
    params = [state[k] for k in keys if hasattr(state[k], "ds_id")]
    with deepspeed.zero.GatheredParameters(params):
        return {k: state[k].detach().cpu().clone() for k in keys}


def _partitions(files, step: int) -> list[str]:
    """The ZeRO optimizer partition files of a checkpoint's ``global_step<step>/`` (one per rank)."""
    prefix = f"{tag_of(step)}/"
    return [f for f in files if f.startswith(prefix) and f.endswith(_PARTITION)]


def _repair_zero3_load(optimizer, folder: str) -> None:
    """Undo two slips of DeepSpeed's ZeRO-3 universal load (0.19, ``load_hp_checkpoint_state_from_checkpoint_
    dir_stage3``), which would make the resumed run drift from the uninterrupted one:

    - it gives every flat fp32 partition the same ``step`` tensor, and torch's Adam advances each
      parameter's step in place: with two parameter groups (transformers' decay / no-decay) the step went
      up by two per update, and the bias correction was wrong;
    - it gives every parameter group the hyperparameters of the checkpoint's first group: the no-decay
      group decayed.

    Each step becomes its own tensor, and each group takes its own saved hyperparameters (``folder``: the
    universal checkpoint, whose ``zero/optimizer_state.pt`` holds them)."""
    from deepspeed.checkpoint.constants import OPTIMIZER_STATE_DICT

    base = _base_optimizer(optimizer)
    seen: set[int] = set()
    for state in base.state.values():
        step = state.get("step")
        if isinstance(step, torch.Tensor):
            if id(step) in seen:
                state["step"] = step.clone()
            seen.add(id(step))
    with weights_only_loads():
        saved = torch.load(os.path.join(folder, "zero", "optimizer_state.pt"), weights_only=False)
    groups = saved[OPTIMIZER_STATE_DICT]["param_groups"]
    if len(groups) == len(base.param_groups):
        for group, kept in zip(base.param_groups, groups):
            group.update({k: v for k, v in kept.items() if k != "params"})


def _convert_to_universal(folder: str, output: str) -> None:
    """DeepSpeed's own ds_to_universal, in this process (no worker pools), with the client state DeepSpeed's
    conversion expects of Megatron-style trainers injected (a plain engine's checkpoint lacks it)."""
    import argparse

    from deepspeed.checkpoint.ds_to_universal import main

    with weights_only_loads():
        main(argparse.Namespace(input_folder=folder, output_folder=output, num_extract_workers=1,
                                num_merge_workers=1, keep_temp_folder=False, strict=True,
                                inject_missing_state=True))


def _without_autos(node):
    """The config without its remaining "auto" values (those filled only once the run's length is known)."""
    if isinstance(node, dict):
        return {k: _without_autos(v) for k, v in node.items() if v != "auto"}
    return node


def _base_optimizer(optimizer):
    """The torch optimizer under DeepSpeed's ZeRO wrapper (whose param groups a scheduler drives)."""
    return getattr(optimizer, "optimizer", optimizer)


def _offloads_optimizer(config: dict) -> bool:
    offload = (config.get("zero_optimization") or {}).get("offload_optimizer") or {}
    return offload.get("device") in ("cpu", "nvme")
