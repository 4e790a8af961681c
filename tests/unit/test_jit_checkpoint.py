"""enable_jit_checkpoint: SIGTERM -> a checkpoint at the next step boundary, then a clean stop (transformers'
own JITCheckpointCallback, driving raytrainer's checkpoint writer); the run resumes from it."""

from __future__ import annotations

import os
import signal
import time

import transformers
from transformers.trainer_jit_checkpoint import JITCheckpointCallback

from raytrainer import Trainer, TrainerCallback, TrainingArguments
from raytrainer.checkpoint import committed_checkpoints
from raytrainer.storage import Storage


class SigtermAt(TrainerCallback):
    """Sends this process SIGTERM at the end of step ``step`` (as a preemption would), then waits for the
    JIT manager's grace timer (kill_wait, set to 0 here) to fire."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.3)


def test_sigterm_saves_a_checkpoint_stops_and_resumes(tmp_path, make_classifier, make_examples):
    dataset, _, _ = make_examples(64)
    original = signal.getsignal(signal.SIGTERM)

    def args():
        return TrainingArguments(output_dir=str(tmp_path), num_workers=0, max_steps=20, report_to="none",
                                 per_device_train_batch_size=2, save_strategy="no", disable_tqdm=True,
                                 enable_jit_checkpoint=True, data_seed=0)

    trainer = Trainer(model=make_classifier(), args=args(), train_dataset=dataset, callbacks=[SigtermAt(3)])
    jit = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, JITCheckpointCallback)]
    assert len(jit) == 1 and jit[0].trainer is trainer
    jit[0].jit_manager.kill_wait = 0
    out = trainer.train()
    # raytrainer's own loop: the JIT callback (after SigtermAt in the list) saw the request in the same
    # on_step_end: it saved step 3 and stopped the run there, not at 20. transformers' loop adds its JIT
    # callback before the script's: it sees the request at step 4's on_step_begin, saves step 3's state there
    # and stops after step 4's update, as transformers.Trainer does
    assert out.global_step == (4 if issubclass(Trainer, transformers.Trainer) else 3)
    assert [step for step, _ in committed_checkpoints(Storage.from_uri(str(tmp_path)))] == [3]
    assert not (tmp_path / "checkpoint-3" / "checkpoint-is-incomplete.txt").exists()
    assert signal.getsignal(signal.SIGTERM) is original  # restored at train end

    resumed = Trainer(model=make_classifier(seed=5), args=args(), train_dataset=dataset)
    assert resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3")).global_step == 20
    assert signal.getsignal(signal.SIGTERM) is original


def test_with_ray_workers_the_driver_installs_no_sigterm_handler(tmp_path, make_classifier):
    """With Ray workers a preemption reaches the ranks as Ray's notice (worker/preemption.py; tested in
    tests/integration/test_preemption.py): the driver's process keeps its own SIGTERM handling."""
    original = signal.getsignal(signal.SIGTERM)
    args = TrainingArguments(output_dir=str(tmp_path), num_workers=2, enable_jit_checkpoint=True,
                             report_to="none")
    trainer = Trainer(model=make_classifier(), args=args)
    assert not [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, JITCheckpointCallback)]
    assert signal.getsignal(signal.SIGTERM) is original
