"""Any subclass of `transformers.Trainer` on Ray workers, with transformers' own loop on each rank.

TRL's trainers, sentence-transformers' and a user's own subclass override the Trainer's private methods and
call ``self.accelerator`` throughout; they run as they are only where transformers' loop runs. So this path
does not translate them into raytrainer's loop: each rank of a worker group builds the trainer itself, in
the environment ``torchrun`` gives (Ray Train sets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``/``PORT`` and starts the process group, which accelerate's
``PartialState`` then uses), and calls its methods. The driver keeps the user's arguments and the services
around the loop: the worker group (started once, kept warm across calls), one progress bar and the routed
logs of every rank, the final ``TrainerState``, the errors.

``on_ray(cls)`` makes the twin of a trainer class (a subclass of it, same name and constructor) and
``config_on_ray(cls)`` the twin of its arguments class (``RayArgumentsMixin`` added: ``num_workers``,
``use_gpu``, ``resources_per_worker``, ...). ``raytrainer.trl`` holds the twins of every trainer and config
TRL exports under TRL's names. With ``num_workers=0`` (or arguments without the Ray fields) the object is
the original trainer class's own, built in this process from the original arguments class: nothing of
raytrainer is in the way. A subclass of a twin is built on the workers as it is.

With ``num_workers >= 1`` the twin built on the driver holds only what the constructor was given: a model
named by a path or hub id, or made by ``model_init``, is loaded on the workers only. A method the driver
does not hold itself (``save_model``, ``push_to_hub``, ``create_model_card``, ``log``...) runs on every rank
of the group, as it would under ``accelerate launch``, and returns rank 0's answer; an attribute the driver
does not hold (``hub_model_id``, ``model``...) is rank 0's value, pickled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import os
from typing import Any

from raytrainer.args import RayArgumentsMixin
from raytrainer.hosted_recipe import (
    Recipe,
    _find_args,
    _replace_args,
    constructor_signature,
    module_mark,
    plain_config,
)

logger = logging.getLogger(__name__)

#: What the driver's twin holds itself; every other attribute is looked up on rank 0's trainer.
_DRIVER_SIDE = frozenset({"args", "model", "_model", "state", "callback_handler", "accelerator", "train",
                          "evaluate", "predict", "close", "end", "is_world_process_zero",
                          "is_local_process_zero", "model_init", "optimizer", "lr_scheduler",
                          "hyperparameter_search", "call_model_init", "push_to_hub", "hub_model_id",
                          "control", "processing_class", "_hub"})


def config_on_ray(config_cls: type) -> type:
    """``config_cls`` (a `transformers.TrainingArguments` subclass) with raytrainer's Ray fields, same
    name. Its instances go to ``on_ray`` twins; on the ranks they become ``config_cls`` instances again."""
    if issubclass(config_cls, RayArgumentsMixin):
        return config_cls
    namespace = {"__module__": config_cls.__module__, "__qualname__": config_cls.__qualname__,
                 "__annotations__": {}, "__doc__": config_cls.__doc__}
    twin = type(config_cls.__name__, (RayArgumentsMixin, config_cls), namespace)
    return dataclasses.dataclass(repr=False)(twin)


def on_ray(trainer_cls: type) -> type:
    """The twin of ``trainer_cls`` (a `transformers.Trainer` subclass): a subclass of it, same name and
    constructor; with Ray fields in its ``args`` and ``num_workers >= 1`` its calls run on Ray workers (see
    the module's docstring). A subclass of the twin is built on the workers as it is (its overrides run
    there, as under ``accelerate launch``)."""
    import transformers

    if not (isinstance(trainer_cls, type) and issubclass(trainer_cls, transformers.Trainer)):
        raise TypeError(f"on_ray({trainer_cls!r}): expected a subclass of transformers.Trainer")
    if issubclass(trainer_cls, OnRay):
        return trainer_cls
    namespace = {"__module__": trainer_cls.__module__, "__qualname__": trainer_cls.__qualname__,
                 "__doc__": trainer_cls.__doc__, "_twin_of": trainer_cls,
                 "__init__": _in_this_process(trainer_cls.__init__, constructor_signature(trainer_cls))}
    return type(trainer_cls.__name__, (OnRay, trainer_cls), namespace)


class OnRay:
    """What a twin adds to its trainer class: where an instance lives. With ``num_workers >= 1`` in its
    arguments, the object built is the driver's side of the run (``HostedTrainer``, in front of the same
    class); otherwise it is the trainer class's own object in this process (``_in_this_process``)."""

    def __new__(cls, *args, **kwargs):
        signature = constructor_signature(cls)
        try:  # a call the constructor refuses is refused there, with its own message
            targs = _find_args(signature, signature.bind_partial(None, *args, **kwargs))
        except TypeError:
            targs = None
        if isinstance(targs, RayArgumentsMixin) and targs.num_workers != 0:
            return object.__new__(_driver_class(cls))
        return object.__new__(cls)


