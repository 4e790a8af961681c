"""Failures classified on Ray workers: a deterministic one ends the run at once whatever max_failures says."""

from __future__ import annotations

import pytest
from console_lines import RAY_LINE, not_ours
from models import CountTrainingStarts, HostedInfLossOnRank, InfLossOnRank, Regressor, make_data

from raytrainer import TrainingArguments
from raytrainer.worker.nonfinite import NonFiniteLossError


@pytest.mark.parametrize("host", ["raytrainer", "transformers"])
def test_a_nonfinite_loss_on_one_rank_stops_the_run_and_is_not_retried(tmp_path, host):
    """nonfinite_loss='error' (the default) in raytrainer's loop and in transformers' own on the workers."""
    import transformers

    import raytrainer

    Args, trainer_cls = TrainingArguments, InfLossOnRank
    if host == "transformers":
        Args, trainer_cls = raytrainer.config_on_ray(transformers.TrainingArguments), HostedInfLossOnRank
    args = Args(output_dir=str(tmp_path), num_workers=2, max_failures=1, max_steps=4,
                per_device_train_batch_size=4, save_strategy="steps", save_steps=1, report_to="none",
                disable_tqdm=True)
    trainer = trainer_cls(model=Regressor(), args=args, train_dataset=make_data(32),
                          callbacks=[CountTrainingStarts()])
    with pytest.raises(NonFiniteLossError, match=r"rank 1 computed a training loss of inf in the update to "
                                                 r"step 2") as info:
        trainer.train()
    assert any("rank 1; a deterministic failure: not retried" in note
               for note in getattr(info.value, "__notes__", []))
    # Ray restarted the workers (max_failures=1), but nothing trained again: one start per rank
    assert sorted((tmp_path / "train-starts").read_text().split("\n")) == ["", "rank 0", "rank 1"]
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-1"]  # before the bad step


def test_the_console_shows_the_run_and_its_prints_not_ray_s_internals(tmp_path, capfd):
    """At default log levels: what the workers' code prints reaches the console once per line (with its
    rank), Ray's own lines (controller, worker-group start) do not, nor transformers' INFO lines."""
    from models import PrintingTrainer

    args = TrainingArguments(output_dir=str(tmp_path), num_workers=2, max_steps=3, save_strategy="no",
                             per_device_train_batch_size=4, report_to="none", disable_tqdm=True)
    capfd.readouterr()
    PrintingTrainer(model=Regressor(), args=args, train_dataset=make_data(32)).train()
    console = "".join(capfd.readouterr())
    assert console.count("PRINTED-BY-RANK-0") == 1 and "[rank0] PRINTED-BY-RANK-0" in console
    assert console.count("PRINTED-BY-RANK-1") == 1 and "[rank1] PRINTED-BY-RANK-1" in console
    for internal in ("TrainController", "Attempting to start training worker group", "RayTrainWorker",
                     "PlacementGroupCleaner", "Running training"):
        assert internal not in console, internal


def test_a_run_that_saves_evaluates_resumes_and_fails_on_a_worker_shows_only_raytrainer_s_lines(tmp_path,
                                                                                                capfd):
    """Every checkpoint a worker reports, every evaluation, a resume and the user's code failing on rank 1:
    at the default log level (the first and last runs) and at log_level="info" (the resumed one) every line
    of the console is raytrainer's (its own, the ranks' forwarded records and prints, the logged losses and
    metrics), none from Ray's modules (Ray Train logs each reported checkpoint at INFO on a logger of its
    own, which reached the console through the rank's forwarded records), and the failure's exception is
    raised on the driver, not printed."""
    from models import RaiseOnRank

    from raytrainer import Trainer

    def run(max_steps, resume=None, log_level="passive", callbacks=()):
        args = TrainingArguments(output_dir=str(tmp_path), num_workers=2, max_steps=max_steps,
                                 per_device_train_batch_size=4, save_strategy="steps", save_steps=2,
                                 eval_strategy="steps", eval_steps=2, logging_steps=2, report_to="none",
                                 disable_tqdm=True, log_level=log_level)
        with Trainer(model=Regressor(), args=args, train_dataset=make_data(32),
                     eval_dataset=make_data(8, seed=2), callbacks=list(callbacks)) as trainer:
            trainer.train(resume_from_checkpoint=resume)
            return trainer.state.global_step

    capfd.readouterr()
    assert run(4) == 4
    assert run(6, resume=True, log_level="info") == 6
    with pytest.raises(ValueError, match="the user's callback failed on rank 1 at step 7"):
        run(8, resume=True, callbacks=[RaiseOnRank(7)])
    console = "".join(capfd.readouterr())
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4",
                                                                       "checkpoint-6"]
    ray_lines = [line for line in console.splitlines() if RAY_LINE.search(line)]
    assert ray_lines == [], "\n".join(ray_lines)
    assert console.count("{'eval_loss'") == 3 and console.count("{'train_runtime'") == 2, console
    assert not_ours(console) == [], "\n".join(not_ours(console))
    assert console.count("raytrainer: resuming from") == 2  # the resumed run's and the failed run's


