"""The Ray Tune backend: a ``ray.tune.Tuner`` whose trainable runs one raytrainer trial.

Each Tune trial's trainable (a light actor: 0 CPUs and 256 MiB by default) builds the model with
``model_init(config)`` and calls the trial Trainer's ``train()`` on a worker group the actor keeps (a Ray
Train v2 run whose workers wait for commands, driver/group.py). Its workers are gang-scheduled in that run's
placement group (all of them or none), so concurrent trials queue instead of deadlocking half-placed. Each
evaluation reaches Tune through ``ray.tune.report`` from the trial's driver-side ``TrialReporter`` (Ray Train
v2 keeps only checkpoint reports, so Ray's Train -> Tune callback would see too little).

Trials run on warm workers: ``reuse_actors`` is on unless the search says otherwise, so when a trial ends, or
a scheduler such as ASHA or PBT stops it, Tune hands its actor the next trial (``reset_config``). The stopped
run winds down at the evaluation Tune decided on, its group goes back to the actor's pool, and the next trial
runs its commands on the same worker processes (reset between commands) instead of starting a Ray Train run
of its own -- 10-20 s per trial on a small cluster. When Tune ends the actor, its groups close.

kwargs: ``search_alg``, ``scheduler``, ``max_concurrent_trials``, ``resources_per_trial``, any other
``tune.TuneConfig`` field (``time_budget_s``, ``reuse_actors``, ...) and ``tune.RunConfig`` field
(``name``, ``storage_path``, ``stop``, ``callbacks``, ``verbose``, ...). Tune's own records go to
``output_dir/tune`` unless ``storage_path`` says otherwise. The console gets one line per trial start and
end from raytrainer (none with ``disable_tqdm``); ``verbose=1`` or ``2`` brings Tune's status tables back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import posixpath
import queue
import signal
import threading
import time
from collections.abc import Callable

import cloudpickle

from raytrainer.driver.group import GroupPool
from raytrainer.hosted_recipe import ship_dynamic_modules
from raytrainer.search.common import (
    BestRun,
    TrialReporter,
    TrialSummary,
    fill_checkpoints,
    run_trial,
    split_hyperparameters,
)
from raytrainer.storage import Storage, uri_basename

logger = logging.getLogger(__name__)

METRIC = "objective"
# What a trial's trainable reserves when it only drives a run: no CPU (Tune needs some resource, and a CPU
# here would be one the trial's own workers cannot have), a nominal 256 MiB of memory.
_DRIVER_MEMORY = 256 * 2**20
_RAY_TRAIN_RUN_RECORD = "checkpoint_manager_snapshot.json"  # Ray Train v2's record of a run's checkpoints
_ORPHAN_WATCH_S = 60  # how long after a trial fails its worker group's placement group is looked for
_STOP_TIMEOUT_S = 120  # how long a stopped trial's run may take to wind down (a step, the last commit)


class _DONE:
    """Marks the end of a trial's run in the trainable's result queue."""


def _trainable_class():
    """The Tune trainable (a class: ``cleanup`` can stop the run gracefully before Tune ends the actor,
    so the run's placement group is released by Ray Train itself, and PBT can save and restore)."""
    from ray import tune
    from ray.tune.result import RESULT_DUPLICATE

    class RaytrainerTrial(tune.Trainable):
        def setup(self, config, spec: bytes = b"", compute_objective=None, hp_name=None):
            import ray

            self._spec, self._compute_objective, self._hp_name = spec, compute_objective, hp_name
            self._begin(config)
            # this actor's live worker groups; their Ray Train run folders named after it (other actors'
            # groups live in the same storage)
            actor = (ray.get_runtime_context().get_actor_id() or "local")[-8:]
            self._pool = GroupPool(self._trainer.args, label=f"tune-{actor}-")

        def _begin(self, config) -> None:
            """A trial's state: its Trainer (a fresh copy of the search's), run id, results, reporter."""
            self._trainer = cloudpickle.loads(self._spec)  # cloudpickle: it honours register_pickle_by_value
            hp_name = self._hp_name
            self._run_id = str(hp_name(config) if hp_name is not None else self.trial_id)
            self._results: queue.Queue = queue.Queue()
            # ASHA's STOP at max_t, on the run's last evaluation, is not an early stop
            self._reporter = TrialReporter(self._compute_objective, self._report,
                                           stop_at_the_end_prunes=False)
            self._thread = None
            self._resume = None  # a checkpoint PBT restored this trial from
            self._verdict = None  # the evaluation Tune is deciding on

        def reset_config(self, new_config) -> bool:
            """Tune gives this actor (``reuse_actors``) the next trial: the last one's run stops where it is
            (a scheduler stopped it, or it ended), its worker group goes back to this actor's pool, and the
            new trial borrows it -- the same worker processes, reset between commands (worker/entry.py)."""
            self._stop_run()
            self._begin(new_config)
            return True

        def _report(self, step, objective, metrics) -> bool:
            """Hand the evaluation to Tune and wait for its verdict: the next step() call means go on,
            cleanup() means stop (the run's workers wait for this at the evaluation, see worker/stop)."""
            self._provisional_summary(step, objective)
            verdict = {"stop": False, "given": threading.Event()}
            self._results.put(({**metrics, METRIC: objective, "global_step": step, "run_id": self._run_id},
                               verdict))
            verdict["given"].wait()
            return verdict["stop"]

        def _provisional_summary(self, step, objective) -> None:
            """The trial's summary as of this evaluation, written before Tune sees it. Tune force-kills a
            trial it stopped 5 s after the experiment's last result (``TuneController._cleanup_trials``), so
            a trial a scheduler stops last (ASHA at max_t) may never reach the summary its run writes when
            ``train()`` returns; this one, replaced by that, is what remains then."""
            from raytrainer.search.common import _plain, trial_args

            args = trial_args(self._trainer.args, {}, self._run_id)
            summary = TrialSummary(self._run_id, args.output_dir, _plain(dict(self.config)),
                                   objective=objective, evaluations=list(self._reporter.evaluations),
                                   global_step=step)
            fill_checkpoints(summary, args)
            summary.save()

        def _give_verdict(self, stop: bool) -> None:
            if self._verdict is not None:
                self._verdict["stop"] = stop
                self._verdict["given"].set()
                self._verdict = None

        def _run(self):
            try:
                run_trial(self._trainer, self.config, self._run_id, dict(self.config),
                          self._compute_objective, reporter=self._reporter,
                          resume_from_checkpoint=self._resume, pool=self._pool)
                self._results.put(_DONE)
            except BaseException as exc:  # re-raised in step(), on the actor's main thread
                self._results.put(exc)

        def step(self):
            if self._thread is None:  # started here, after a PBT restore has set the checkpoint
                self._thread = threading.Thread(target=self._run, daemon=True, name="raytrainer-trial")
                self._thread.start()
            self._give_verdict(stop=False)  # Tune asks for more: the previous evaluation may go on
            item = self._results.get()
            if item is _DONE:
                return {RESULT_DUPLICATE: True}  # the last result was the last evaluation
            if isinstance(item, BaseException):
                raise item
            result, self._verdict = item
            return result

        def save_checkpoint(self, checkpoint_dir: str):
            from raytrainer.search.common import trial_args

            args = trial_args(self._trainer.args, {}, self._run_id)
            found = TrialSummary(self._run_id, args.output_dir, {})
            fill_checkpoints(found, args)
            if found.checkpoints:  # copied (downloaded, for a bucket) into the folder Tune keeps
                latest = Storage.for_run(args).at(found.checkpoints[-1])
                latest.download_dir(latest.root, os.path.join(checkpoint_dir, uri_basename(latest.uri)))
            return checkpoint_dir

        def load_checkpoint(self, checkpoint_dir: str):
            """PBT: this trial goes on from (another trial's) checkpoint, in its own run folder again."""
            names = [n for n in os.listdir(checkpoint_dir) if n.startswith("checkpoint-")]
            self._resume = os.path.join(checkpoint_dir, names[0]) if names else None
            # Ray Train v2 refuses a run folder whose own run record names a checkpoint that rotation has
            # deleted; raytrainer resumes from its manifests (``_resume``), never from that record.
            from raytrainer.search.common import trial_args
            from raytrainer.storage import ray_run_folder

            args = trial_args(self._trainer.args, {}, self._run_id)
            run = Storage.for_run(args)
            stale = posixpath.join(ray_run_folder(args), _RAY_TRAIN_RUN_RECORD)
            if run.exists(stale):
                run.fs.delete_file(stale)

        def cleanup(self):
            """Tune ends this actor (its last trial stopped or ended, and no trial is left for it): stop the
            run, wait for it, close the actor's worker groups."""
            self._stop_run()
            self._pool.close(idle=False)

        def _stop_run(self) -> None:
            """Stop the trial's run where it is (at the evaluation Tune decided on) and wait for it."""
            self._give_verdict(stop=True)
            self._reporter.stop()
            if self._thread is not None:
                self._thread.join(timeout=_STOP_TIMEOUT_S)
                if self._thread.is_alive():
                    logger.warning("trial %s: the run did not stop within %ds", self._run_id, _STOP_TIMEOUT_S)

    return RaytrainerTrial


def run_ray_tune(trainer, hp_space: Callable, compute_objective: Callable, n_trials: int, direction,
                 hp_name: Callable | None = None, **kwargs) -> BestRun:
    from ray import tune

    from raytrainer.driver.ray_runtime import ensure_ray, serves_state_api
    from raytrainer.driver.ray_train import placement_groups_of_this_job, remove_placement_groups

    if isinstance(direction, list):
        raise ValueError("backend='ray' optimises one objective; for a list of directions use "
                         "backend='optuna'.")
    mode = "min" if direction == "minimize" else "max"
    args = trainer.args
    ensure_ray(args)
    param_space = hp_space(None)
    split_hyperparameters(trainer, _sample_names(param_space))

    resources = kwargs.pop("resources_per_trial", None)
    if resources is None:  # the trainable only drives: its run's workers reserve their own CPUs/GPUs
        resources = {"cpu": 0, "memory": _DRIVER_MEMORY} if args.num_workers > 0 else {"cpu": 1}
    tune_fields = {f.name for f in dataclasses.fields(tune.TuneConfig)}
    run_fields = {f.name for f in dataclasses.fields(tune.RunConfig)}
    unknown = set(kwargs) - tune_fields - run_fields
    if unknown:
        raise TypeError(f"hyperparameter_search(backend='ray') got unknown arguments {sorted(unknown)}; it "
                        "takes resources_per_trial and the fields of tune.TuneConfig and tune.RunConfig.")
    tune_kwargs = {k: v for k, v in kwargs.items() if k in tune_fields}
    run_kwargs = {k: v for k, v in kwargs.items() if k in run_fields}
    tune_kwargs.setdefault("max_concurrent_trials", _default_concurrency(args))
    # a trial's actor, and the worker group it drives, run the next trial (RaytrainerTrial.reset_config)
    tune_kwargs.setdefault("reuse_actors", True)
    preset = any(getattr(x, "_metric", None) or getattr(x, "metric", None)
                 for x in (tune_kwargs.get("search_alg"), tune_kwargs.get("scheduler")) if x is not None)
    if not preset:
        tune_kwargs.setdefault("metric", METRIC)
        tune_kwargs.setdefault("mode", mode)
    if "storage_path" not in run_kwargs:  # Tune's records with raytrainer's own, under .raytrainer/
        storage = Storage.for_run(args).state()
        run_kwargs.update(storage_path=storage.root, storage_filesystem=storage.fs)
    run_kwargs.setdefault("name", "tune")
    if "verbose" not in run_kwargs:  # Tune's status tables only when asked: raytrainer says a line per trial
        run_kwargs["verbose"] = 0
        if not args.disable_tqdm:
            run_kwargs["callbacks"] = [*(run_kwargs.get("callbacks") or []), _trial_lines(list(param_space))]

    run_kwargs["callbacks"] = [*(run_kwargs.get("callbacks") or []), _orphans_removed()]
    trainable = tune.with_parameters(_trainable_class(), spec=_trial_spec(trainer),
                                     compute_objective=compute_objective, hp_name=hp_name)
    tuner = tune.Tuner(tune.with_resources(trainable, resources), param_space=param_space,
                       tune_config=tune.TuneConfig(num_samples=n_trials, **tune_kwargs),
                       run_config=tune.RunConfig(**run_kwargs))
    # Tune kills the trials still stopping 5 s after the end; without a State API no Ray Train cleaner runs
    cleanup = not serves_state_api()
    groups_before = placement_groups_of_this_job() if cleanup else set()
    try:
        with _tune_output(quiet=run_kwargs["verbose"] == 0), _signal_handlers_restored():
            results = tuner.fit()
    finally:
        if cleanup:
            remove_placement_groups(placement_groups_of_this_job() - groups_before)
    if not any(METRIC in (r.metrics or {}) for r in results):
        errors = [e for e in results.errors if e is not None]
        if errors:
            raise errors[0]
        raise RuntimeError("hyperparameter_search: no Tune trial reported an objective.")
    best = results.get_best_result(metric=METRIC, mode=mode, scope="last", filter_nan_and_inf=True)
    trial_id = str(best.metrics.get("run_id"))
    hyperparameters = {k: v for k, v in best.config.items() if k in param_space}
    summary = _summary(trainer, trial_id, hyperparameters, best)
    return BestRun(trial_id, best.metrics[METRIC], hyperparameters, summary)


@contextlib.contextmanager
def _signal_handlers_restored():
    """``Tuner.fit()`` installs its own SIGINT (and SIGUSR1) handler in the main thread and leaves it there
    after it returns: the user's next Ctrl-C -- in a later ``trainer.train()``, say -- would only log "ending
    Ray Tune run" and be swallowed. The process's handlers are put back as they were."""
    names = [s for s in ("SIGINT", "SIGUSR1") if hasattr(signal, s)]
    main = threading.current_thread() is threading.main_thread()
    saved = {n: signal.getsignal(getattr(signal, n)) for n in names} if main else {}
    try:
        yield
    finally:
        for name, handler in saved.items():
            if handler is not None:  # None: set outside Python, cannot be put back from here
                signal.signal(getattr(signal, name), handler)


@contextlib.contextmanager
def _tune_output(quiet: bool):
    """With ``verbose=0`` Tune's default output still prints the experiment's header and where its
    results go; its classic reporter (``RAY_AIR_NEW_OUTPUT=0``, read when ``fit()`` starts) prints nothing."""
    saved = os.environ.get("RAY_AIR_NEW_OUTPUT")
    if quiet:
        os.environ["RAY_AIR_NEW_OUTPUT"] = "0"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("RAY_AIR_NEW_OUTPUT", None)
        else:
            os.environ["RAY_AIR_NEW_OUTPUT"] = saved


def _orphans_removed():
    """A Tune callback (in this process): when a trial fails -- its actor died, say -- the placement group
    of the worker group its actor drove goes at once, not when the search ends (driver/ray_train.py's
    ``orphaned_placement_groups``), so the trials after it get those CPUs and GPUs."""
    from ray import tune

    from raytrainer.driver.ray_train import orphaned_placement_groups, remove_placement_groups

    class OrphansRemoved(tune.Callback):
        """Swept at the failure and at each of Tune's loop iterations for a while after it: the GCS marks
        the controller dead a moment after Tune hears of the trial actor's death."""

        def __init__(self):
            self.until = 0.0

        def _failed(self) -> None:
            self.until = time.monotonic() + _ORPHAN_WATCH_S
            remove_placement_groups(orphaned_placement_groups())

        def on_trial_error(self, iteration, trials, trial, **info):
            self._failed()

        def on_trial_recover(self, iteration, trials, trial, **info):
            self._failed()

        def on_step_begin(self, iteration, trials, **info):
            if time.monotonic() < self.until:
                remove_placement_groups(orphaned_placement_groups())

    return OrphansRemoved()


def _trial_lines(param_names: list[str]):
    """A Tune callback (in this process) in place of Tune's status tables -- which ``verbose=1`` or ``2`` in
    the search's arguments bring back: a line as each trial starts and one as it ends, and while trials run,
    one status line per running trial (its step, evaluations and objective, redrawn in place)."""
    from ray import tune
    from tqdm.auto import tqdm

    class TrialLines(tune.Callback):
        def __init__(self):
            self.ended = 0
            self.status: dict[str, tqdm] = {}  # trial id -> its status line
            self.slots: dict[str, int] = {}  # trial id -> its line's position under the others

        def on_trial_start(self, iteration, trials, trial, **info):
            params = {k: trial.config.get(k) for k in param_names}
            tqdm.write(f"trial {trial.trial_id} started: {params}")
            slot = min(set(range(len(self.slots) + 1)) - set(self.slots.values()))
            self.slots[trial.trial_id] = slot
            self.status[trial.trial_id] = tqdm(total=0, position=slot, leave=False, bar_format="{desc}",
                                               desc=f"trial {trial.trial_id}: starting")

        def on_trial_result(self, iteration, trials, trial, result, **info):
            line = self.status.get(trial.trial_id)
            if line is not None:
                line.set_description_str(
                    f"trial {trial.trial_id}: step {result.get('global_step', 0)}, "
                    f"{result.get('training_iteration', 0)} evaluation(s), objective {result.get(METRIC)}")

        def _close(self, trial) -> None:
            self.slots.pop(trial.trial_id, None)
            line = self.status.pop(trial.trial_id, None)
            if line is not None:
                line.close()

        def on_trial_complete(self, iteration, trials, trial, **info):
            self._close(trial)
            result = trial.last_result or {}
            self.ended += 1
            tqdm.write(f"trial {trial.trial_id} ended after {result.get('training_iteration', 0)} "
                       f"evaluation(s), step {result.get('global_step', 0)}: objective {result.get(METRIC)} "
                       f"({self.ended} trial(s) ended)")

        def on_trial_error(self, iteration, trials, trial, **info):
            self._close(trial)
            where = trial.error_file or "in the Tune records"
            tqdm.write(f"trial {trial.trial_id} failed; its error: {where}")

    return TrialLines()


def _trial_spec(trainer) -> bytes:
    """The Trainer each trial starts from, pickled into Ray's object store and Tune's trial state: without
    the hub token, and not pushing. Concurrent trials pushing to one repository would interleave their
    checkpoints there, and a trial actor could only push with a token it had been given -- which Tune would
    then hold in its state. The search's caller pushes the run it picks."""
    args = trainer.args
    if args.push_to_hub:
        logger.warning("hyperparameter_search(backend='ray'): the trials do not push to the Hub (concurrent "
                       "trials would interleave their checkpoints in %s, and the token stays on this "
                       "driver); train the best run's hyperparameters with push_to_hub=True, or call "
                       "push_to_hub() on it.", args.hub_model_id or "the repository")
    saved = args.hub_token, args.push_to_hub
    args.hub_token, args.push_to_hub = None, False
    try:
        ship_dynamic_modules()
        return cloudpickle.dumps(trainer)
    finally:
        args.hub_token, args.push_to_hub = saved


def _summary(trainer, trial_id: str, hyperparameters: dict, best) -> TrialSummary:
    """The trial's own summary file; for a trial Tune ended before train() returned (a scheduler's stop,
    ASHA's included at max_t), one made from its Tune results and the checkpoints committed in its folder."""
    from raytrainer.search.common import trial_args

    args = trial_args(trainer.args, {}, trial_id)
    summary = TrialSummary.load(args.output_dir)
    if summary is not None:
        return summary
    evaluations = []
    frame = best.metrics_dataframe
    for row in ([] if frame is None else frame.to_dict("records")):
        metrics = {k: v for k, v in row.items() if k.startswith("eval_") or k == "epoch"}
        evaluations.append({"step": int(row["global_step"]), "objective": row[METRIC], "metrics": metrics})
    summary = TrialSummary(trial_id, args.output_dir, hyperparameters, objective=best.metrics[METRIC],
                           evaluations=evaluations, global_step=int(best.metrics.get("global_step", 0)),
                           pruned=True)
    fill_checkpoints(summary, args)
    return summary


def _sample_names(param_space: dict) -> dict:
    return dict.fromkeys(param_space)


def _default_concurrency(args) -> int:
    """As many trials at once as the cluster's CPUs hold workers (at least one)."""
    import ray

    from raytrainer.driver.ray_runtime import cpus_needed

    total = ray.cluster_resources().get("CPU", 1)
    per_trial = max(cpus_needed(args), 1)
    return max(math.floor(total / per_trial), 1)
