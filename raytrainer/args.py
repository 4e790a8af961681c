"""`TrainingArguments`: everything a raytrainer run is configured with.

Field names, types and defaults follow `TrainingArguments` as in the Hugging Face Trainer docs, so an
existing script or config file keeps working; the Ray fields at the end (`num_workers`, `use_gpu`,
`resources_per_worker`, ...) are raytrainer's own.

All checks run in `__post_init__`, on the driver, before any worker starts. Each mistake is a
`ValueError` that names the field, the value it got and how to fix it. `dataclasses.replace` builds a
new instance, so it re-validates too.

The process-related properties (`world_size`, `process_index`, `should_log`, ...) describe the
process the object lives in: on the driver they describe the rank-0 view of the run, and each worker
calls `_set_process(...)` on its own copy once it knows its rank.
"""

import contextlib
import copy
import json
import logging
import math
import os
import sys
import warnings
from dataclasses import MISSING, dataclass, field, fields
from datetime import timedelta
from enum import Enum
from typing import Any

from raytrainer.arg_types import (
    _DICT_FIELDS,
    _PASSIVE_MAIN_LEVEL,
    _PASSIVE_REPLICA_LEVEL,
    DDP_BACKENDS,
    INCLUDE_FOR_METRICS,
    LOG_LEVELS,
    PLACEMENT_STRATEGIES,
    TRAIN_SAMPLING_STRATEGIES,
    HubStrategy,
    IntervalStrategy,
    OptimizerNames,
    SaveStrategy,
    SchedulerType,
    _check_one_of,
    _check_positive_int,
    _error,
    _is_int,
    _is_number,
    _normalize_fsdp,
    _normalize_fsdp_config,
    _normalize_report_to,
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
    "SaveStrategy",
    "SchedulerType",
    "TrainingArguments",
]

logger = logging.getLogger(__name__)


