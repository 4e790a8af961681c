"""Launching a trainer's method on its worker group (driver/group.py).

The run spec carries the trainer's recipe (raytrainer/hosted_recipe.py: its class and constructor's
arguments, so a subclass's overrides run on the workers); the group puts it in the object store once per
command and the command carries only its reference. While the command runs, the group's pump
(driver/display.py) shows the workers' events.
"""

from __future__ import annotations

from raytrainer.protocol import RankResult, Spec


def launch(trainer, spec: Spec, method: str, registry) -> RankResult:
    """Run ``method`` on the Trainer's live worker group (started now if it has none, or none that fits the
    arguments); return rank 0's result. A Ray Data training set is given to Ray Train at the start of a
    run, so that ``train()`` runs on a group of its own, closed after it."""
    from raytrainer.driver.group import WorkerGroup, attach, idle_group_for
    from raytrainer.driver.ray_train import RayBackend

    args = trainer.args
    datasets = _ray_datasets(trainer, method)
    group = trainer.__dict__.get("_group")
    backend = group.backend if group is not None else None  # a replacement runs where the last one ran
    if group is not None and (datasets or not group.usable_for(args)):
        group.close(keep=False)  # its workers hold the resources the next group needs
        group = None
    if group is None and not datasets:
        group = idle_group_for(trainer, backend or RayBackend())  # a warm group of this process
        if group is not None:
            attach(trainer, group)
    if group is None:
        group = WorkerGroup(args, backend=backend)
        group.start(datasets)  # refused here, before the Trainer holds it, when the cluster cannot hold it
        if not datasets:
            attach(trainer, group)
    try:
        return group.run(trainer, spec, method, registry, datasets)
    finally:
        if datasets:
            group.close()


def _ray_datasets(trainer, method: str) -> dict | None:
    """A Ray Data training set goes to Ray Train, which gives each worker its shard."""
    from raytrainer.data import RayTrainingSet, pad_ray_dataset

    dataset = trainer._given("train_dataset")
    if method == "train" and isinstance(dataset, RayTrainingSet):  # no row left out of the equal split
        return {"train": pad_ray_dataset(dataset.dataset, dataset.rows, max(trainer.args.num_workers, 1))}
    return None