def _in_this_process(init, signature: inspect.Signature):
    """The trainer class's ``__init__`` given the arguments' original class (no Ray fields: transformers'
    own process view) for arguments with Ray fields: a twin with ``num_workers=0`` (or a rank building its
    trainer) is the trainer class's own object, transformers' loop with nothing of raytrainer in the way."""

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        targs = _find_args(signature, signature.bind(self, *args, **kwargs))
        if isinstance(targs, RayArgumentsMixin):
            args, kwargs = _replace_args(signature, args, kwargs, plain_config(targs))
        init(self, *args, **kwargs)

    return __init__


def ray_data_read(train_dataset, eval_dataset, args):
    """A Ray Dataset among the data sets made what transformers' loop reads
    (``data.ray_data_as_transformers_takes_it``), Ray started first, raytrainer's way."""
    from raytrainer import data

    if not data.uses_ray_data(train_dataset, eval_dataset):
        return train_dataset, eval_dataset
    from raytrainer.driver.ray_runtime import ensure_ray

    ensure_ray(args)
    return data.ray_data_as_transformers_takes_it(train_dataset, eval_dataset)


def _with_ray_data_read(signature: inspect.Signature, args: tuple, kwargs: dict, targs) -> tuple[tuple, dict]:
    """The constructor's arguments with their data sets through ``ray_data_read``."""
    bound = signature.bind(None, *args, **kwargs).arguments
    given = bound.get("train_dataset"), bound.get("eval_dataset")
    for name, old, new in zip(("train_dataset", "eval_dataset"), given, ray_data_read(*given, targs)):
        if new is not old:
            args, kwargs = _replace_args(signature, args, kwargs, new, name=name)
    return args, kwargs


@functools.cache
def _driver_class(cls: type) -> type:
    """The driver's side of ``cls`` (a twin or a subclass of one): ``HostedTrainer`` in front of it. The
    ranks build ``hosted_class``: ``cls`` itself, or for a twin as made, the class it is the twin of."""
    namespace = {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__,
                 "hosted_class": cls.__dict__.get("_twin_of", cls), "user_class": cls}
    return type(cls.__name__, (HostedTrainer, cls), namespace)


