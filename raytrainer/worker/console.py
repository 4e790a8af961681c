"""transformers.Trainer's console lines, with its words, on its loggers.

What transformers.Trainer logs about a run ("***** Running training *****" and its figures, the resume
lines, "Training completed", "Saving model checkpoint to", the evaluation header, the warning about
arguments that differ from a resumed checkpoint's) raytrainer logs the same way on the same loggers
(``transformers.trainer``, ``transformers.trainer_utils``), so ``log_level`` /
``transformers.logging.set_verbosity_*`` and tools that capture transformers' logs see them where they
would. On a worker they go through the rank's log routing like every record (worker/logs.py): the main
rank's reach the driver's console, the replicas' stay below ``log_level_replica``. raytrainer's own
messages (Ray, storage, checkpoints' commits) stay under ``raytrainer.*``.
"""

from __future__ import annotations

import logging

import torch

from raytrainer.trainer_utils import has_length

logger = logging.getLogger("transformers.trainer")


def trainable_parameters(model: torch.nn.Module) -> int:
    """Trainable parameters of the whole model, also when this rank holds a share (FSDP2's DTensors report
    their global size; ZeRO-3's partitioned parameters their ``ds_numel``)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad)


def _num_examples(trainer, dataloader) -> int | None:
    return trainer.num_examples(dataloader) if has_length(dataloader) else None


def announce_training(trainer, dataloader, num_epochs: int, updates_per_epoch: int, max_steps: int,
                      resumed_at: tuple[int, int] | None) -> None:
    """transformers' lines at the start of ``train()``; ``resumed_at`` = (epochs done, batches to skip)."""
    args, num_examples = trainer.args, _num_examples(trainer, dataloader)
    total = args.train_batch_size * args.gradient_accumulation_steps * trainer._ctx.dp_size
    logger.info("***** Running training *****")
    logger.info("  Num examples: Unknown" if num_examples is None else f"  Num examples = {num_examples:,}")
    logger.info(f"  Num Epochs = {num_epochs:,}")
    logger.info(f"  Num update steps per epoch = {updates_per_epoch:,}")
    logger.info(f"  Instantaneous batch size per device = {args.per_device_train_batch_size:,}")
    logger.info(f"  Total train batch size (w. parallel, distributed & accumulation) = {total:,}")
    logger.info(f"  Gradient Accumulation steps = {args.gradient_accumulation_steps}")
    logger.info(f"  Total optimization steps = {max_steps:,}")
    logger.info(f"  Number of trainable parameters = {trainable_parameters(trainer.model):,}")
    if resumed_at is not None:
        epochs, batches = resumed_at
        logger.info(f"  Resuming training from checkpoint with epoch {epochs} and global step "
                    f"{trainer.state.global_step}")
        if not args.ignore_data_skip:
            logger.info(f"  Fast-forwarding the dataloader past {epochs} epochs and {batches} batches to "
                        "resume from the exact training state.")


def compare_with_checkpoint(args, saved_state) -> None:
    """transformers' warning when logging/eval/save steps or the batch size differ from the checkpoint's
    (its own function: the same rule and words)."""
    from transformers.trainer_utils import compare_trainer_and_checkpoint_args

    compare_trainer_and_checkpoint_args(args, saved_state)


def announce_evaluation(trainer, description: str, dataloader) -> None:
    num_examples, batch_size = _num_examples(trainer, dataloader), trainer.args.eval_batch_size
    logger.info(f"\n***** Running {description} *****")
    logger.info(f"  Num examples = {num_examples}" if num_examples is not None else "  Num examples: Unknown")
    logger.info(f"  Batch size = {batch_size}")


def training_completed() -> None:
    logger.info("\n\nTraining completed. Do not forget to share your model on huggingface.co/models =)\n\n")


def saving_checkpoint(folder: str) -> None:
    logger.info(f"Saving model checkpoint to {folder}")