def _run_with_one_loss(out, model, callbacks=()):
    from raytrainer import Trainer

    args = TrainingArguments(output_dir=str(out), num_workers=2, max_failures=1, max_steps=8,
                             per_device_train_batch_size=4, save_strategy="steps", save_steps=2,
                             report_to="none", disable_tqdm=True, seed=3)
    trainer = Trainer(model=model, args=args, train_dataset=make_data(32), callbacks=list(callbacks))
    trainer.train()
    return trainer


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The final weights of the run the fault tests below interrupt, run without a fault."""
    trainer = _run_with_one_loss(tmp_path_factory.mktemp("reference"), Regressor())
    return {name: tensor.clone() for name, tensor in trainer.model.state_dict().items()}


def test_a_lost_worker_is_replaced_and_the_run_resumes_bitwise(tmp_path, uninterrupted):
    """max_failures=1: rank 1's process dies at step 5; Ray starts a new worker group, which resumes from the
    last committed checkpoint; the final weights equal an uninterrupted run's, bit for bit."""
    import torch
    from models import DieOnceOnRank

    resumed = _run_with_one_loss(tmp_path, Regressor(), [DieOnceOnRank(step=5, rank=1)])
    assert (tmp_path / "died").exists()  # the worker did die
    assert resumed.state.global_step == 8
    for name, tensor in uninterrupted.items():
        assert torch.equal(resumed.model.state_dict()[name], tensor), name


def test_a_worker_lost_during_a_checkpoint_write_never_uses_that_checkpoint(tmp_path, uninterrupted, caplog):
    """Rank 0 dies while checkpoint-4 is saved (its weights file cut short, no manifest): the new
    worker group resumes from checkpoint-2, the last committed one, writes checkpoint-4 again whole, and ends
    bitwise where the uninterrupted run ends."""
    import torch
    from models import DiesWhileSaving

    from raytrainer.checkpoint import CheckpointReader, model_weights

    with caplog.at_level("WARNING"):
        resumed = _run_with_one_loss(tmp_path, Regressor(), [DiesWhileSaving(step=4)])
    assert (tmp_path / "died").exists()
    resumes = [r.getMessage() for r in caplog.records if "resuming from" in r.getMessage()]
    assert resumes and all(f"resuming from {tmp_path}/checkpoint-2" in m for m in resumes), resumes
    assert resumed.state.global_step == 8
    for name, tensor in uninterrupted.items():
        assert torch.equal(resumed.model.state_dict()[name], tensor), name
    rewritten = model_weights(CheckpointReader(str(tmp_path / "checkpoint-4")))  # hashes checked
    assert set(rewritten) == set(uninterrupted)