class HostedTrainer:
    """The driver's side of a ``transformers.Trainer`` subclass run on Ray workers (``on_ray``): in front of
    that class in its instances' MRO, so ``isinstance(trainer, transformers.Trainer)`` holds, but a method of
    the trainer class runs on the ranks, not here (``__getattribute__``)."""

    hosted_class: type  # what the ranks build
    user_class: type  # the class the script instantiated

    def __init__(self, *args, **kwargs):
        from raytrainer.callbacks import PrinterCallback, ProgressCallback, TrainerControl, TrainerState
        from raytrainer.hosted_callbacks import DriverCallbacks
        from raytrainer.hosted_recipe import ship_dynamic_modules

        signature = constructor_signature(self.hosted_class)
        bound = signature.bind(None, *args, **kwargs)
        targs = _find_args(signature, bound)
        check(self.hosted_class, targs)
        args, kwargs = _with_ray_data_read(signature, args, kwargs, targs)
        bound = signature.bind(None, *args, **kwargs)
        ship_dynamic_modules()  # a trust_remote_code model's classes travel by value
        display = PrinterCallback() if targs.disable_tqdm else ProgressCallback()
        vars(self).update(
            args=targs,
            state=TrainerState(),
            control=TrainerControl(),
            # the mirror of each rank's list (raytrainer/hosted_callbacks.py): the script's callbacks take on
            # rank 0's state after each call; the display (progress bar or printer) and the callbacks that
            # ask to run here (``on_driver = True``) see rank 0's events, and the ranks leave them out
            callback_handler=DriverCallbacks.for_run(targs, bound.arguments.get("callbacks"), display),
            _callback_edits=(),  # add_callback, pop_callback, remove_callback: made on every rank too
            # on the driver: one process; print() and the main-process checks are the driver's
            accelerator=DriverAccelerator(targs.num_workers),
            _recipe=Recipe.make(self.hosted_class, args, kwargs),
            _constructor=(args, kwargs),  # the user's objects, as given (a search's trials replace args=)
            _model_mark=module_mark(bound.arguments.get("model")),  # the module as the recipe holds it
            # what a search reads here (each trial's ranks build their own model and optimizer)
            model_init=bound.arguments.get("model_init"),
            optimizer=(bound.arguments.get("optimizers") or (None, None))[0],
            lr_scheduler=(bound.arguments.get("optimizers") or (None, None))[1],
            # the driver pushes: checkpoints as they are committed, the saved model on push_to_hub()
            _hub=None,
            processing_class=bound.arguments.get("processing_class"),
        )

    # -- what scripts call ----------------------------------------------------------------------------
    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs):
        from raytrainer.callbacks import state_from_dict
        from raytrainer.driver.registry import CheckpointRegistry
        from raytrainer.driver.runner import keep_final_state, train_sequence

        self._check_call("train", {})
        target = self._resume_target(resume_from_checkpoint)
        self._check_fits(target)
        kwargs = dict(resume_from_checkpoint=target, trial=trial, ignore_keys_for_eval=ignore_keys_for_eval,
                      **kwargs)
        self._follow_the_script()
        vars(self).pop("_model", None)
        before = vars(self).pop("_weights_at", None)  # the last train()'s: where a new group's ranks start
        self._trained = True  # trainer.model: the trained weights from now on
        stops = any(getattr(cb, "may_stop_training", False) for cb in self.callback_handler.callbacks)
        registry = CheckpointRegistry(self.args)
        final = self._final_weights_wanted()
        # a PBT exploit (raytrainer/search): the checkpoint of another trial, this run's learning rate
        exploit = vars(self).get("_resume_with_new_hyperparameters", False)

        def once(kw: dict):
            result = self._run("train", {**kw, "stop_from_driver": stops, "final_weights": final,
                                         "new_hyperparameters": exploit, "trained_weights": before},
                               registry)
            self.state = state_from_dict(result.state)
            self._weights_at = result.weights_at
            return result.output

        output = train_sequence(self, kwargs, resume_from_checkpoint, registry, once)
        keep_final_state(self)
        return output

    def push_to_hub(self, commit_message: str | None = "End of training", blocking: bool = True,
                    token: str | None = None, revision: str | None = None, private: bool | None = None,
                    **kwargs):
        """transformers' ``push_to_hub``, pushed from the driver with the token it holds: the ranks save the
        model and the trainer's own model card (TRL's for TRL's trainers) into ``output_dir``, and the
        driver uploads that folder (raytrainer/hub)."""
        from raytrainer import hub

        self.callback_handler.on_push_begin(self.args, self.state, self.control)
        model_name = kwargs.pop("model_name", None)
        if model_name is None:
            model_name = (self.args.hub_model_id or os.path.abspath(self.args.output_dir)).rstrip("/")
            model_name = model_name.split("/")[-1]
        pusher = hub.pusher_for_call(self, token, private, revision)
        _RankMethod(self, "save_model")(_internal_call=True)
        _RankMethod(self, "create_model_card")(model_name=model_name, **kwargs)
        return hub.upload_output_dir(pusher, self.args, commit_message, revision, blocking)

    @property
    def hub_model_id(self) -> str | None:
        """The repository pushes go to (transformers' attribute, set once the driver's pusher exists)."""
        target = self._hub.target if self._hub is not None else None
        return getattr(target, "repo_id", None) or self.args.hub_model_id

    def add_callback(self, callback) -> None:
        """transformers' ``add_callback``: to the driver's list and, from the next call, every rank's
        (a callback with ``on_driver = True``: the driver's only)."""
        from raytrainer.hosted_callbacks import Edit

        self._edit_callbacks(Edit(added=callback))  # first: one that cannot reach the ranks is refused
        self.callback_handler.add_callback(callback)

    def pop_callback(self, callback):
        """transformers' ``pop_callback``: the driver's instance, removed here and on every rank."""
        from raytrainer.hosted_callbacks import removal

        edit = removal(self.callback_handler, callback)
        popped = self.callback_handler.pop_callback(callback)
        if popped is not None:
            self._edit_callbacks(edit)
        return popped

    def remove_callback(self, callback) -> None:
        """transformers' ``remove_callback``, here and on every rank."""
        from raytrainer.hosted_callbacks import removal

        edit = removal(self.callback_handler, callback)
        self.callback_handler.remove_callback(callback)  # an instance not listed: transformers' ValueError
        self._edit_callbacks(edit)

    def _edit_callbacks(self, edit) -> None:
        """``edit`` made on every rank from the next call: each rank builds the trainer anew, from the same
        payload, and edits its list as the driver's was (the trained weights and state go along, as to a
        group built anew)."""
        from raytrainer.hosted_callbacks import for_ranks

        if for_ranks(edit):
            edits = (*self._callback_edits, edit)
            self._recipe = self._recipe.with_edits(edits)
            self._callback_edits = edits

    def _resume_target(self, resume_from_checkpoint):
        return resume_target(self.args, resume_from_checkpoint)

    def _check_fits(self, target) -> None:
        """A checkpoint to resume whose weights have other shapes than the model the constructor was given
        is refused here, from its weight files' headers, before any worker starts. Only shapes: the ranks
        may train the model under other names (a PEFT adapter, a sharded layout); a model named by a path
        or made by ``model_init`` is the ranks' alone."""
        import torch

        from raytrainer.checkpoint import (
            CheckpointError,
            CheckpointReader,
            check_shapes,
            loads_its_own_way,
            weight_shapes,
        )

        if not isinstance(target, str):
            return
        model = self._given("model")
        if not isinstance(model, torch.nn.Module) or loads_its_own_way(model):
            return
        try:
            reader = CheckpointReader(target, getattr(self.args, "storage_filesystem", None))
        except CheckpointError:  # not a checkpoint raytrainer reads: transformers says what is wrong with it
            return
        check_shapes(model.state_dict(), weight_shapes(reader), reader.uri)

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval", **kwargs):
        kwargs = dict(eval_dataset=eval_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix,
                      **kwargs)
        self._check_call("evaluate", kwargs)
        result = self._run("evaluate", kwargs)
        self.state.log_history.extend(result.logged or ())  # transformers' evaluate logs its metrics
        return result.output

    def predict(self, test_dataset, ignore_keys=None, metric_key_prefix: str = "test", **kwargs):
        kwargs = dict(test_dataset=test_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix,
                      **kwargs)
        self._check_call("predict", kwargs)
        return self._run("predict", kwargs).output

    def _check_call(self, method: str, kwargs: dict) -> None:
        """The call's data sets, refused here before any worker starts (``preflight.check_datasets``, what
        raytrainer's Trainer is held to), where transformers' loop would refuse them on every rank once the
        group is up; not for a loader the trainer class builds itself (GRPO's)."""
        import transformers

        from raytrainer.deps import require
        from raytrainer.driver.preflight import _starts_a_group, check_datasets, check_in_process

        if self.args.num_workers > 0:  # a machine without them: named with the fix, as raytrainer's loop does
            require("ray.train", f"num_workers={self.args.num_workers} (training on Ray Train workers)")
        if self.args.deepspeed:
            require("deepspeed", "--deepspeed")
        view = inspect.getattr_static(self.user_class, "_driver_view", None)
        if view is not None:  # raytrainer's Trainer: checked as in one process (driver/preflight.py)
            check_in_process(view(self), method, kwargs, owner=type(self).__name__)
        else:
            own = frozenset(method for method, loader in _LOADERS if getattr(self.hosted_class, loader)
                            is not getattr(transformers.Trainer, loader))
            check_datasets(method, kwargs, self.args, self._given("train_dataset"),
                           self._given("eval_dataset"), owner=type(self).__name__, skip=own)
        self._check_plan()
        if method == "train" or _starts_a_group(self):  # Ray Train's run folder, and the checkpoints
            from raytrainer.storage import Storage

            Storage.for_run(self.args).check_writable()

    def _check_plan(self) -> None:
        """Tensor parallelism needs the model's plan: the driver's model (``_untrained_model``: the
        constructor's module, or ``model_init``'s, weightless when big) refused here as raytrainer's loop
        does (``parallelism.check_plan``); a model named by a path is checked on the ranks, which load it."""
        from raytrainer.parallelism import check_plan

        config = getattr(self.args, "parallelism_config", None)
        if config is not None and config.tp_enabled:
            model = self._untrained_model()
            if model is not None:
                check_plan(config, model)

    def _given(self, name: str):
        """The constructor's argument ``name`` as the script gave it (None if absent)."""
        signature = constructor_signature(self.hosted_class)
        args, kwargs = self._constructor
        return _find_args(signature, signature.bind(None, *args, **kwargs), name)

    def hyperparameter_search(self, hp_space=None, compute_objective=None, n_trials: int = 20,
                              direction="minimize", backend=None, hp_name=None, **kwargs):
        """transformers' search over ``model_init`` trials: each trial is this trainer, with the trial's
        arguments, on the search's pooled Ray workers (raytrainer/search); the ranks build the trial's model
        with ``model_init(trial)``, and the driver's pruner or scheduler stops them."""
        from raytrainer.search import hyperparameter_search

        return hyperparameter_search(self, hp_space, compute_objective, n_trials, direction, backend,
                                     hp_name, **kwargs)

    def call_model_init(self, trial=None):
        """transformers' ``Trainer.call_model_init``, on the driver (a search asks it for the suggestions
        that ``model_init`` makes, on the meta device)."""
        import transformers

        return transformers.Trainer.call_model_init(self, trial)

    def for_trial(self, args, callbacks: list):
        """A copy of this trainer for one search trial: the trial's arguments (and its own output_dir), the
        driver's callbacks plus ``callbacks``, a state of its own; no worker group (the search lends one)."""
        from raytrainer.callbacks import TrainerState
        from raytrainer.hosted_callbacks import DriverCallbacks

        trial = object.__new__(type(self))
        signature = constructor_signature(self.hosted_class)
        recipe_args, recipe_kwargs = _replace_args(signature, *self._constructor, args)
        vars(trial).update({k: v for k, v in vars(self).items()
                            if k not in ("_group", "_model", "_hub", "_init_model")})
        vars(trial).update(
            args=args, state=TrainerState(), _hub=None,
            callback_handler=DriverCallbacks([*self.callback_handler.callbacks, *callbacks]),
            _recipe=Recipe.make(self.hosted_class, recipe_args, recipe_kwargs, self._callback_edits))
        return trial

    def is_world_process_zero(self) -> bool:
        return True  # the driver speaks for the run, as rank 0 does under torchrun

    def is_local_process_zero(self) -> bool:
        return True

    def close(self) -> None:
        """End the worker group (and the trainer each rank holds); a later call starts a new one."""
        group = vars(self).pop("_group", None)
        if group is not None:
            group.close()

    def end(self) -> None:
        """transformers' ``end()``: the trackers finish and the processes part -- here, the group closes."""
        self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __reduce__(self):
        """What a copy elsewhere (a Ray Tune trial actor) starts from: no worker group, pusher or fetched
        model of this process's, and the recipe without its object-store reference (the copy puts its own).
        Rebuilt without ``__new__``, which would build the trainer from constructor arguments."""
        # (a copy's tensors count their writes from 0: no mark, so the copy does not pickle its module anew)
        state = {k: v for k, v in vars(self).items()
                 if k not in ("_group", "_model", "_init_model", "_model_mark")}
        state["_hub"] = None
        if "_recipe" in state:
            state["_recipe"] = dataclasses.replace(state["_recipe"], ref=None)
        return _rebuilt, (self.user_class, state)

    def __getattribute__(self, name: str) -> Any:
        """A method of the trainer class (its own or transformers') runs on every rank (``_RankMethod``);
        this class's own attributes and what the driver holds are read here."""
        if name.startswith("__") or name in _HERE or name in object.__getattribute__(self, "__dict__"):
            return object.__getattribute__(self, name)
        found = inspect.getattr_static(type(self), name, None)
        method = isinstance(found, (staticmethod, classmethod)) or callable(found)
        if method and not isinstance(found, type):
            return _RankMethod(self, name)
        return object.__getattribute__(self, name)

    def __getattr__(self, name: str) -> Any:
        """What the trainer class sets on its objects (``hub_model_id``, ``is_fsdp_enabled``...): rank 0's."""
        if name.startswith("__") or name in _DRIVER_SIDE or "_recipe" not in vars(self):
            raise AttributeError(name)
        return self._run("call", {"name": name, "call": False}).output

    def __setattr__(self, name: str, value: Any) -> None:
        """``trainer.train_dataset = data`` (or another of ``_FOLLOWED``), as a script sets it on
        transformers' Trainer, which reads it at each call: here, and from the next call the ranks build the
        trainer with it, as if the constructor had been given it (the trained weights and state kept)."""
        object.__setattr__(self, name, value)
        if name in _FOLLOWED and "_recipe" in vars(self):
            signature = constructor_signature(self.hosted_class)
            if name in signature.parameters:
                args, kwargs = _replace_args(signature, *self._constructor, value, name=name)
                vars(self).update(_constructor=(args, kwargs), _recipe=Recipe.make(
                    self.hosted_class, args, kwargs, self._callback_edits))

    def __repr__(self) -> str:
        return f"<{type(self).__name__} on {self.args.num_workers} Ray workers>"

    # -- the group ------------------------------------------------------------------------------------
    def _run(self, method: str, kwargs: dict, registry=None):
        """``method`` on every rank of this trainer's group: rank 0's ``RankResult``; committed checkpoints
        go to ``registry``."""
        from raytrainer.driver.launch import launch
        from raytrainer.driver.ray_runtime import ensure_ray
        from raytrainer.driver.registry import CheckpointRegistry
        from raytrainer.integrations import tracker_environment
        from raytrainer.protocol import THIS_DRIVER, Spec
        from raytrainer.worker.logs import driver_transformers_level
        from raytrainer.worker.place import driver_place
        from raytrainer.worker.rank import absorb_callback_states, callback_states

        self._follow_the_script()
        ensure_ray(self.args)  # the recipe's payload goes into the object store at the first command
        # a rank that builds the trainer (first call, new group, edited list) starts from the state of the
        # script's callbacks here, which took on rank 0's after each call; a warm rank keeps its own
        kwargs = {**kwargs, "callback_states": callback_states(self.callback_handler.callbacks)}
        if method != "train" and vars(self).get("_weights_at"):  # ranks that build the trainer anew (a new
            from raytrainer.callbacks import state_to_dict  # or restarted group) load them, and the state

            kwargs = {**kwargs, "trained_weights": self._weights_at,
                      "trained_state": state_to_dict(self.state)}
        if method in ("evaluate", "predict"):  # a Ray Dataset to evaluate on: its rows, read here
            from raytrainer.data import ray_data_rows

            kwargs = {k: ray_data_rows(v) if k in ("eval_dataset", "test_dataset") else v
                      for k, v in kwargs.items()}
        recipe, payload = self._recipe.for_command()
        spec = Spec(recipe, kwargs, driver_transformers_level(), *driver_place(), payload=payload,
                    driver=THIS_DRIVER, environ=tracker_environment())
        result = launch(self, spec, method, registry or CheckpointRegistry(self.args))
        # what the script's callbacks recorded on rank 0, in the script's own instances (as in one process)
        absorb_callback_states(self.callback_handler.callbacks, result.callbacks)
        return result

    @property
    def model(self):
        """Rank 0's trained model, on first use after each ``train()``: the ranks save it (``save_model``, a
        collective under FSDP and ZeRO-3; ZeRO-3's partitions consolidated: worker/hosted_sharding.py) into
        ``<output_dir>/.raytrainer/model``, and the driver reads it into the module the script gave the
        constructor, in place, as transformers' Trainer trains the script's own module (or into what
        ``model_init()`` builds here, for a run without one); a model named by a path, or one whose saved
        files another class wrote (TRL's PEFT wrapping), is loaded with ``from_pretrained``. Weights never
        travel through the event channel."""
        if "_model" not in vars(self) and not vars(self).get("_trained"):  # before any train()
            model = self._untrained_model()
            if model is not None:
                return model
        if "_model" not in vars(self):
            at = vars(self).get("_weights_at")
            if at is not None:  # written by the ranks at the end of train(): into the driver's own module
                from raytrainer import final_weights

                own = self._driver_module(None)
                if own is not None:
                    final_weights.load_into(own, at, getattr(self.args, "storage_filesystem", None))
                    self._model = own
                    return own
            folder = os.path.join(os.path.abspath(self.args.output_dir), ".raytrainer", "model")
            self._run("call", {"name": "_raytrainer_save_whole", "call": True, "args": (folder,),
                               "kwargs": {}})
            model_cls = self._run("call", {"name": "model.__class__", "call": False}).output
            own = self._driver_module(model_cls)
            if own is not None and _filled_in_place(own, folder):
                self._model = own
            elif _is_peft(model_cls):
                self._model = self._adapter_on_its_base(folder, model_cls)
            elif hasattr(model_cls, "from_pretrained"):
                self._model = model_cls.from_pretrained(folder)
            else:
                # not AttributeError: Python would hand that to __getattr__, which would hide this message
                raise RuntimeError(
                    f"trainer.model: the trained {model_cls.__name__} stays on the workers (it has no "
                    f"from_pretrained, and neither the constructor's model nor model_init() gives one to "
                    f"load into); its weights are in {folder}")
        return self._model

    @model.setter
    def model(self, module) -> None:
        """``trainer.model = module``, as a script sets it on transformers' Trainer: the driver's model is
        ``module`` and from the next call the ranks build the trainer around it, as given ``model=module``
        (the driver keeps the run's state and callbacks; the ranks' previous trainer is freed)."""
        signature = constructor_signature(self.hosted_class)
        args, kwargs = _replace_args(signature, *self._constructor, module, name="model")
        vars(self).update(_constructor=(args, kwargs), _model=module, _trained=False,
                          _recipe=Recipe.make(self.hosted_class, args, kwargs, self._callback_edits),
                          _model_mark=module_mark(module))
        vars(self).pop("_weights_at", None)

    def _follow_the_script(self) -> None:
        """The ranks build the trainer from the script's objects as they are at each call, as transformers'
        Trainer reads the ones it holds:

        - ``trainer.args`` changed after the constructor (``trainer.args.seed = 314``): a new recipe with the
          arguments as they are (the payload is not pickled again), the trained weights and state kept;
        - until the first ``train()``, the constructor's module changed (a layer frozen, weights loaded,
          ``model.config.use_cache = False``): a new recipe around it, pickled anew; after ``train()`` the
          ranks' model is the trained one (the driver's module only mirrors it)."""
        from raytrainer.hosted_recipe import arguments_mark

        if not vars(self).get("_trained") and "_model_mark" in vars(self):
            module = self._given("model")
            if module_mark(module) != self._model_mark:
                self.model = module
        if self._recipe.mark and arguments_mark(self.args) != self._recipe.mark:
            self._recipe = self._recipe.with_arguments(self.args)

    def _untrained_model(self):
        """The model before any ``train()``, as the driver holds it: the script's module (what the ranks
        built the trainer around), or ``model_init``'s as transformers' constructor builds it -- without
        weights when big (raytrainer.meta_model), kept; None for a model the ranks load by name."""
        import torch

        given = self._given("model")
        if isinstance(given, torch.nn.Module):
            return given
        if self._model_init_here():
            from raytrainer.meta_model import driver_model

            if "_init_model" not in vars(self):
                self._init_model = driver_model(self.model_init)
            return self._init_model
        return None

    def _final_weights_wanted(self) -> str | None:
        """What the ranks write their final weights for (worker/hosted.py): the class name of the module the
        constructor was given, ``"model_init"`` for a run that builds it with ``model_init()``, else None
        (a model named by a path: ``trainer.model`` loads it with ``from_pretrained``)."""
        import torch

        given = self._given("model")
        if isinstance(given, torch.nn.Module):
            return type(given).__qualname__
        return "model_init" if self._model_init_here() else None

    def _driver_module(self, model_cls: type | None):
        """The module on the driver that the trained weights go into: the constructor's model, else (a run
        with ``model_init`` taking no trial) a new one from ``model_init()``; if ``model_cls`` is given, only
        one of that class."""
        import torch

        from raytrainer.meta_model import is_skeleton, materialise

        own = self._given("model")
        if own is None and self._model_init_here():
            own = vars(self).get("_init_model")  # the one trainer.model gave before train(): filled in place
            if own is None:
                own = self.model_init()
            elif is_skeleton(own):
                materialise(own, self.model_init)
        if not isinstance(own, torch.nn.Module) or (model_cls is not None and type(own) is not model_cls):
            return None
        return own

    def _model_init_here(self) -> bool:
        """The driver can build the model itself: ``model_init`` taking no trial (a search's trial builds
        its own on the ranks)."""
        from raytrainer.search.common import model_init_takes_trial

        return self.model_init is not None and not model_init_takes_trial(self)

    def _adapter_on_its_base(self, folder: str, model_cls: type):
        """A PEFT model: the ranks saved its adapter (PEFT's files), which goes onto its base model loaded
        from where the ranks loaded it (the adapter config's ``base_model_name_or_path``, read from the
        driver's working directory, as the ranks read it). The base was frozen: its files are its weights."""
        from peft import PeftConfig

        base_cls = self._run("call", {"name": "model.base_model.model.__class__", "call": False}).output
        base = base_cls.from_pretrained(PeftConfig.from_pretrained(folder).base_model_name_or_path)
        return model_cls.from_pretrained(base, folder)

    # what launch() and the driver's display read of a trainer
    _display_model = None  # the display's callbacks get no model: it stays on the workers
    processing_class = None
    train_dataset = None


