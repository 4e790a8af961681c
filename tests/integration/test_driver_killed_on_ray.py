"""The driver of a 2-worker run killed (SIGKILL) mid-run, and the script run again with
resume_from_checkpoint=True: Ray ends the killed driver's actors and placement group (they are owned by its
job), and the rerun -- a new driver whose output_dir is empty, the same storage_path -- goes on from the
last committed checkpoint in storage through the same steps and losses as a run
never interrupted, pushing no checkpoint to the hub a second time. The one-process version of this scenario
is tests/unit/test_driver_killed.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from raytrainer.checkpoint import committed_checkpoints
from raytrainer.storage import Storage

SCRIPT = textwrap.dedent('''
    import json, os, signal, sys, time
    import ray
    import torch
    from torch import nn
    from raytrainer import Trainer, TrainerCallback, TrainingArguments

    out, hub, kill_at, resume = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
    storage = sys.argv[5] or None

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))

        def forward(self, x, labels=None):
            logits = self.net(x)
            return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}

    class Pace(TrainerCallback):
        """On the workers: a step takes at least 0.4 s, so the driver's kill lands mid-run."""
        def on_step_end(self, args, state, control, **kwargs):
            time.sleep(0.4)

    class KillTheDriver(TrainerCallback):
        """On the driver (on_driver): when rank 0's log of step kill_at arrives and checkpoint kill_at - 1
        is on the hub, this process -- the driver -- dies without a word."""
        on_driver = True

        def on_log(self, args, state, control, **kwargs):
            if state.global_step < kill_at:
                return
            print("JOB", ray.get_runtime_context().get_job_id(), flush=True)
            commits = os.path.join(hub, "commits.json")
            for _ in range(200):
                if os.path.exists(commits) and any(c["message"].endswith(f"step {kill_at - 1}")
                                                   for c in json.load(open(commits))):
                    break
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGKILL)

    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 6, generator=g)
    data = [{"x": x[i], "labels": int((x[i, 0] > 0) + (x[i, 1] > 0))} for i in range(64)]
    args = TrainingArguments(output_dir=out, storage_path=storage, num_workers=2, max_steps=12,
                             per_device_train_batch_size=4,
                             learning_rate=0.01, save_strategy="steps", save_steps=2, logging_steps=1,
                             report_to="none", disable_tqdm=True, push_to_hub=True, optim="adamw_torch",
                             hub_model_id="file://" + hub, hub_strategy="every_save")
    callbacks = [Pace()] + ([KillTheDriver()] if kill_at else [])
    Trainer(model=Net(), args=args, train_dataset=data, callbacks=callbacks).train(
        resume_from_checkpoint=True if resume else None)
''')


def _run(tmp_path, address: str, name: str, kill_at: int = 0, resume: bool = False,
         out: str | None = None):
    """The script, its checkpoints in ``tmp_path/name`` (``storage_path``: the run's shared storage) and its
    ``output_dir`` at ``tmp_path/out`` (``name`` when not given)."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_ADDRESS": address}
    storage = str(tmp_path / name) if out else ""
    return subprocess.run([sys.executable, str(script), str(tmp_path / (out or name)),
                           str(tmp_path / f"{name}-hub"), str(kill_at), "1" if resume else "0", storage],
                          capture_output=True, text=True, timeout=300, env=env)


def _losses(folder) -> list[tuple[int, float]]:
    state = json.loads((folder / "checkpoint-12" / "trainer_state.json").read_text())
    return [(h["step"], h["loss"]) for h in state["log_history"] if "loss" in h]


@pytest.mark.timeout(600)
def test_a_killed_ray_driver_leaves_no_actor_and_the_rerun_resumes_the_same_steps(tmp_path, ray_session):
    from ray_state import alive_actors, live_placement_groups

    address = ray_session.get_runtime_context().gcs_address
    reference = _run(tmp_path, address, "reference")
    groups_before = live_placement_groups()
    assert reference.returncode == 0, reference.stderr[-3000:]

    # the run's checkpoints in its storage (storage_path), apart from the driver's output_dir
    killed = _run(tmp_path, address, "run", kill_at=5, out="first-driver")
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-2000:] + killed.stderr[-3000:]
    job = killed.stdout.split("JOB ", 1)[1].split()[0]

    def left():  # the killed job's actors, and the placement groups made since, that Ray has not yet ended
        return ([a["ActorClassName"] for a in alive_actors(job=job)],
                sorted(live_placement_groups() - groups_before))

    deadline = time.monotonic() + 60
    while left() != ([], []) and time.monotonic() < deadline:
        time.sleep(1)
    assert left() == ([], []), left()

    storage = Storage.from_uri(str(tmp_path / "run"))
    committed = [step for step, _ in committed_checkpoints(storage, warn=False)]
    assert committed and committed[-1] < 12, committed  # killed mid-run, after checkpoint 4 was pushed
    pushed_before = [c["message"] for c in json.loads((tmp_path / "run-hub" / "commits.json").read_text())]
    assert "Training in progress, step 4" in pushed_before

    # a new driver (on another machine, say): an empty output_dir, the same storage_path
    assert not (tmp_path / "second-driver").exists()
    rerun = _run(tmp_path, address, "run", resume=True, out="second-driver")
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert _losses(tmp_path / "run") == _losses(tmp_path / "reference")  # steps 1..12, the same losses
    assert [step for step, _ in _losses(tmp_path / "run")] == list(range(1, 13))
    pushed = [c["message"] for c in json.loads((tmp_path / "run-hub" / "commits.json").read_text())]
    assert len(pushed) == len(set(pushed)), pushed  # no checkpoint pushed twice
    assert pushed[:len(pushed_before)] == pushed_before
    again = [int(m.rsplit(" ", 1)[1]) for m in pushed[len(pushed_before):]]
    assert again and again[0] > committed[-1], (committed, pushed)  # saves after the resume point only
