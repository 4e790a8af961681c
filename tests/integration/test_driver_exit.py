"""A driver script that ends with its Trainer still alive (as most scripts do): the Trainer's worker group
is closed before Ray's own exit handler disconnects the process. Ray registers its shutdown when it is
imported; had it run first, Ray would disconnect the driver while the group's thread still waited inside
Ray Train's run -- a race that can end a successful script with a segmentation fault."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent('''
    import atexit, sys, threading, weakref
    register = atexit.register

    def spying(func, *args, **kwargs):  # wraps Ray's exit handler when `import ray` registers it
        if getattr(func, "__name__", "") == "shutdown" and "ray" in getattr(func, "__module__", ""):
            def shutdown(*a, **kw):
                alive = sorted(t.name for t in threading.enumerate() if t.name.startswith("raytrainer-group"))
                print("GROUP THREADS AT RAY EXIT", alive, flush=True)
                return func(*a, **kw)
            return register(shutdown, *args, **kwargs)
        return register(func, *args, **kwargs)

    atexit.register = spying
    # A script's imports before raytrainer imports Ray (lazily): some create a weakref.finalize, which
    # registers the finalizers' exit handler before Ray's, so it would run after Ray's shutdown.
    weakref.finalize(spying, lambda: None)
    import torch
    from raytrainer import Trainer, TrainingArguments

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 2)

        def forward(self, x, labels=None):
            logits = self.linear(x)
            return torch.nn.functional.cross_entropy(logits, labels), logits

    data = [{"x": torch.randn(4), "labels": i % 2} for i in range(32)]
    args = TrainingArguments(output_dir=sys.argv[1], num_workers=2, max_steps=2, report_to="none",
                             disable_tqdm=True, save_strategy="no")
    trainer = Trainer(model=Net(), args=args, train_dataset=data)
    trainer.train()
    print("GROUP ALIVE AFTER TRAIN", trainer.__dict__["_group"].alive, flush=True)
''')


@pytest.mark.timeout(300)
def test_the_worker_group_is_closed_before_ray_exits(tmp_path, ray_session):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1",
           "RAY_ADDRESS": ray_session.get_runtime_context().gcs_address}
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "out")], capture_output=True,
                          text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "GROUP ALIVE AFTER TRAIN True" in proc.stdout  # warm, as a later call would use it
    assert "GROUP THREADS AT RAY EXIT []" in proc.stdout, proc.stdout[-2000:]