def resume_target(args, resume_from_checkpoint):
    """The checkpoint a hosted ``train()`` resumes, checked on the driver before the loop starts: for True the
    latest one committed to the run's storage (else, as transformers would, the latest in a local
    ``output_dir``); a given folder or URI must be a whole checkpoint. The ranks read it in place or copy
    it first."""
    from raytrainer.checkpoint import committed_checkpoints, resolve_resume
    from raytrainer.storage import Storage

    storage = Storage.for_run(args)
    if resume_from_checkpoint is True and not committed_checkpoints(storage, warn=False):
        from transformers.trainer_utils import get_last_checkpoint

        if os.path.isdir(args.output_dir) and (last := get_last_checkpoint(args.output_dir)):
            return last
    return resolve_resume(storage, resume_from_checkpoint)


def _filled_in_place(module, folder: str) -> bool:
    """Whether the weights saved in ``folder`` went into ``module`` in place: a single ``model.safetensors``
    that fits it (transformers' ``_save``; tied weights stored once), or a PEFT model's adapter file into
    its adapters (the frozen base is the one the script built). Other layouts (sharded files) are read
    with ``from_pretrained``."""
    from raytrainer import final_weights
    from raytrainer.checkpoint import ADAPTER_WEIGHTS, CheckpointError

    if _is_peft(type(module)):
        if not os.path.exists(os.path.join(folder, ADAPTER_WEIGHTS)):
            return False
        from peft.utils import set_peft_model_state_dict
        from safetensors.torch import load_file

        set_peft_model_state_dict(module, load_file(os.path.join(folder, ADAPTER_WEIGHTS)))
        return True
    if not os.path.exists(os.path.join(folder, "model.safetensors")):
        return False
    try:
        final_weights.load_into(module, folder)
    except CheckpointError as error:
        if not hasattr(type(module), "from_pretrained"):
            raise
        logger.info("trainer.model: %s; loading it with from_pretrained instead", error)
        return False
    return True