@dataclass
class TrainingArguments:
    """The arguments of a raytrainer run.

    The fields mirror `TrainingArguments` as in the Hugging Face Trainer docs (same names, types and
    defaults); see their `help` texts or `--help` on the command line. The last group of fields is
    raytrainer's: how many Ray Train workers to run and with which resources.
    """

    # --- Output ---
    output_dir: str | None = field(
        default=None,
        metadata={"help": "Where checkpoints and predictions are written. Defaults to 'trainer_output'."},
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={"help": "Overwrite the content of the output directory instead of continuing from it."},
    )

    # --- What the script should do (read by scripts, not by the Trainer) ---
    do_train: bool = field(default=False, metadata={"help": "Whether to run training."})
    do_eval: bool = field(
        default=False,
        metadata={"help": "Whether to run evaluation. Set automatically when eval_strategy is not 'no'."},
    )
    do_predict: bool = field(default=False, metadata={"help": "Whether to run predictions on the test set."})
    resume_from_checkpoint: str | None = field(
        default=None, metadata={"help": "Path to a checkpoint folder to resume training from."}
    )
    restore_callback_states_from_checkpoint: bool = field(
        default=False,
        metadata={"help": "On resume, restore the saved state of stateful callbacks (EarlyStoppingCallback, "
                          "the TrainerControl, ...) also passed to this Trainer, as transformers does. A "
                          "restart after a worker failure (max_failures) always restores them."},
    )

    # --- Evaluation ---
    eval_strategy: IntervalStrategy | str = field(
        default="no", metadata={"help": "When to evaluate during training: 'no', 'steps' or 'epoch'."}
    )
    evaluation_strategy: IntervalStrategy | str | None = field(
        default=None, metadata={"help": "Deprecated alias of eval_strategy."}
    )
    prediction_loss_only: bool = field(
        default=False, metadata={"help": "When evaluating and predicting, only return the loss."}
    )
    per_device_train_batch_size: int = field(
        default=8, metadata={"help": "Batch size per worker (device) for training."}
    )
    per_device_eval_batch_size: int = field(
        default=8, metadata={"help": "Batch size per worker (device) for evaluation."}
    )
    gradient_accumulation_steps: int = field(
        default=1,
        metadata={"help": "Number of forward/backward passes to accumulate before an optimizer step."},
    )
    eval_use_gather_object: bool = field(
        default=False,
        metadata={"help": "transformers' switch for gathering non-tensor evaluation outputs: raytrainer "
                          "always gathers them as objects, so both values behave the same."},
    )
    batch_eval_metrics: bool = field(
        default=False,
        metadata={"help": "Call compute_metrics on each evaluation batch (compute_result=True on the last) "
                          "instead of once on all predictions."},
    )
    eval_accumulation_steps: int | None = field(
        default=None,
        metadata={"help": "Prediction steps to accumulate on the device before moving outputs to the CPU."},
    )
    eval_on_start: bool = field(
        default=False,
        metadata={"help": "Run a whole evaluation before the first training step, as a sanity check."},
    )
    eval_do_concat_batches: bool = field(
        default=True,
        metadata={"help": "Concatenate predictions, labels and losses across batches; False returns them as "
                          "lists, one entry per batch."},
    )
    eval_delay: float = field(
        default=0,
        metadata={"help": "Epochs or steps (per eval_strategy) to wait before the first evaluation."},
    )
    eval_steps: float | None = field(
        default=None,
        metadata={
            "help": "Evaluate every X update steps when eval_strategy='steps'; a float in (0, 1) is a ratio "
            "of the total steps. Defaults to logging_steps."
        },
    )

    # --- Optimizer and schedule ---
    learning_rate: float = field(default=5e-5, metadata={"help": "The initial learning rate."})
    weight_decay: float = field(
        default=0.0, metadata={"help": "Weight decay for all parameters except biases and LayerNorm weights."}
    )
    adam_beta1: float = field(default=0.9, metadata={"help": "Beta1 of the Adam optimizers."})
    adam_beta2: float = field(default=0.999, metadata={"help": "Beta2 of the Adam optimizers."})
    adam_epsilon: float = field(default=1e-8, metadata={"help": "Epsilon of the Adam optimizers."})
    max_grad_norm: float = field(default=1.0, metadata={"help": "Gradient clipping norm; 0 disables it."})
    num_train_epochs: float = field(default=3.0, metadata={"help": "Total number of training epochs."})
    max_steps: int = field(
        default=-1,
        metadata={"help": "If > 0, the total number of training steps; overrides num_train_epochs."},
    )
    lr_scheduler_type: SchedulerType | str = field(
        default="linear", metadata={"help": "The learning rate scheduler to use."}
    )
    lr_scheduler_kwargs: dict | str = field(
        default_factory=dict,
        metadata={"help": "Extra keyword arguments for the scheduler, as a dict or a JSON string."},
    )
    warmup_ratio: float = field(
        default=0.0, metadata={"help": "Fraction of the total steps used for a linear warmup."}
    )
    warmup_steps: float = field(
        default=0,
        metadata={
            "help": "Linear warmup steps; overrides warmup_ratio. A float in (0, 1) is a ratio of the total "
            "steps."
        },
    )
    optim: OptimizerNames | str = field(
        default="adamw_torch_fused", metadata={"help": "The optimizer to use."}
    )
    optim_args: str | None = field(default=None, metadata={"help": "Optional arguments for the optimizer."})
    optim_target_modules: str | list[str] | None = field(
        default=None,
        metadata={"help": "GaLore: the modules (names, regexes or 'all-linear') whose weights it projects."},
    )
    auto_find_batch_size: bool = field(
        default=False,
        metadata={"help": "Lower per_device_train_batch_size (x0.9 each try) until a step fits in memory; "
                          "all workers agree on one size."},
    )
    label_smoothing_factor: float = field(
        default=0.0, metadata={"help": "Label smoothing epsilon; 0 means no smoothing."}
    )

    # --- Logging ---
    log_level: str = field(
        default="passive",
        metadata={
            "help": "Logger level of the main process: debug, info, warning, error, critical or passive "
            "(raytrainer's default, info).",
            "choices": tuple(LOG_LEVELS),
        },
    )
    log_level_replica: str = field(
        default="warning",
        metadata={
            "help": "Logger level of the replica processes, same choices as log_level.",
            "choices": tuple(LOG_LEVELS),
        },
    )
    log_on_each_node: bool = field(
        default=True,
        metadata={"help": "In multi-node training, log once per node (True) or only on the main node."},
    )
    logging_dir: str | None = field(default=None, metadata={"help": "Directory for logging integrations."})
    logging_strategy: IntervalStrategy | str = field(
        default="steps", metadata={"help": "When to log during training: 'no', 'steps' or 'epoch'."}
    )
    logging_first_step: bool = field(default=False, metadata={"help": "Log the first global step."})
    logging_steps: float = field(
        default=500,
        metadata={"help": "Log every X update steps; a float in (0, 1) is a ratio of the total steps."},
    )
    logging_nan_inf_filter: bool = field(
        default=True, metadata={"help": "Filter NaN and inf losses out of the logged loss."}
    )
    nonfinite_loss: str = field(
        default="error",
        metadata={"help": "A NaN or inf training loss: 'error' stops the run before that optimizer step "
                          "(naming the rank, step and loss; never retried), 'skip_step' skips that update on "
                          "every rank with a warning, 'ignore' trains on as transformers does. 'error' and "
                          "'skip_step' read one flag per optimizer step on the host; 'skip_step' also "
                          "agrees on it across ranks (one all-reduce)."},
    )
    disable_tqdm: bool | None = field(
        default=None,
        metadata={"help": "Disable progress bars. Defaults to True when the log level is above warning."},
    )
    run_name: str | None = field(default=None, metadata={"help": "A name for the run, used by integrations."})
    report_to: str | list[str] | None = field(
        default="none",
        metadata={"help": "Integrations to report to; 'all' for every installed one, 'none' for none."},
    )
    skip_memory_metrics: bool = field(default=True, metadata={"help": "Skip the memory profiler metrics."})
    include_num_input_tokens_seen: bool = field(
        default=False, metadata={"help": "Track the number of input tokens seen during training."}
    )

    # --- Saving ---
    save_strategy: SaveStrategy | str = field(
        default="steps", metadata={"help": "When to save checkpoints: 'no', 'steps', 'epoch' or 'best'."}
    )
    save_steps: float = field(
        default=500,
        metadata={"help": "Save every X update steps; a float in (0, 1) is a ratio of the total steps."},
    )
    save_total_limit: int | None = field(
        default=None, metadata={"help": "Keep at most this many checkpoints; older ones are deleted."}
    )
    enable_jit_checkpoint: bool = field(
        default=False,
        metadata={"help": "Save a checkpoint when this process gets SIGTERM (a preemption), then stop; "
                          "num_workers=0 runs (Ray workers resume from their last checkpoint instead)."},
    )
    save_only_model: bool = field(
        default=False,
        metadata={"help": "Save only the model, not optimizer, scheduler and RNG states (no resuming)."},
    )
    save_on_each_node: bool = field(
        default=False, metadata={"help": "In multi-node training, save on every node, not only the main one."}
    )

    # --- Reproducibility and devices ---
    seed: int = field(default=42, metadata={"help": "Random seed set at the beginning of training."})
    data_seed: int | None = field(default=None, metadata={"help": "Random seed for the data samplers."})
    full_determinism: bool = field(
        default=False,
        metadata={"help": "Seed and make torch use deterministic algorithms on every worker (slower; for "
                          "debugging), instead of seeding alone."},
    )
    use_cpu: bool = field(default=False, metadata={"help": "Train on CPU even when a GPU is available."})
    bf16: bool = field(default=False, metadata={"help": "Use bfloat16 mixed precision."})
    fp16: bool = field(default=False, metadata={"help": "Use float16 mixed precision."})
    bf16_full_eval: bool = field(
        default=False, metadata={"help": "Evaluate in pure bfloat16 (model cast) when called outside train."})
    fp16_full_eval: bool = field(
        default=False, metadata={"help": "Evaluate in pure float16 (model cast) when called outside train."})
    tf32: bool | None = field(
        default=None, metadata={"help": "Allow TF32 matmuls on Ampere+ GPUs; None leaves torch's default."})

    # --- Data loading ---
    dataloader_drop_last: bool = field(default=False, metadata={"help": "Drop the last incomplete batch."})
    dataloader_num_workers: int = field(
        default=0, metadata={"help": "Data loading subprocesses per worker; 0 loads in the worker itself."}
    )
    dataloader_pin_memory: bool = field(default=True, metadata={"help": "Pin memory in the data loaders."})
    dataloader_persistent_workers: bool = field(
        default=False, metadata={"help": "Keep data loading subprocesses alive between epochs."}
    )
    dataloader_prefetch_factor: int | None = field(
        default=None, metadata={"help": "Batches loaded in advance by each data loading subprocess."}
    )
    dataloader_in_order: bool = field(
        default=True,
        metadata={"help": "Yield batches in the order the loading subprocesses were dispatched; False yields "
                          "each as soon as it is ready."},
    )
    dataloader_multiprocessing_context: str | None = field(
        default=None,
        metadata={"help": "Start method of the data loading subprocesses: fork, spawn or forkserver."},
    )
    past_index: int = field(
        default=-1, metadata={"help": "Index of the model output holding past memory states, if any."}
    )
    remove_unused_columns: bool = field(
        default=True, metadata={"help": "Remove the columns the model's forward method does not accept."}
    )
    label_names: list[str] | None = field(
        default=None, metadata={"help": "The keys of the input dict that hold the labels."}
    )
    train_sampling_strategy: str = field(
        default="random",
        metadata={"help": "Training sampler: random, sequential or group_by_length.",
                  "choices": list(TRAIN_SAMPLING_STRATEGIES)},
    )
    group_by_length: bool = field(
        default=False, metadata={"help": "Group samples of similar length into batches."}
    )
    length_column_name: str = field(
        default="length", metadata={"help": "Column with precomputed lengths, for group_by_length."}
    )
    ignore_data_skip: bool = field(
        default=False,
        metadata={"help": "When resuming, do not skip the batches already seen in the current epoch."},
    )

    # --- Best model ---
    load_best_model_at_end: bool = field(
        default=False, metadata={"help": "Load the best checkpoint at the end of training."}
    )
    metric_for_best_model: str | None = field(
        default=None,
        metadata={"help": "Metric that ranks checkpoints; defaults to 'loss' with load_best_model_at_end."},
    )
    greater_is_better: bool | None = field(
        default=None,
        metadata={"help": "Whether a greater metric is better; False by default for names ending in 'loss'."},
    )

    # --- Metrics ---
    include_inputs_for_metrics: bool = field(
        default=False, metadata={"help": "Deprecated alias of include_for_metrics=['inputs']."}
    )
    include_for_metrics: list[str] = field(
        default_factory=list,
        metadata={"help": "Extra data passed to compute_metrics: 'inputs' and/or 'loss'."},
    )

    # --- Hub ---
    push_to_hub: bool = field(default=False, metadata={"help": "Push the model to the Hub when it is saved."})
    hub_model_id: str | None = field(
        default=None, metadata={"help": "The repository to keep in sync with output_dir."}
    )
    hub_strategy: HubStrategy | str = field(
        default="every_save",
        metadata={"help": "What and when to push: 'end', 'every_save', 'checkpoint' or 'all_checkpoints'."},
    )
    hub_token: str | None = field(default=None, metadata={"help": "The token used to push to the Hub."})
    hub_private_repo: bool | None = field(
        default=None, metadata={"help": "Create the Hub repository as private (no effect if it exists)."}
    )
    hub_revision: str | None = field(
        default=None, metadata={"help": "The branch (revision) to push to; the default branch when unset."}
    )
    hub_always_push: bool = field(
        default=False,
        metadata={"help": "Push every save, even while the previous push is running (else it is skipped)."},
    )

    gradient_checkpointing: bool = field(
        default=False,
        metadata={"help": "Recompute activations in backward to save memory (models with "
                          "gradient_checkpointing_enable(), e.g. transformers models)."},
    )
    gradient_checkpointing_kwargs: dict | str | None = field(
        default=None,
        metadata={"help": "Keyword arguments for gradient_checkpointing_enable (a dict or JSON)."},
    )
    activation_checkpointing: bool | None = field(
        default=None,
        metadata={"help": "transformers 5's name for gradient checkpointing: "
                          "activation_checkpointing_enable() where the model has it, else "
                          "gradient_checkpointing_enable()."},
    )
    activation_checkpointing_kwargs: dict | str | None = field(
        default=None,
        metadata={"help": "Keyword arguments for activation checkpointing (a dict or JSON): every_n_layers, "
                          "offload, and torch.utils.checkpoint's."},
    )
    use_cache: bool = field(
        default=False,
        metadata={"help": "Set on the model's config (model.config.use_cache); training rarely needs it."},
    )
    torch_compile: bool = field(
        default=False, metadata={"help": "Train through torch.compile (set too by a backend or a mode)."}
    )
    torch_compile_backend: str | None = field(
        default=None, metadata={"help": "torch.compile backend, e.g. inductor (default) or eager."}
    )
    torch_compile_mode: str | None = field(
        default=None, metadata={"help": "torch.compile mode: default, reduce-overhead, max-autotune, ..."}
    )
    neftune_noise_alpha: float | None = field(
        default=None,
        metadata={"help": "NEFTune: add uniform noise scaled by alpha/sqrt(seq_len*dim) to the input "
                          "embeddings while training (e.g. 5)."},
    )

    # --- Distributed ---
    accelerate_config: str | None = field(
        default=None,
        metadata={"help": "An accelerate config YAML (from `accelerate config`): sets num_workers, the "
                          "strategy (DDP / FSDP with its options) and mixed precision."},
    )
    deepspeed: str | dict | None = field(
        default=None,
        metadata={"help": "DeepSpeed: the path of a DeepSpeed JSON config (or a dict); \"auto\" values are "
                          "taken from these arguments."},
    )
    fsdp: str | list[str] | bool = field(
        default="",
        metadata={"help": "FSDP options, space-separated: full_shard, shard_grad_op, hybrid_shard, "
                          "hybrid_shard_zero2, no_shard, offload, auto_wrap (e.g. 'full_shard auto_wrap')."},
    )
    fsdp_config: dict | str | None = field(
        default=None,
        metadata={"help": "FSDP settings (a dict or JSON): transformer_layer_cls_to_wrap, min_num_params, "
                          "activation_checkpointing."},
    )
    ddp_backend: str | None = field(
        default=None,
        metadata={
            "help": "torch.distributed backend: gloo, nccl, mpi, ccl or hccl.",
            "choices": DDP_BACKENDS[1:],
        },
    )
    ddp_find_unused_parameters: bool | None = field(
        default=None,
        metadata={"help": "find_unused_parameters passed to DistributedDataParallel; unset: True, except for "
                          "a transformers model with gradient checkpointing (transformers' rule)."},
    )
    ddp_bucket_cap_mb: int | None = field(
        default=None, metadata={"help": "bucket_cap_mb passed to DistributedDataParallel."}
    )
    ddp_static_graph: bool | None = field(
        default=None, metadata={"help": "static_graph passed to DistributedDataParallel."}
    )
    ddp_broadcast_buffers: bool | None = field(
        default=None, metadata={"help": "broadcast_buffers passed to DistributedDataParallel."}
    )
    ddp_timeout: int = field(
        default=1800, metadata={"help": "Timeout in seconds of the torch.distributed process group."}
    )
    average_tokens_across_devices: bool = field(
        default=True, metadata={"help": "Average the token count across workers for the loss."}
    )
    torch_empty_cache_steps: int | None = field(
        default=None, metadata={"help": "Empty the accelerator cache every X steps; None never does."}
    )

    # --- transformers' fields that Ray makes moot, or that raytrainer refuses (arg_types.check_moot) ---
    debug: str | list[str] = field(
        default="",
        metadata={"help": "Debug features: 'underflow_overflow' traces each module's inputs and outputs and "
                          "stops at the first inf/nan (transformers' DebugUnderflowOverflow, on every rank). "
                          "'tpu_metrics_debug' is refused (no TPUs on Ray workers here)."},
    )
    accelerator_config: dict | str | None = field(
        default=None,
        metadata={"help": "transformers' Accelerate options (a dict or a JSON file). raytrainer's loaders "
                          "behave as their defaults (no split_batches, no dispatch_batches, even_batches, "
                          "a seedable sampler; non_blocking copies); another value is refused."},
    )
    parallelism_config: Any = field(
        default=None,
        metadata={"help": "Accelerate's ParallelismConfig (tensor / context parallelism): refused; shard "
                          "with --fsdp or --deepspeed.", "cli": False},
    )
    use_liger_kernel: bool = field(
        default=False,
        metadata={"help": "Liger kernels: refused (raytrainer does not patch models); apply them in "
                          "model_init so every worker builds the patched model."},
    )
    liger_kernel_config: dict | None = field(
        default=None, metadata={"help": "Options of the Liger kernels (see use_liger_kernel)."}
    )
    project: str = field(
        default="huggingface",
        metadata={"help": "The project name of the Trackio integration (transformers'); raytrainer does not "
                          "ship that integration, so it only travels with the arguments."},
    )
    trackio_space_id: str | None = field(
        default=None, metadata={"help": "Trackio's Space (see project): not used by raytrainer."}
    )
    trackio_bucket_id: str | None = field(
        default=None, metadata={"help": "Trackio's Bucket (see project): not used by raytrainer."}
    )
    trackio_static_space_id: str | None = field(
        default=None, metadata={"help": "Trackio's static Space (see project): not used by raytrainer."}
    )

    # --- Ray (raytrainer's own) ---
    num_workers: int = field(
        default=0,
        metadata={
            "help": "Ray Train workers: 0 runs the training loop in this process, N >= 1 runs N actors."
        },
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
                          "Python only; it travels to the workers pickled, never into a file.",
                  "cli": False},
    )
    max_failures: int = field(
        default=0, metadata={"help": "Times to restart the workers after a failure; -1 retries forever."}
    )

    # -----------------------------------------------------------------------------------------------------

    def __post_init__(self) -> None:
        if self.accelerate_config:
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
                setattr(self, name, value)  # the file decides how the run is laid out
        self._fill_defaults()
        self._convert_types()
        self._check_values()
        self._derive_values()
        self._check_combinations()
        # The process view (not dataclass fields: not in to_dict, not on the command line).
        self._world_size = max(1, self.num_workers)
        self._process_index = 0
        self._local_process_index = 0
        self._node_rank = 0
        self._device = None

    def _fill_defaults(self) -> None:
        if self.output_dir is None:
            self.output_dir = "trainer_output"
        self.output_dir = os.path.expanduser(self.output_dir)
        if self.storage_path is None:
            self.storage_path = self.output_dir
        elif "://" not in self.storage_path:
            self.storage_path = os.path.expanduser(self.storage_path)
        # Deprecated aliases are folded into the current field and then cleared, so that a later
        # dataclasses.replace() of the current field is not overridden by the stale alias.
        if self.evaluation_strategy is not None:
            warnings.warn(
                "evaluation_strategy is deprecated, use eval_strategy instead", FutureWarning, stacklevel=4
            )
            self.eval_strategy, self.evaluation_strategy = self.evaluation_strategy, None
        self.include_for_metrics = list(self.include_for_metrics or [])
        if self.include_inputs_for_metrics:
            warnings.warn(
                "include_inputs_for_metrics is deprecated, use include_for_metrics=['inputs'] instead",
                FutureWarning,
                stacklevel=4,
            )
            if "inputs" not in self.include_for_metrics:
                self.include_for_metrics.append("inputs")
            self.include_inputs_for_metrics = False

    def _convert_types(self) -> None:
        self.eval_strategy = _to_enum("eval_strategy", self.eval_strategy, IntervalStrategy)
        self.logging_strategy = _to_enum("logging_strategy", self.logging_strategy, IntervalStrategy)
        self.save_strategy = _to_enum("save_strategy", self.save_strategy, SaveStrategy)
        self.hub_strategy = _to_enum("hub_strategy", self.hub_strategy, HubStrategy)
        self.lr_scheduler_type = _to_enum("lr_scheduler_type", self.lr_scheduler_type, SchedulerType)
        self.optim = _to_enum("optim", self.optim, OptimizerNames)
        for name in _DICT_FIELDS:
            setattr(self, name, _parse_dict(name, getattr(self, name)))
        self.fsdp = _normalize_fsdp(self.fsdp)
        self.fsdp_config, self.fsdp = _normalize_fsdp_config(self.fsdp_config, self.fsdp)
        if self.torch_compile_backend or self.torch_compile_mode:
            self.torch_compile = True  # as HF: naming a backend or a mode turns compilation on
        if self.lr_scheduler_kwargs is None:
            self.lr_scheduler_kwargs = {}
        if isinstance(self.placement_strategy, str):
            self.placement_strategy = self.placement_strategy.upper()
        self.report_to = _normalize_report_to(self.report_to)
        warmup = self.warmup_steps
        if _is_number(warmup) and warmup >= 1 and warmup == int(warmup):
            self.warmup_steps = int(warmup)

    def _check_values(self) -> None:
        _check_positive_int("per_device_train_batch_size", self.per_device_train_batch_size, 8)
        _check_positive_int("per_device_eval_batch_size", self.per_device_eval_batch_size, 8)
        _check_positive_int("gradient_accumulation_steps", self.gradient_accumulation_steps, 1)
        if self.eval_accumulation_steps is not None:
            _check_positive_int("eval_accumulation_steps", self.eval_accumulation_steps, 10)
        if self.torch_empty_cache_steps is not None:
            _check_positive_int("torch_empty_cache_steps", self.torch_empty_cache_steps, 100)
        if self.save_total_limit is not None:
            _check_positive_int("save_total_limit", self.save_total_limit, 2)
        if not (_is_number(self.learning_rate) and self.learning_rate >= 0):
            raise _error(
                "learning_rate", self.learning_rate, "must be a number >= 0", "pass e.g. --learning_rate 5e-5"
            )
        if not (_is_int(self.max_steps) and (self.max_steps == -1 or self.max_steps > 0)):
            raise _error(
                "max_steps",
                self.max_steps,
                "must be -1 (train for num_train_epochs) or a positive integer",
                "pass e.g. --max_steps 1000, or leave it at -1",
            )
        if not (_is_number(self.warmup_ratio) and 0 <= self.warmup_ratio <= 1):
            raise _error(
                "warmup_ratio",
                self.warmup_ratio,
                "must be a number in [0, 1]",
                "pass e.g. --warmup_ratio 0.1",
            )
        if not (_is_number(self.warmup_steps) and self.warmup_steps >= 0):
            raise _error(
                "warmup_steps",
                self.warmup_steps,
                "must be an integer >= 0 or a ratio in (0, 1)",
                "pass e.g. --warmup_steps 100",
            )
        if not (_is_number(self.label_smoothing_factor) and 0 <= self.label_smoothing_factor < 1):
            raise _error(
                "label_smoothing_factor",
                self.label_smoothing_factor,
                "must be a number in [0, 1)",
                "pass e.g. --label_smoothing_factor 0.1",
            )
        _check_one_of("nonfinite_loss", self.nonfinite_loss, ("error", "skip_step", "ignore"))
        _check_one_of("log_level", self.log_level, tuple(LOG_LEVELS))
        _check_one_of("log_level_replica", self.log_level_replica, tuple(LOG_LEVELS))
        _check_one_of("ddp_backend", self.ddp_backend, DDP_BACKENDS)
        _check_one_of("placement_strategy", self.placement_strategy, PLACEMENT_STRATEGIES)
        for item in self.include_for_metrics:
            _check_one_of("include_for_metrics", item, INCLUDE_FOR_METRICS)
        self._check_ray_values()

    def _check_ray_values(self) -> None:
        check_moot(self)
        check_fsdp(self)
        check_neftune(self)
        check_deepspeed(self)
        check_optim_features(self)
        if not (_is_int(self.num_workers) and self.num_workers >= 0):
            raise _error(
                "num_workers",
                self.num_workers,
                "must be an integer >= 0 (0 runs in this process)",
                "pass e.g. --num_workers 2",
            )
        if not (_is_int(self.max_failures) and self.max_failures >= -1):
            raise _error(
                "max_failures",
                self.max_failures,
                "must be an integer >= 0, or -1 to retry forever",
                "pass e.g. --max_failures 3",
            )
        for key, amount in (self.resources_per_worker or {}).items():
            if not (isinstance(key, str) and _is_number(amount) and amount >= 0):
                raise _error(
                    "resources_per_worker",
                    self.resources_per_worker,
                    f"entry {key!r}: {amount!r} must map a resource name to a number >= 0",
                    """pass e.g. --resources_per_worker '{"CPU": 2}'""",
                )
        if self.use_gpu and self.use_cpu:
            raise _error(
                "use_gpu",
                self.use_gpu,
                "conflicts with use_cpu=True",
                "pass only one of --use_gpu and --use_cpu",
            )

    def _derive_values(self) -> None:
        if self.eval_strategy != IntervalStrategy.NO:
            self.do_eval = True
        if self.eval_strategy == IntervalStrategy.STEPS and self.eval_steps is None:
            self.eval_steps = self.logging_steps
        # Interval lengths are checked (and 10.0 becomes 10) only where their strategy uses them.
        for name, strategy in (
            ("logging_steps", "logging_strategy"),
            ("eval_steps", "eval_strategy"),
            ("save_steps", "save_strategy"),
        ):
            if getattr(self, strategy) == IntervalStrategy.STEPS:
                setattr(self, name, _normalize_steps(name, getattr(self, name), strategy))
        if self.metric_for_best_model is None and (
            self.load_best_model_at_end or self.lr_scheduler_type == SchedulerType.REDUCE_ON_PLATEAU
        ):
            self.metric_for_best_model = "loss"
        if self.greater_is_better is None and self.metric_for_best_model is not None:
            self.greater_is_better = not self.metric_for_best_model.endswith("loss")
        if self.disable_tqdm is None:
            level = LOG_LEVELS[self.log_level]
            if level == -1:
                level = logging.getLogger("raytrainer").getEffectiveLevel()
            self.disable_tqdm = level > logging.WARNING
        if self.use_cpu:
            self.dataloader_pin_memory = False

    def _check_combinations(self) -> None:
        self._check_storage()
        if self.enable_jit_checkpoint and self.num_workers > 0:
            raise _error(
                "enable_jit_checkpoint", True,
                f"saves when the training process gets SIGTERM, but with num_workers={self.num_workers} "
                "training runs on Ray workers (a preempted worker is replaced and the run resumes from its "
                "last committed checkpoint, with max_failures)",
                "drop --enable_jit_checkpoint and set --max_failures (and save_steps) for preemptible nodes, "
                "or use --num_workers 0")
        if self.fp16 and self.bf16:
            raise _error(
                "fp16", self.fp16, "cannot be combined with bf16=True", "pass only one of --fp16 and --bf16"
            )
        if self.load_best_model_at_end and self.save_strategy != SaveStrategy.BEST:
            self._check_best_model_intervals()
        if self.save_strategy == SaveStrategy.BEST and self.metric_for_best_model is None:
            raise _error(
                "metric_for_best_model",
                None,
                "`args.metric_for_best_model` must be provided when save_strategy='best'",
                "pass e.g. --metric_for_best_model loss",
            )
        plateau = self.lr_scheduler_type == SchedulerType.REDUCE_ON_PLATEAU
        if plateau and self.eval_strategy == IntervalStrategy.NO:
            raise _error(
                "lr_scheduler_type",
                self.lr_scheduler_type.value,
                "needs evaluations, but eval_strategy='no'",
                "pass e.g. --eval_strategy epoch",
            )
        if self.train_sampling_strategy not in TRAIN_SAMPLING_STRATEGIES:
            raise _error("train_sampling_strategy", self.train_sampling_strategy,
                         "is not a sampling strategy raytrainer has",
                         f"pass one of {', '.join(TRAIN_SAMPLING_STRATEGIES)}")
        if self.dataloader_multiprocessing_context not in (None, "fork", "spawn", "forkserver"):
            raise _error("dataloader_multiprocessing_context", self.dataloader_multiprocessing_context,
                         "is not a start method", "pass fork, spawn or forkserver, or leave it unset")
        if self.dataloader_prefetch_factor is not None and self.dataloader_num_workers == 0:
            raise _error(
                "dataloader_prefetch_factor",
                self.dataloader_prefetch_factor,
                "needs data loading subprocesses, but dataloader_num_workers=0",
                "pass e.g. --dataloader_num_workers 2, or leave dataloader_prefetch_factor unset",
            )

    def _check_best_model_intervals(self) -> None:
        """load_best_model_at_end needs a checkpoint at every evaluation that could be the best."""
        if self.eval_strategy.value != self.save_strategy.value:
            raise ValueError(
                "load_best_model_at_end=True requires the save and eval strategies to match (unless "
                f"save_strategy='best'), but eval_strategy={self.eval_strategy.value!r} and "
                f"save_strategy={self.save_strategy.value!r}; pass e.g. --eval_strategy "
                f"{self.save_strategy.value}, or --save_strategy best"
            )
        if self.eval_strategy != IntervalStrategy.STEPS:
            return
        save, every = self.save_steps, self.eval_steps
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
                f"save_steps={save!r} is not a multiple of eval_steps={every!r}; {fix}"
            )

    # --- The process view ----------------------------------------------------------------------------------

    def _set_process(self, world_size: int, rank: int, local_rank: int, node_rank: int,
                     device=None) -> None:
        """Record which process of the run this copy lives in (called by each worker)."""
        if not (world_size >= 1 and 0 <= rank < world_size and 0 <= local_rank <= rank and node_rank >= 0):
            raise ValueError(
                f"_set_process(world_size={world_size}, rank={rank}, local_rank={local_rank}, "
                f"node_rank={node_rank}): inconsistent ranks"
            )
        self._world_size = world_size
        self._process_index = rank
        self._local_process_index = local_rank
        self._node_rank = node_rank
        self._device = device

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
    def train_batch_size(self) -> int:
        """The batch size of one training step on one worker."""
        return self.per_device_train_batch_size

    @property
    def eval_batch_size(self) -> int:
        """The batch size of one evaluation step on one worker."""
        return self.per_device_eval_batch_size

    @property
    def device(self):
        """The device this process trains on (transformers' name): a worker's own device; on the driver,
        its GPU when it has one and ``use_cpu`` is off (where a ``num_workers=0`` run trains)."""
        if getattr(self, "_device", None) is not None:
            return self._device
        from raytrainer.worker.context import local_device

        return local_device(self)

    @property
    def local_rank(self) -> int:
        """transformers' (deprecated) name for ``local_process_index``; -1 in a one-process run."""
        return self.local_process_index if self.world_size > 1 else -1

    @property
    def parallel_mode(self):
        """transformers' ParallelMode: ``distributed`` with several processes, else ``not_parallel``."""
        from raytrainer.arg_types import ParallelMode

        return ParallelMode.DISTRIBUTED if self.world_size > 1 else ParallelMode.NOT_PARALLEL

    @property
    def n_gpu(self) -> int:
        """GPUs this process uses: 1 on a CUDA device, else 0 (one device per process, as under DDP)."""
        return int(self.device.type == "cuda")

    @property
    def ddp_timeout_delta(self) -> timedelta:
        return timedelta(seconds=self.ddp_timeout)

    @property
    def should_log(self) -> bool:
        """Whether this process logs: the main process of each node, or of the run (log_on_each_node)."""
        if self.log_on_each_node:
            return self.local_process_index == 0
        return self.process_index == 0

    @property
    def should_save(self) -> bool:
        """Whether this process writes checkpoints: per node or once per run (save_on_each_node)."""
        if self.save_on_each_node:
            return self.local_process_index == 0
        return self.process_index == 0

    def get_process_log_level(self) -> int:
        """The `logging` level for this process: log_level where `should_log`, else log_level_replica."""
        if self.should_log:
            level = LOG_LEVELS[self.log_level]
            return _PASSIVE_MAIN_LEVEL if level == -1 else level
        level = LOG_LEVELS[self.log_level_replica]
        return _PASSIVE_REPLICA_LEVEL if level == -1 else level

    def get_warmup_steps(self, num_training_steps: int) -> int:
        """Warmup steps: warmup_steps (a count, or a ratio when below 1), else warmup_ratio of the total."""
        if self.warmup_steps >= 1:
            return int(self.warmup_steps)
        ratio = self.warmup_steps if self.warmup_steps > 0 else self.warmup_ratio
        return math.ceil(num_training_steps * ratio)

    @contextlib.contextmanager
    def main_process_first(self, local: bool = True, desc: str = "work"):
        """Run the block on the main process (of each node if `local`) first, the others after it.

        The other processes wait at a barrier until the main one has finished the block, e.g. to
        preprocess a dataset once and let the replicas load it from the cache. Without an initialized
        torch.distributed process group this does nothing special.
        """
        dist = _initialized_distributed()
        if dist is None or self.world_size <= 1:
            yield
            return
        is_main = (self.local_process_index if local else self.process_index) == 0
        who = "main local process" if local else "main process"
        try:
            if not is_main:
                logger.debug("%d: waiting for the %s to perform %s", self.process_index, who, desc)
                dist.barrier()
            yield
        finally:
            if is_main:
                logger.debug("%d: %s completed %s, releasing the replicas", self.process_index, who, desc)
                dist.barrier()

    # --- Serialization -------------------------------------------------------------------------------------

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

    @classmethod
    def from_transformers(cls, hf_args, **ray_fields) -> "TrainingArguments":
        """These arguments from a ``transformers.TrainingArguments`` (what a Trainer given one uses): every
        field that differs from transformers' default is carried over (enums as their values), the rest
        keep the defaults, which are transformers' (tests/unit/test_args_parity.py); ``ray_fields`` adds
        raytrainer's own (num_workers, ...). A value raytrainer refuses is refused here, by name."""
        defaults = type(hf_args)(output_dir=hf_args.output_dir)
        ours = {f.name for f in fields(cls) if f.init}
        given = {}
        for f in fields(hf_args):
            if not f.init or f.name not in ours:
                continue
            value = getattr(hf_args, f.name)
            if f.name not in ("output_dir",) and value == getattr(defaults, f.name):
                continue
            if isinstance(value, Enum):
                value = value.value
            elif isinstance(value, list):
                value = [v.value if isinstance(v, Enum) else v for v in value]
            given[f.name] = value
        return cls(**given, **ray_fields)

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain values: enums become strings, tokens are hidden."""
        result = {}
        for f in fields(self):
            if not f.init:
                continue
            value = getattr(self, f.name)
            if f.name == "storage_filesystem" and value is not None:
                value = type(value).__name__  # the object's options may hold credentials
            elif isinstance(value, Enum):
                value = value.value
            elif isinstance(value, list):
                value = [v.value if isinstance(v, Enum) else v for v in value]
            else:
                value = copy.deepcopy(value)
            if f.name.endswith("_token") and value is not None:
                value = f"<{f.name.upper()}>"
            result[f.name] = value
        return result

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def to_sanitized_dict(self) -> dict[str, Any]:
        """The fields with only bool/int/float/str/tensor values (others as str), e.g. for TensorBoard."""
        d = self.to_dict()
        d.update(train_batch_size=self.train_batch_size, eval_batch_size=self.eval_batch_size)
        valid = [bool, int, float, str]
        torch = sys.modules.get("torch")
        if torch is not None:
            valid.append(torch.Tensor)
        return {k: v if type(v) in valid else str(v) for k, v in d.items()}

    def __repr__(self) -> str:
        lines = "".join(f"{k}={v!r},\n" for k, v in sorted(self.to_dict().items()))
        return f"{type(self).__name__}(\n{lines})"

    __str__ = __repr__


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
