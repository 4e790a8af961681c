"""ray, deepspeed and optuna are optional for a one-process run; a run that needs one names the fix."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from raytrainer import Trainer, TrainingArguments

# Run in a fresh interpreter where importing ray, deepspeed or optuna fails, as on a machine without them,
# and where probing for them (importlib.util.find_spec, as transformers and peft do on import) finds nothing.
_BLOCK = textwrap.dedent("""
    import importlib.abc, importlib.util, sys
    BLOCKED = ("ray", "deepspeed", "optuna")
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r}")
    sys.meta_path.insert(0, Block())
    _find_spec = importlib.util.find_spec
    importlib.util.find_spec = lambda name, *a, **k: (
        None if name.split(".")[0] in BLOCKED else _find_spec(name, *a, **k))
""")


def test_a_one_process_run_needs_neither_ray_nor_deepspeed_nor_optuna(tmp_path):
    script = _BLOCK + textwrap.dedent(f"""
        import torch
        from torch import nn
        from raytrainer import Trainer, TrainingArguments
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        class Wrap(nn.Module):
            def __init__(self):
                super().__init__(); self.m = model
            def forward(self, x, labels):
                return {{"loss": ((self.m(x).squeeze(-1) - labels) ** 2).mean()}}
        data = [{{"x": torch.randn(4), "labels": torch.tensor(1.0)}} for _ in range(16)]
        args = TrainingArguments(output_dir={str(tmp_path)!r}, num_workers=0, max_steps=4, report_to="none",
                                 per_device_train_batch_size=4, save_strategy="steps", save_steps=4,
                                 disable_tqdm=True, logging_steps=2)
        out = Trainer(model=Wrap(), args=args, train_dataset=data).train()
        assert not any(m.split(".")[0] in ("ray", "deepspeed", "optuna") for m in sys.modules)
        print("steps", out.global_step)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "steps 4" in proc.stdout
    assert (tmp_path / "checkpoint-4" / "model.safetensors").exists()


@pytest.mark.parametrize(("blocked", "kwargs", "names"), [
    ("ray.train", {"num_workers": 2}, ["num_workers=2", "'ray'", "pip install 'ray[train,tune]'"]),
    ("deepspeed", {"num_workers": 1, "deepspeed": {"zero_optimization": {"stage": 2}}},
     ["--deepspeed", "'deepspeed'", "pip install deepspeed"]),
])
def test_a_missing_package_is_named_on_the_driver_with_the_fix(tmp_path, monkeypatch, make_classifier,
                                                                make_examples, blocked, kwargs, names):
    monkeypatch.setitem(sys.modules, blocked, None)  # import fails as if not installed
    dataset, _, _ = make_examples(8)
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", **kwargs)
    trainer = Trainer(model=make_classifier(), args=args, train_dataset=dataset)
    with pytest.raises(ImportError) as info:
        trainer.train()
    for name in names:
        assert name in str(info.value)
    assert not (tmp_path / "checkpoint-1").exists()


def test_search_backend_names_the_missing_package(monkeypatch):
    from raytrainer.search.common import pick_backend

    monkeypatch.setitem(sys.modules, "optuna", None)
    with pytest.raises(ImportError, match=r"hyperparameter_search\(backend='optuna'\) needs the 'optuna' "
                                          r"package.*pip install optuna"):
        pick_backend("optuna")