def _is_peft(model_cls: type) -> bool:
    import sys

    peft = sys.modules.get("peft")  # a PEFT model came back: peft is imported
    return peft is not None and issubclass(model_cls, peft.PeftModel)


#: Each call's data loader in transformers.Trainer.
_LOADERS = (("train", "get_train_dataloader"), ("evaluate", "get_eval_dataloader"),
            ("predict", "get_test_dataloader"))

#: What transformers' Trainer reads at each call from the attributes its constructor set, which a script may
#: set anew between calls (``HostedTrainer.__setattr__``)
_FOLLOWED = frozenset({"train_dataset", "eval_dataset", "data_collator", "compute_metrics",
                       "compute_loss_func", "preprocess_logits_for_metrics"})
#: Read on the driver's object itself: what ``HostedTrainer`` defines and what the driver holds.
_HERE = frozenset({*vars(HostedTrainer), *_DRIVER_SIDE, "hosted_class", "user_class"})


def _rebuilt(cls: type, state: dict) -> HostedTrainer:
    trainer = object.__new__(_driver_class(cls))
    vars(trainer).update(state)
    return trainer


class DriverAccelerator:
    """``trainer.accelerator`` on the driver, which speaks for the run as its main process does: what scripts
    call on it after ``train()`` (``print``, the main-process checks, ``wait_for_everyone``)."""

    is_main_process = is_local_main_process = True
    process_index = local_process_index = 0

    def __init__(self, num_processes: int):
        self.num_processes = num_processes

    def print(self, *args, **kwargs) -> None:
        print(*args, **kwargs)

    def wait_for_everyone(self) -> None:
        """Nothing to wait for: each call on the workers has ended when it returns here."""

    def unwrap_model(self, model, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True):
        """``model`` out of its DataParallel / DDP / ``torch.compile`` wrappers, as accelerate's own (the
        driver's ``trainer.model`` is never wrapped: it is returned as it is)."""
        from accelerate.utils import extract_model_from_parallel

        return extract_model_from_parallel(model, keep_fp32_wrapper, keep_torch_compile)

    @contextlib.contextmanager
    def main_process_first(self):
        yield

    local_main_process_first = main_process_first


