"""The driver's straggler rule (driver/pace.py) on reports as rank 0 sends them; the 2-worker run that
slows one rank down is tests/integration/test_ddp.py::test_a_slow_worker_is_named_by_the_straggler_warning."""

from __future__ import annotations

from raytrainer.driver.pace import StragglerWatch
from raytrainer.protocol import Pace

NODES = ["10.0.0.1", "10.0.0.1", "10.0.0.2", "10.0.0.2"]


def _report(*seconds):
    return Pace(list(seconds), NODES[:len(seconds)])


def test_a_rank_slow_in_two_reports_in_a_row_is_named_once_with_its_node():
    watch = StragglerWatch()
    assert watch.observe(_report(0.010, 0.011, 0.200, 0.012)) == []  # the first report may be warm-up
    (message,) = watch.observe(_report(0.010, 0.011, 0.180, 0.012))
    assert message.startswith("rank 2 on node 10.0.0.2 is a straggler: its own work (reading batches, "
                              "forward) takes 0.190 s per step against 0.011 s on the other ranks (median)")
    assert watch.observe(_report(0.010, 0.011, 0.190, 0.012)) == []  # said once per run
    assert watch.warned == {2}


def test_the_pace_named_is_the_mean_of_the_slow_reports():
    """accelerate's loader reads one batch ahead: of an epoch of 4 steps reported every 2, a rank that reads
    each batch 0.15 s slower reads 3 batches in the first report and 1 in the second. Its pace is 0.15."""
    watch = StragglerWatch()
    assert watch.observe(_report(0.001, 0.452 / 2)) == []
    (message,) = watch.observe(_report(0.001, 0.152 / 2))
    assert "takes 0.151 s per step against 0.001 s" in message


def test_one_slow_report_resets_and_noise_is_not_a_straggler():
    watch = StragglerWatch()
    assert watch.observe(_report(0.01, 0.30)) == []
    assert watch.observe(_report(0.01, 0.01)) == []  # a pause (GC, a checkpoint), not a slow rank
    assert watch.observe(_report(0.01, 0.30)) == []
    # three times slower, but by 2 ms a step: under min_gap, clock noise at millisecond steps
    for _ in range(3):
        assert watch.observe(_report(0.001, 0.003)) == []
    # evenly slow ranks: nobody stands out
    for _ in range(3):
        assert watch.observe(_report(0.5, 0.5, 0.52, 0.49)) == []
    assert watch.warned == set()


def test_one_rank_alone_has_no_straggler_and_nodes_are_optional():
    watch = StragglerWatch()
    assert watch.observe(Pace([5.0], None)) == []
    watch.observe(Pace([0.4, 0.01], None))
    (message,) = watch.observe(Pace([0.4, 0.01], None))
    assert message.startswith("rank 0 is a straggler")


def test_the_pace_meter_counts_batch_reading_and_training_forwards_only():
    import time

    import torch

    from raytrainer.rank_context import RankContext
    from raytrainer.worker.pace import PaceMeter

    class Slow(torch.nn.Module):
        def forward(self, x):
            time.sleep(0.05)
            return x

    model = Slow()
    meter = PaceMeter(model, RankContext())
    for _ in range(2):  # two steps: 0.02 s reading the batch, one 0.05 s forward
        started = time.perf_counter()
        time.sleep(0.02)
        meter.fetching(started)
        model(torch.zeros(1))
    model.eval()
    model(torch.zeros(1))  # an evaluation forward is not training work
    (per_step,) = meter.slots()
    assert 0.07 <= per_step < 0.2
    assert meter.slots() == [0.0]  # each window starts afresh
    meter.close()
    assert not model._forward_hooks and not model._forward_pre_hooks

    quiet = PaceMeter(model, RankContext(), time_forward=False)  # under torch.compile
    assert not model._forward_hooks
    quiet.close()


def test_transformers_loop_reports_each_ranks_pace_every_logging_steps(tmp_path):
    """A hosted rank's meter (worker/pace.PaceCallback) in transformers' own loop: the batch reading is timed
    around ``get_batch_samples`` (a collator sleeping 0.03 s), the training forwards by the meter's hooks,
    and a report goes out every ``logging_steps`` steps."""
    import time

    import torch
    import transformers

    from raytrainer.data import default_data_collator
    from raytrainer.rank_context import RankContext
    from raytrainer.worker.pace import PaceCallback

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 2)

        def forward(self, x, labels=None):
            return {"loss": torch.nn.functional.cross_entropy(self.linear(x), labels)}

    def slow_collator(examples):
        time.sleep(0.03)
        return default_data_collator(examples)

    rows = [{"x": torch.randn(4), "labels": i % 2} for i in range(32)]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=6, logging_steps=2,
                                          per_device_train_batch_size=4, report_to="none", use_cpu=True,
                                          save_strategy="no", disable_tqdm=True)
    trainer = transformers.Trainer(model=Net(), args=args, train_dataset=rows, data_collator=slow_collator)
    reports = []
    trainer.add_callback(PaceCallback(trainer, RankContext(), reports.append))
    trainer.train()
    assert len(reports) == 3  # steps 2, 4 and 6
    for report in reports:
        (seconds,) = report.seconds_per_step
        assert 0.03 <= seconds < 0.5, report
    assert not trainer.model._forward_hooks  # the meter's hooks are gone after train()
