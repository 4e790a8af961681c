"""`TrainingArguments`: transformers' own, plus the fields that say where a run executes on Ray.

`raytrainer.TrainingArguments` is a subclass of `transformers.TrainingArguments`: every field, default, help
text and derived value is transformers' (a script, a config file or a `transformers.TrainingArguments` keeps
working), and `RayArgumentsMixin` adds raytrainer's fields (`num_workers`, `use_gpu`, `resources_per_worker`,
`placement_strategy`, `ray_address`, `storage_path`, `storage_filesystem`, `max_failures`, `keep_workers_s`,
`accelerate_config`, `nonfinite_loss`). The mixin is a plain dataclass, so any other subclass of transformers'
arguments (TRL's configs, a user's own) gains the same fields the same way::

    @dataclass
    class RaySFTConfig(RayArgumentsMixin, trl.SFTConfig):
        pass

What the mixin changes in transformers' behaviour, and why:

- Values are checked on the driver before transformers derives anything: each mistake is a `ValueError` that
  reads "<field>=<value>: <what is wrong>; <how to fix it>" (`raytrainer/arg_types.py`), and the values
  raytrainer cannot honour (XLA FSDP, context parallelism, an optimizer whose package is not installed) are
  refused by name.
- The process view (`world_size`, `process_index`, `device`, `should_log`, ...) describes the run, not the
  driver's process: on the driver it is rank 0's view of `num_workers` workers, and each worker calls
  `_set_process(...)` on its own copy once it knows its rank. transformers would set up accelerate's
  `PartialState` here instead, which in a Ray worker's environment would start a process group.
- `fsdp` stays the list of options raytrainer's FSDP2 strategy reads (transformers folds it into
  `fsdp_config` for accelerate's plugin), and a DeepSpeed config is checked and filled on the driver without
  installing transformers' process-global ZeRO-3 hook there (the driver never builds a partitioned model).
- `bf16` and `tf32` are properties of the workers' devices: the driver's own GPU (or its absence) does not
  decide them when the run is on Ray workers.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import os
import sys
import warnings
from dataclasses import MISSING, dataclass, field, fields
from enum import Enum
from typing import Any

import transformers
from transformers.trainer_utils import HubStrategy, IntervalStrategy, SaveStrategy, SchedulerType
from transformers.training_args import OptimizerNames, ParallelMode

from raytrainer.arg_types import (
    _DICT_FIELDS,
    _PASSIVE_MAIN_LEVEL,
    _PASSIVE_REPLICA_LEVEL,
    DDP_BACKENDS,
    INCLUDE_FOR_METRICS,
    LOG_LEVELS,
    PLACEMENT_STRATEGIES,
    TRAIN_SAMPLING_STRATEGIES,
    _check_one_of,
    _check_positive_int,
    _error,
    _is_int,
    _is_number,
    _normalize_fsdp,
    _normalize_fsdp_config,
    _normalize_steps,
    _parse_dict,
    _to_enum,
    check_deepspeed,
    check_fsdp,
    check_moot,
    check_neftune,
    check_optim_features,
)

__all__ = [
    "HubStrategy",
    "IntervalStrategy",
    "OptimizerNames",
    "ParallelMode",
    "RayArgumentsMixin",
    "SaveStrategy",
    "SchedulerType",
    "TrainingArguments",
]

logger = logging.getLogger(__name__)


@dataclass
class RayArgumentsMixin:
    """raytrainer's fields and checks, for any subclass of `transformers.TrainingArguments`.

    Put it first among the bases (`class Args(RayArgumentsMixin, transformers.TrainingArguments)`) so that its
    `__post_init__` and process view come before transformers'.
    """

    nonfinite_loss: str = field(
        default="error",
        metadata={"help": "A NaN or inf training loss: 'error' stops the run before that optimizer step "
                          "(naming the rank, step and loss; never retried), 'skip_step' skips that update on "
                          "every rank with a warning, 'ignore' trains on as transformers does. 'error' and "
                          "'skip_step' read one flag per optimizer step on the host; 'skip_step' also "
                          "agrees on it across ranks (one all-reduce)."},
    )
    accelerate_config: str | None = field(
        default=None,
        metadata={"help": "An accelerate config YAML (from `accelerate config`): sets num_workers, the "
                          "strategy (DDP / FSDP with its options) and mixed precision."},
    )
    num_workers: int | str | None = field(
        default=0,
        metadata={"help": "Ray Train workers: 0 runs the training loop in this process, N >= 1 runs N "
                          "actors, MIN:MAX (a (min, max) tuple in Python) as many as the cluster holds "
                          "between the two, keeping the global batch of MAX workers "
                          "(raytrainer/elastic.py)."},
    )
    use_gpu: bool = field(default=False, metadata={"help": "Give each Ray Train worker one GPU."})
    resources_per_worker: dict[str, float] | str | None = field(
        default=None,
        metadata={"help": """Ray resources of each worker, as a dict or JSON, e.g. '{"CPU": 2}'."""},
    )
    placement_strategy: str = field(
        default="PACK",
        metadata={"help": "Ray placement strategy: PACK, SPREAD, STRICT_PACK or STRICT_SPREAD."},
    )
    ray_address: str | None = field(
        default=None,
        metadata={"help": "Address of the Ray cluster; if unset, RAY_ADDRESS, else a new local instance."},
    )
    storage_path: str | None = field(
        default=None,
        metadata={"help": "Where Ray Train keeps checkpoints: a local path or URI. Defaults to output_dir."},
    )
    storage_filesystem: Any = field(
        default=None,
        metadata={"help": "A pyarrow.fs.FileSystem for storage_path (as Ray Train's RunConfig takes): an "
                          "S3FileSystem with its endpoint and credentials for an s3:// storage_path, say. "
                          "Python only (not a command-line flag); it travels to the workers pickled, never "
                          "into a file."},
    )
    max_failures: int = field(
        default=0, metadata={"help": "Times to restart the workers after a failure; -1 retries forever."}
    )
    keep_workers_s: float = field(
        default=300.0,
        metadata={"help": "On a running Ray cluster (ray_address, RAY_ADDRESS): seconds the workers stay up, "
                          "idle, after the script ends, for the next run of a script of the same shape "
                          "(workers, resources, strategy, Python environment, working directory); 0 ends "
                          "them with the script."},
    )

    # -- construction ------------------------------------------------------------------------------------

    def __post_init__(self) -> None:
        # The values as given: a hosted trainer's ranks build the original arguments class from them
        # (raytrainer/hosted_recipe.py), since its __post_init__ may refuse what it derived itself.
        self.__dict__["_given"] = _snapshot(self)
        self._parse_num_workers()
        # The process view first: transformers' __post_init__ reads self.device.
        self._world_size = max(1, self.num_workers) if _is_int(self.num_workers) else 1
        self._process_index = self._local_process_index = self._node_rank = 0
        self._device = None
        if self.accelerate_config:
            self._apply_accelerate_config()
            self._parse_num_workers()
        self._fill_defaults()
        self._check_values()
        # transformers' own derivations and checks, with what the workers (not this process) decide hidden.
        hidden = {"deepspeed": None, "bf16": False, "bf16_full_eval": False}
        if self.num_workers > 0:
            hidden["tf32"] = None
        shown = {name: getattr(self, name) for name in hidden}
        for name, value in hidden.items():
            setattr(self, name, value)
        try:
            super().__post_init__()
        finally:
            for name, value in shown.items():
                setattr(self, name, value)
        if self.bf16 and not self.fp16:  # transformers' derivation, which ran with bf16 hidden
            self.mixed_precision = "bf16"
        if self.num_workers == 0:
            # a run in this process: its accelerator state is set up now, as transformers' arguments do when
            # made (they read self.device); transformers' Trainer builds its Accelerator on that state
            _ = self._setup_devices
        if self.lr_scheduler_kwargs is None:
            self.lr_scheduler_kwargs = {}
        self._check_combinations()
        self.__dict__["_derived"] = _snapshot(self)
        if self.num_workers > 0:  # the script commits to Ray workers: on a running cluster they start now
            sys.modules["raytrainer"].start_workers_early(self)  # the package's hook (raytrainer/__init__.py)

    def _parse_num_workers(self) -> None:
        """``num_workers`` as an int (the most workers) and ``min_workers`` / ``max_workers`` beside it;
        a value that is neither an int nor a range is left for ``_check_ray_values`` to refuse."""
        from raytrainer.elastic import parse_workers

        parsed = parse_workers(self.num_workers)
        low, high = parsed if isinstance(parsed, tuple) else (parsed, parsed)
        if parsed is not None:
            self.num_workers = high
        self.min_workers, self.max_workers = low, high

    @property
    def elastic(self) -> bool:
        """Whether the run trains on as many workers as the cluster holds (``num_workers=(min, max)``)."""
        return self.__dict__.get("min_workers") != self.__dict__.get("max_workers")

    def given_values(self) -> dict[str, Any]:
        """Each field as the constructor was given it, or as it was set after construction: what builds
        these arguments again (``__post_init__`` derives the rest once more)."""
        given, derived = self.__dict__.get("_given", {}), self.__dict__.get("_derived", {})
        values = {}
        for f in fields(self):
            if not f.init:
                continue
            now = getattr(self, f.name)
            unchanged = f.name in given and f.name in derived and _same(now, derived[f.name])
            values[f.name] = given[f.name] if unchanged else now
        return values

    def _apply_accelerate_config(self) -> None:
        from raytrainer.accelerate_config import values_from_accelerate_config

        defaults = {f.name: f.default if f.default is not MISSING else f.default_factory()
                    for f in fields(self)}
        for name, value in values_from_accelerate_config(self.accelerate_config).items():
            given = getattr(self, name)
            explicit = given != defaults.get(name) and given is not None
            if explicit and _normalized(given) != _normalized(value):
                raise _error(name, given, f"conflicts with accelerate_config={self.accelerate_config!r}, "
                             f"which sets {name}={value!r}",
                             f"drop --{name} (the file decides how the run is laid out) or edit the file")
            setattr(self, name, value)
            self.__dict__["_given"][name] = value  # as if given: the ranks' arguments are built from these

    def _fill_defaults(self) -> None:
        if self.output_dir is None:
            self.output_dir = "trainer_output"
        self.output_dir = os.path.expanduser(self.output_dir)
        if self.storage_path is None:
            self.storage_path = self.output_dir
        elif "://" not in self.storage_path:
            self.storage_path = os.path.expanduser(self.storage_path)
        if isinstance(self.placement_strategy, str):
            self.placement_strategy = self.placement_strategy.upper()
        if self.disable_tqdm is None:  # raytrainer's log_level decides, as it does the console's level
            level = LOG_LEVELS.get(self.log_level, -1)
            if level == -1:
                level = logging.getLogger("raytrainer").getEffectiveLevel()
            self.disable_tqdm = level > logging.WARNING
        warmup = self.warmup_steps
        if _is_number(warmup) and warmup >= 1 and warmup == int(warmup):
            self.warmup_steps = int(warmup)

    def _check_values(self) -> None:
        """The raw values, before transformers converts them: each error names the field and the fix."""
        self.eval_strategy = _to_enum("eval_strategy", self.eval_strategy, IntervalStrategy)
        self.logging_strategy = _to_enum("logging_strategy", self.logging_strategy, IntervalStrategy)
        self.save_strategy = _to_enum("save_strategy", self.save_strategy, SaveStrategy)
        self.hub_strategy = _to_enum("hub_strategy", self.hub_strategy, HubStrategy)
        self.lr_scheduler_type = _to_enum("lr_scheduler_type", self.lr_scheduler_type, SchedulerType)
        self.optim = _to_enum("optim", self.optim, OptimizerNames)
        for name in _DICT_FIELDS:
            if hasattr(self, name):
                setattr(self, name, _parse_dict(name, getattr(self, name)))
        self.fsdp = _normalize_fsdp(self.fsdp)
        self.fsdp_config, self.fsdp = _normalize_fsdp_config(self.fsdp_config, self.fsdp)
        for name, example in (("per_device_train_batch_size", 8), ("per_device_eval_batch_size", 8),
                              ("gradient_accumulation_steps", 1)):
            _check_positive_int(name, getattr(self, name), example)
        for name, example in (("eval_accumulation_steps", 10), ("torch_empty_cache_steps", 100),
                              ("save_total_limit", 2)):
            if getattr(self, name) is not None:
                _check_positive_int(name, getattr(self, name), example)
        if not (_is_number(self.learning_rate) and self.learning_rate >= 0):
            raise _error("learning_rate", self.learning_rate, "must be a number >= 0",
                         "pass e.g. --learning_rate 5e-5")
        if not (_is_int(self.max_steps) and (self.max_steps == -1 or self.max_steps > 0)):
            raise _error("max_steps", self.max_steps,
                         "must be -1 (train for num_train_epochs) or a positive integer",
                         "pass e.g. --max_steps 1000, or leave it at -1")
        if not (_is_number(self.warmup_steps) and self.warmup_steps >= 0):
            raise _error("warmup_steps", self.warmup_steps, "must be an integer >= 0 or a ratio in (0, 1)",
                         "pass e.g. --warmup_steps 100")
        if not (_is_number(self.label_smoothing_factor) and 0 <= self.label_smoothing_factor < 1):
            raise _error("label_smoothing_factor", self.label_smoothing_factor, "must be a number in [0, 1)",
                         "pass e.g. --label_smoothing_factor 0.1")
        _check_one_of("nonfinite_loss", self.nonfinite_loss, ("error", "skip_step", "ignore"))
        _check_one_of("log_level", self.log_level, tuple(LOG_LEVELS))
        _check_one_of("log_level_replica", self.log_level_replica, tuple(LOG_LEVELS))
        _check_one_of("ddp_backend", self.ddp_backend, DDP_BACKENDS)
        _check_one_of("placement_strategy", self.placement_strategy, PLACEMENT_STRATEGIES)
        if not isinstance(self.include_num_input_tokens_seen, bool):  # transformers reads True as "all"
            _check_one_of("include_num_input_tokens_seen", self.include_num_input_tokens_seen,
                          ("all", "non_padding", "no"))
        self.include_for_metrics = list(self.include_for_metrics or [])
        for item in self.include_for_metrics:
            _check_one_of("include_for_metrics", item, INCLUDE_FOR_METRICS)
        if self.train_sampling_strategy not in TRAIN_SAMPLING_STRATEGIES:
            raise _error("train_sampling_strategy", self.train_sampling_strategy,
                         "is not a sampling strategy raytrainer has",
                         f"pass one of {', '.join(TRAIN_SAMPLING_STRATEGIES)}")
        if self.dataloader_multiprocessing_context not in (None, "fork", "spawn", "forkserver"):
            raise _error("dataloader_multiprocessing_context", self.dataloader_multiprocessing_context,
                         "is not a start method", "pass fork, spawn or forkserver, or leave it unset")
        if self.dataloader_prefetch_factor is not None and self.dataloader_num_workers == 0:
            raise _error("dataloader_prefetch_factor", self.dataloader_prefetch_factor,
                         "needs data loading subprocesses, but dataloader_num_workers=0",
                         "pass e.g. --dataloader_num_workers 2, or leave dataloader_prefetch_factor unset")
        for name, strategy in (("logging_steps", "logging_strategy"), ("save_steps", "save_strategy"),
                               ("eval_steps", "eval_strategy")):
            value = getattr(self, name)
            if getattr(self, strategy) == IntervalStrategy.STEPS and value is not None:
                setattr(self, name, _normalize_steps(name, value, strategy))
        if self.report_to is None:
            self.report_to = "none"
        items = [self.report_to] if isinstance(self.report_to, str) else list(self.report_to)
        if not all(isinstance(v, str) for v in items):
            raise _error("report_to", self.report_to, "must be a string or a list of strings",
                         "pass e.g. --report_to none")
        if self.lr_scheduler_type == SchedulerType.REDUCE_ON_PLATEAU and self.eval_strategy == "no":
            raise _error("lr_scheduler_type", self.lr_scheduler_type.value, "needs evaluations, but "
                         "eval_strategy='no'", "pass e.g. --eval_strategy epoch")
        if self.load_best_model_at_end and self.save_strategy != SaveStrategy.BEST:
            self._check_best_model_intervals()
        self._check_ray_values()

    def _check_best_model_intervals(self) -> None:
        """load_best_model_at_end needs a checkpoint at every evaluation that could be the best (transformers
        checks it too, after this; here the error names both values and a fix)."""
        if self.eval_strategy.value != self.save_strategy.value:
            raise ValueError(
                "load_best_model_at_end=True requires the save and eval strategies to match (unless "
                f"save_strategy='best'), but eval_strategy={self.eval_strategy.value!r} and "
                f"save_strategy={self.save_strategy.value!r}; pass e.g. --eval_strategy "
                f"{self.save_strategy.value}, or --save_strategy best")
        save, every = self.save_steps, self.eval_steps if self.eval_steps is not None else self.logging_steps
        if self.eval_strategy != IntervalStrategy.STEPS:
            return
        if (save < 1) != (every < 1):
            is_multiple, fix = False, "give both as step counts or both as ratios in (0, 1)"
        elif save < 1:  # both ratios: compare in millionths to avoid float noise
            is_multiple = round(save * 1e6) % round(every * 1e6) == 0
            fix = "pass a save_steps ratio that is a multiple of the eval_steps ratio"
        else:
            is_multiple = save % every == 0
            fix = f"pass e.g. --save_steps {math.ceil(save / every) * every}"
        if not is_multiple:
            raise ValueError(
                f"load_best_model_at_end=True requires save_steps to be a multiple of eval_steps, but "
                f"save_steps={save!r} is not a multiple of eval_steps={every!r}; {fix}")

    def _check_ray_values(self) -> None:
        if not (_is_int(self.num_workers) and self.num_workers >= 0):
            raise _error("num_workers", self.num_workers, "must be an integer >= 0 (0 runs in this process) "
                         "or a range of workers", "pass e.g. --num_workers 2, or --num_workers 2:4 "
                         "(num_workers=(2, 4) in Python)")
        if self.elastic:
            from raytrainer import elastic

            elastic.check(self)
        if not (_is_number(self.keep_workers_s) and self.keep_workers_s >= 0):
            raise _error("keep_workers_s", self.keep_workers_s, "must be a number of seconds >= 0",
                         "pass e.g. --keep_workers_s 300, or 0 to end the workers with the script")
        if not (_is_int(self.max_failures) and self.max_failures >= -1):
            raise _error("max_failures", self.max_failures, "must be an integer >= 0, or -1 to retry forever",
                         "pass e.g. --max_failures 3")
        for key, amount in (self.resources_per_worker or {}).items():
            if not (isinstance(key, str) and _is_number(amount) and amount >= 0):
                raise _error("resources_per_worker", self.resources_per_worker,
                             f"entry {key!r}: {amount!r} must map a resource name to a number >= 0",
                             """pass e.g. --resources_per_worker '{"CPU": 2}'""")
        if self.use_gpu and self.use_cpu:
            raise _error("use_gpu", self.use_gpu, "conflicts with use_cpu=True",
                         "pass only one of --use_gpu and --use_cpu")
        if self.fp16 and self.bf16:
            raise _error("fp16", self.fp16, "cannot be combined with bf16=True",
                         "pass only one of --fp16 and --bf16")
        check_moot(self)
        check_fsdp(self)
        check_neftune(self)
        check_deepspeed(self)
        check_optim_features(self)

    def _check_combinations(self) -> None:
        self._check_storage()
        if self.save_strategy == SaveStrategy.BEST and self.metric_for_best_model is None:
            raise _error("metric_for_best_model", None,
                         "`args.metric_for_best_model` must be provided when save_strategy='best'",
                         "pass e.g. --metric_for_best_model loss")

    def _check_storage(self) -> None:
        from raytrainer.storage import scheme_of, strip_scheme

        if scheme_of(self.storage_path) not in ("", "file") and "/" not in strip_scheme(self.storage_path):
            raise _error("storage_path", self.storage_path, "is a bucket's root; a run needs its own folder",
                         f"pass e.g. --storage_path {self.storage_path.rstrip('/')}/runs/my-run")
        fs = self.storage_filesystem
        if fs is None:
            return
        import pyarrow.fs as pafs

        from raytrainer.storage import filesystem_matches

        if not isinstance(fs, pafs.FileSystem):
            raise _error("storage_filesystem", type(fs).__name__, "must be a pyarrow.fs.FileSystem",
                         "pass e.g. pyarrow.fs.S3FileSystem(endpoint_override=...), or leave it unset and "
                         "give a URI as storage_path")
        if not filesystem_matches(fs, self.storage_path):
            raise _error("storage_path", self.storage_path,
                         f"is not a location of storage_filesystem ({type(fs).__name__})",
                         "give storage_path as a URI of that filesystem's kind, e.g. s3://bucket/runs/name "
                         "for an S3FileSystem")

    def _process_fsdp_args(self):
        """raytrainer's FSDP2 strategy reads ``fsdp`` (a list of options) and ``fsdp_config`` itself; no
        accelerate plugin is made (transformers would turn ``fsdp`` into True here)."""
        return None

    # -- the process view ------------------------------------------------------------------------------

    def _set_process(self, world_size: int, rank: int, local_rank: int, node_rank: int, device=None) -> None:
        """Record which process of the run this copy lives in (called by each worker)."""
        if not (world_size >= 1 and 0 <= rank < world_size and 0 <= local_rank <= rank and node_rank >= 0):
            raise ValueError(f"_set_process(world_size={world_size}, rank={rank}, local_rank={local_rank}, "
                             f"node_rank={node_rank}): inconsistent ranks")
        self._world_size, self._process_index = world_size, rank
        self._local_process_index, self._node_rank, self._device = local_rank, node_rank, device
        self.local_rank = local_rank if world_size > 1 else -1  # transformers' field, as torchrun sets it

    @property
    def world_size(self) -> int:
        """The number of processes training together."""
        return self._world_size

    @property
    def process_index(self) -> int:
        """The global rank of this process."""
        return self._process_index

    @property
    def local_process_index(self) -> int:
        """The rank of this process on its node."""
        return self._local_process_index

    @property
    def device(self):
        """The device this process trains on: a worker's own device; on the driver, its GPU when it has one
        and ``use_cpu`` is off (where a ``num_workers=0`` run trains)."""
        if getattr(self, "_device", None) is not None:
            return self._device
        from raytrainer.rank_context import local_device

        return local_device(self)

    @property
    def parallel_mode(self):
        """``distributed`` with several processes, else ``not_parallel`` (one process per device)."""
        return ParallelMode.DISTRIBUTED if self.world_size > 1 else ParallelMode.NOT_PARALLEL

    @property
    def n_gpu(self) -> int:
        """GPUs this process uses: 1 on a CUDA device, else 0 (one device per process, as under DDP)."""
        return int(self.device.type == "cuda")

    @property
    def should_log(self) -> bool:
        """Whether this process logs: the main process of each node, or of the run (log_on_each_node)."""
        return (self.local_process_index if self.log_on_each_node else self.process_index) == 0

    @property
    def should_save(self) -> bool:
        """Whether this process writes checkpoints: per node or once per run (save_on_each_node)."""
        return (self.local_process_index if self.save_on_each_node else self.process_index) == 0

    def get_process_log_level(self) -> int:
        """The `logging` level for this process: log_level where `should_log`, else log_level_replica;
        "passive" is INFO on the main process and WARNING on replicas (raytrainer's console)."""
        if self.should_log:
            level = LOG_LEVELS[self.log_level]
            return _PASSIVE_MAIN_LEVEL if level == -1 else level
        level = LOG_LEVELS[self.log_level_replica]
        return _PASSIVE_REPLICA_LEVEL if level == -1 else level

    @contextlib.contextmanager
    def main_process_first(self, local: bool = True, desc: str = "work"):
        """Run the block on the main process (of each node if `local`) first, the others after it, at a
        barrier of the run's process group (nothing special without one)."""
        dist = _initialized_distributed()
        if dist is None or self.world_size <= 1:
            yield
            return
        is_main = (self.local_process_index if local else self.process_index) == 0
        try:
            if not is_main:
                logger.debug("%d: waiting for the main process to perform %s", self.process_index, desc)
                dist.barrier()
            yield
        finally:
            if is_main:
                dist.barrier()

    # -- serialisation ---------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """transformers' ``to_dict``; a ``storage_filesystem`` as its type's name (its options may hold
        credentials) and the process-view fields as they are."""
        fs, self.storage_filesystem = self.storage_filesystem, None
        try:
            d = super().to_dict()
        finally:
            self.storage_filesystem = fs
        d["storage_filesystem"] = type(fs).__name__ if fs is not None else None
        return copy.deepcopy(d)  # a copy: changing it leaves these arguments as they are

    def __str__(self) -> str:
        lines = "".join(f"{k}={v!r},\n" for k, v in sorted(self.to_dict().items()))
        return f"{type(self).__name__}(\n{lines})"

    __repr__ = __str__

    @classmethod
    def from_transformers(cls, hf_args, **ray_fields):
        """These arguments from a ``transformers.TrainingArguments`` (what a Trainer given one uses): every
        field that differs from transformers' default is carried over, the rest keep the defaults;
        ``ray_fields`` adds raytrainer's own (num_workers, ...). A value raytrainer refuses is refused
        here."""
        defaults = type(hf_args)(output_dir=hf_args.output_dir)
        ours = {f.name for f in fields(cls) if f.init}
        given = {}
        for f in fields(hf_args):
            if not f.init or f.name not in ours:
                continue
            value = getattr(hf_args, f.name)
            if f.name != "output_dir" and _same(value, getattr(defaults, f.name)):
                continue
            given[f.name] = value.value if isinstance(value, Enum) else value
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # transformers warned when the user made them
            return cls(**given, **ray_fields)


@dataclass(repr=False)
class TrainingArguments(RayArgumentsMixin, transformers.TrainingArguments):
    """`transformers.TrainingArguments` with raytrainer's Ray fields (`RayArgumentsMixin`): how many Ray Train
    workers to run, with which resources, where checkpoints are stored and how often to retry."""


def _same(a, b) -> bool:
    try:
        return bool(a == b)
    except Exception:  # e.g. objects whose == is elementwise
        return a is b


def _snapshot(args) -> dict[str, Any]:
    """The fields' values, copied; never a credential (a token, the storage filesystem): the arguments are
    saved with each checkpoint (training_args.bin), and these fields are withheld from it."""
    values = {}
    for f in fields(args):
        if f.init and not (f.name.endswith("_token") or f.name == "storage_filesystem"):
            value = getattr(args, f.name)
            try:
                values[f.name] = copy.deepcopy(value)
            except Exception:  # a filesystem object, say: kept as it is
                values[f.name] = value
    return values


def _initialized_distributed():
    """torch.distributed when a process group is initialized, else None (torch is never imported here)."""
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None) if torch is not None else None
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist


def _normalized(value):
    """An argument's value in one form for comparing (``"full_shard auto_wrap"`` and its list of words)."""
    if isinstance(value, str) and " " in value:
        return sorted(value.split())
    if isinstance(value, (list, tuple)):
        return sorted(str(v) for v in value)
    return value


@contextlib.contextmanager
def token_withheld(args):
    """``args.hub_token`` is None meanwhile: for pickling what the workers receive (the token stays on the
    driver, which pushes; raytrainer/hub)."""
    token, args.hub_token = args.hub_token, None
    try:
        yield
    finally:
        args.hub_token = token