class _RankMethod:
    """A trainer method run on every rank (rank 0's answer): ``trainer.save_model(...)`` on the driver."""

    def __init__(self, trainer: HostedTrainer, name: str):
        self.trainer, self.name = trainer, name

    def __call__(self, *args, **kwargs):
        return self.trainer._run("call", {"name": self.name, "call": True, "args": args,
                                          "kwargs": kwargs}).output

    def __repr__(self) -> str:
        return f"<{self.name} of {self.trainer!r}, run on every rank>"


def check(trainer_cls: type, targs) -> None:
    """What the driver refuses before any worker starts: a ``report_to`` tracker whose package is missing
    (named, with the install command), a mesh (``parallelism_config``) transformers' loop cannot run on CPU
    workers, and GRPO's vLLM server mode."""
    from raytrainer.integrations import get_reporting_integration_callbacks

    get_reporting_integration_callbacks(targs.report_to)
    if getattr(targs, "parallelism_config", None) is not None and not targs.use_gpu:
        from raytrainer.worker import hosted_mesh

        hosted_mesh.check(targs)  # accelerate refuses the mesh on CPU; raytrainer lays it (hosted_mesh.py)
    if getattr(targs, "use_vllm", False) and getattr(targs, "vllm_mode", None) == "server":
        raise ValueError(
            "use_vllm=True with vllm_mode='server': the vLLM server is a process of its own on GPUs outside "
            "the Ray workers (`trl vllm-serve`), which raytrainer neither starts nor places; generate with "
            "transformers on each worker (use_vllm=False) or with vLLM inside each worker "
            "(vllm_mode='colocate', on GPU workers)")
