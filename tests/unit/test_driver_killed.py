"""The driver process killed (SIGKILL) mid-run and the script run again with resume_from_checkpoint=True:
the rerun goes on from the last committed checkpoint through the same steps, losses included, as a run
never interrupted, and pushes no checkpoint to the hub a second time. One process (num_workers=0): the
driver's own state is what is lost; Ray's side of a killed driver (its job's actors end with it) is Ray's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

from raytrainer.checkpoint import committed_checkpoints
from raytrainer.storage import Storage

SCRIPT = textwrap.dedent('''
    import json, os, signal, sys, time
    import torch
    from torch import nn
    from raytrainer import Trainer, TrainerCallback, TrainingArguments

    out, hub, kill_at, resume = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 3))

        def forward(self, x, labels=None):
            logits = self.net(x)
            return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}

    class KillAfterPushed(TrainerCallback):
        """At step kill_at's log (checkpoint kill_at - 1 committed by then), once that checkpoint is on the
        hub -- or 5 s later, if HF's rule skipped its push (the one before still running) -- the process
        dies without a word."""

        def on_log(self, args, state, control, **kwargs):
            if state.global_step != kill_at:
                return
            commits = os.path.join(hub, "commits.json")
            for _ in range(100):
                if os.path.exists(commits) and any(c["message"].endswith(f"step {kill_at - 1}")
                                                   for c in json.load(open(commits))):
                    break
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGKILL)

    g = torch.Generator().manual_seed(1)
    x = torch.randn(48, 6, generator=g)
    data = [{"x": x[i], "labels": int((x[i, 0] > 0) + (x[i, 1] > 0))} for i in range(48)]
    args = TrainingArguments(output_dir=out, num_workers=0, max_steps=10, per_device_train_batch_size=4,
                             learning_rate=0.01, save_strategy="steps", save_steps=2, logging_steps=1,
                             report_to="none", disable_tqdm=True, push_to_hub=True,
                             hub_model_id="file://" + hub, hub_strategy="every_save")
    callbacks = [KillAfterPushed()] if kill_at else []
    Trainer(model=Net(), args=args, train_dataset=data, callbacks=callbacks).train(
        resume_from_checkpoint=True if resume else None)
''')


def _run(tmp_path, name: str, kill_at: int = 0, resume: bool = False) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(script), str(tmp_path / name), str(tmp_path / f"{name}-hub"),
                           str(kill_at), "1" if resume else "0"], capture_output=True, text=True, timeout=300,
                          env=env)


def _losses(folder) -> list[tuple[int, float]]:
    state = json.loads((folder / "checkpoint-10" / "trainer_state.json").read_text())
    return [(h["step"], h["loss"]) for h in state["log_history"] if "loss" in h]


def test_a_killed_driver_reruns_the_same_steps_and_pushes_nothing_twice(tmp_path):
    reference = _run(tmp_path, "reference")
    assert reference.returncode == 0, reference.stderr[-3000:]

    killed = _run(tmp_path, "run", kill_at=5)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert not (tmp_path / "run" / "checkpoint-6").exists()
    pushed_before = [c["message"] for c in json.loads((tmp_path / "run-hub" / "commits.json").read_text())]
    assert pushed_before[0] == "Training in progress, step 2"
    # checkpoint-4 may or may not be committed: its commit waits for its files' hashing, off the training
    # thread, and the kill came while the training thread waited in a callback
    storage = Storage.from_uri(str(tmp_path / "run"))
    committed = [step for step, _ in committed_checkpoints(storage, warn=False)]
    assert committed in ([2], [2, 4]), committed
    resumed_from = committed[-1]

    rerun = _run(tmp_path, "run", resume=True)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert _losses(tmp_path / "run") == _losses(tmp_path / "reference")  # steps 1..10, the same losses
    assert [step for step, _ in _losses(tmp_path / "run")] == list(range(1, 11))
    pushed = [c["message"] for c in json.loads((tmp_path / "run-hub" / "commits.json").read_text())]
    assert len(pushed) == len(set(pushed)), pushed  # no checkpoint pushed twice
    assert pushed[:len(pushed_before)] == pushed_before
    again = [int(m.rsplit(" ", 1)[1]) for m in pushed[len(pushed_before):]]
    assert again and again[0] == resumed_from + 2, (pushed_before, pushed)  # its first save after the resume
