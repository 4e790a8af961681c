"""Ray's preemption notice on Ray workers: every rank saves a checkpoint at the same step boundary, the run
goes on, and a restart resumes from that checkpoint (worker/preemption.py)."""

from __future__ import annotations

import json

import pytest
from models import PreemptionNoticeAt, Regressor, make_data

from raytrainer import Trainer, TrainingArguments


@pytest.mark.timeout(300)
def test_a_notice_on_one_rank_saves_a_checkpoint_on_every_rank_one_step_later_and_the_run_goes_on(
        tmp_path, capfd):
    args = TrainingArguments(output_dir=str(tmp_path / "out"), num_workers=2, max_steps=8,
                             per_device_train_batch_size=4, save_strategy="no", logging_steps=1,
                             report_to="none", disable_tqdm=True, seed=3)
    trainer = Trainer(model=Regressor(), args=args, train_dataset=make_data(64),
                      callbacks=[PreemptionNoticeAt(rank=1, step=3)])
    capfd.readouterr()
    assert trainer.train().global_step == 8
    console = "".join(capfd.readouterr())
    # rank 1 flagged the notice at step 3; the ranks agreed on it at the end of step 4 (one step behind)
    assert sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*")) == ["checkpoint-4"]
    checkpoint = tmp_path / "out" / "checkpoint-4"
    assert json.loads((checkpoint / "trainer_state.json").read_text())["global_step"] == 4
    files = {p.name for p in checkpoint.iterdir()}
    assert {"manifest.json", "rng_state_0.safetensors", "rng_state_1.safetensors"} <= files  # committed
    assert "every rank saves a checkpoint at step 4" in console
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 8  # training went on after the save: steps 5 to 8 ran

    # what a restart after the node went does (raytrainer passes Ray's restart the latest committed
    # checkpoint): the resumed run ends with the same weights as the uninterrupted one
    resumed = Trainer(model=Regressor(), args=args, train_dataset=make_data(64))
    assert resumed.train(resume_from_checkpoint=str(checkpoint)).global_step == 8
    for (name, a), b in zip(trainer.model.state_dict().items(), resumed.model.state_dict().values()):
        assert a.equal(b), name
    trainer.close()
    resumed.close()