def test_a_worker_lost_more_often_than_max_failures_ends_the_run_cleanly(tmp_path, ray_session):
    """Rank 1 dies at step 5, and again at step 5 after the restart: with max_failures=1 the second loss ends
    the run with an error naming rank 1; the last committed checkpoint is intact and resumes; the run leaves
    no actor and no placement group behind."""
    from models import DieOnceOnRank
    from ray_state import alive_actors, live_placement_groups

    from raytrainer import Trainer
    from raytrainer.checkpoint import committed_checkpoints
    from raytrainer.storage import Storage

    def alive():  # the run's own actors (Ray's singletons, made on first use, live as long as Ray)
        return ({f"{a['ActorClassName']} {a['ActorID']}"
                 for a in alive_actors(("TrainController", "RayTrainWorker", "Channel"))},
                live_placement_groups())

    before = alive()
    with pytest.raises(Exception) as info:  # whatever its class, it must name the rank
        _run_with_one_loss(tmp_path, Regressor(), [DieOnceOnRank(step=5, rank=1, times=2)])
    said = " ".join([str(info.value), *getattr(info.value, "__notes__", [])])
    assert "rank 1" in said, said
    assert len((tmp_path / "died").read_text().split()) == 2  # both deaths happened
    import time

    for _ in range(30):  # Ray ends the run's actors and placement group asynchronously
        actors, groups = alive()
        if actors <= before[0] and groups <= before[1]:
            break
        time.sleep(1)
    assert actors <= before[0] and groups <= before[1], (actors - before[0], groups - before[1])
    # checkpoint-4 is written at step 4 and committed on the rank layer's own thread, which may or may not
    # have finished when rank 1 dies in step 5; what is committed is whole and resumes
    committed = [step for step, _ in committed_checkpoints(Storage.from_uri(str(tmp_path)), warn=False)]
    assert committed in ([2], [2, 4]), committed
    args = TrainingArguments(output_dir=str(tmp_path), num_workers=0, max_steps=8, save_strategy="no",
                             per_device_train_batch_size=8, report_to="none", disable_tqdm=True, seed=3)
    resumed = Trainer(model=Regressor(), args=args, train_dataset=make_data(32))
    assert resumed.train(resume_from_checkpoint=True).global_step == 8  # from checkpoint-2, one process


@pytest.mark.timeout(240)
def test_a_run_whose_controller_dies_gives_back_its_placement_group(tmp_path, ray_session):
    """Ray Train's controller killed mid-run (as the kernel's OOM killer would): its placement group outlives
    it (Ray scopes it to the job), and the driver removes it, so the cluster's CPUs are free again. On the
    local instance raytrainer starts, the run has no placement-group cleaner actor (it would poll a State
    API that instance does not serve), no preemption watcher (its one node is not drained), no autoscaling
    coordinator actor (no autoscaler to tell), and its controller has not imported torch."""
    import threading
    import time

    import ray
    from models import MarkThenWait
    from ray_state import alive_actors, live_placement_groups

    from raytrainer import Trainer

    args = TrainingArguments(output_dir=str(tmp_path), num_workers=2, max_steps=6, max_failures=0,
                             per_device_train_batch_size=4, save_strategy="no", report_to="none",
                             disable_tqdm=True)
    trainer = Trainer(model=Regressor(), args=args, train_dataset=make_data(32),
                      callbacks=[MarkThenWait(step=2, seconds=120)])
    actors_before, groups_before = {a["ActorID"] for a in alive_actors()}, live_placement_groups()
    free_before = ray.available_resources().get("CPU", 0)
    seen = {}

    def imports_torch(actor) -> bool:  # run in the controller's process (pickled by value: a local function)
        import sys

        return "torch" in sys.modules

    def kill_the_controller():
        deadline = time.monotonic() + 150
        while not (tmp_path / "at-step").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        seen["actors"] = sorted(a["ActorClassName"] for a in alive_actors()
                                if a["ActorID"] not in actors_before)
        seen["groups"] = live_placement_groups() - groups_before
        controller = trainer.__dict__["_group"].channel.controller()
        seen["torch in the controller"] = ray.get(controller.__ray_call__.remote(imports_torch))
        ray.kill(controller)

    killer = threading.Thread(target=kill_the_controller)
    killer.start()
    with pytest.raises(ray.exceptions.ActorDiedError) as info:
        trainer.train()
    assert any("Ray Train's controller of this run died" in note for note in info.value.__notes__)
    killer.join()
    assert seen["actors"].count("RayTrainWorker") == 2 and "TrainController" in seen["actors"], seen
    assert "PlacementGroupCleaner" not in seen["actors"] and "PreemptionWatcher" not in seen["actors"], seen
    assert seen["torch in the controller"] is False  # driver/torch_backend.py
    assert "_AutoscalingCoordinatorActor" not in seen["actors"], seen  # vacuous if Ray Data made one earlier
    assert len(seen["groups"]) == 1, seen  # the run's placement group, while it ran
    deadline = time.monotonic() + 30
    while live_placement_groups() & seen["groups"] and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not live_placement_groups() & seen["groups"]
    while ray.available_resources().get("CPU", 0) < free_before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ray.available_resources().get("CPU", 0) >= free_before
    trainer.close()
