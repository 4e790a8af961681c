"""The entry point of every Ray Train worker: a loop that runs its group's commands until the group closes.

A worker group outlives one Trainer call (driver/group.py): the processes, their imports and the process
group are made once, and ``train``, ``evaluate``, ``predict`` -- and search trials, one after another -- run
on them. Each script starts from a clean slate: the process-level state a command may change (random
generators, determinism and TF32 flags, the default dtype, environment variables) is put back as the fresh
worker had it before another script's first command, and the compile caches and the CUDA cache are emptied
after every command, so a script's run gives the same result whatever ran before it.

Between two commands of one script that state is the script's, as between two calls in one process: the
next command finds it as the last one left it. A trainer a command builds seeds the random generators itself
(transformers' ``set_seed``) and sets its flags, but one kept from an earlier command (``evaluate()`` then
``train()``) does neither: it reads the stream as it finds it -- accelerate's seedable sampler takes the
shuffle's seed from it, which every rank must share, and torch seeds a fresh worker's at random -- and runs
with ``full_determinism`` or ``tf32`` only as long as the flags stay set.
"""

from __future__ import annotations

import gc
import os
import random
import sys
import time

import cloudpickle
import numpy as np
import torch

from raytrainer import failures

#: When this worker entered the loop and last received and unpickled a command (``time.time()``), for the
#: start-up breakdown (bench/bench_startup.py).
TIMES: dict[str, float] = {}


def worker_main(config: dict) -> None:
    """Ray Train's train function: wait for a command, run it on this rank, hand back the result, repeat."""
    import ray

    from raytrainer.import_scratch import imports_in_own_folder, remove_own
    from raytrainer.rank_context import ray_train_context
    from raytrainer.worker.channel_client import ChannelClient
    from raytrainer.worker.hosted import run_hosted
    from raytrainer.worker.place import as_on_the_driver
    from raytrainer.worker.session import RankSession

    TIMES["entry"] = time.time()
    ctx = ray_train_context(config["use_gpu"], config["ray_run_root"])
    client = ChannelClient(config["channel"], ctx.rank)
    fresh = ProcessState()
    done, driver = 0, None
    while (command := client.next_command(done)) is not None:
        (spec_ref,) = command.spec
        TIMES["command"] = time.time()
        spec = ray.get(spec_ref)  # an object-store reference: the bytes are fetched here
        if driver is not None and spec.driver != driver:  # another script's run (driver/keeper.py)
            fresh.restore()  # between one script's commands the state stays as it was (module docstring)
            fresh.forget_scripts_modules()
        driver = spec.driver
        session = RankSession(ctx, client, transformers_log_level=spec.transformers_log_level)
        try:
            # relative paths mean what they mean there, and the Trainer's classes import from where the
            # driver's did (a folder the script put on sys.path, which Ray does not pass on)
            with as_on_the_driver(spec.cwd, spec.paths, spec.environ):
                with imports_in_own_folder():  # wandb's folders, when TRL imports it (import_scratch.py)
                    recipe = cloudpickle.loads(spec.trainer)  # a Recipe (raytrainer/hosted_recipe.py)
                TIMES["spec"] = time.time()
                result = run_hosted(recipe, session, command.method.value, spec.kwargs, payload=spec.payload,
                                    keep=spec.keep)
        except BaseException as exc:
            if not (failures.retryable(exc) or failures.torn_down(ctx.world_size)):
                client.record_fatal(failures.pickled(exc, ctx.rank))  # no retry trains again (failures.py)
            raise
        del recipe, spec, session
        client.set_result(command.id, result)
        empty_caches()
        done = command.id
    remove_own()  # the group closed: Ray Train ends this process without an interpreter exit


class ProcessState:
    """The process-wide state a command may change, as it was when the worker started."""

    def __init__(self):
        self.rng = (random.getstate(), np.random.get_state(), torch.get_rng_state(),
                    torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
        self.deterministic = (torch.are_deterministic_algorithms_enabled(),
                              torch.is_deterministic_algorithms_warn_only_enabled())
        self.flags = _backend_flags()
        self.dtype = torch.get_default_dtype()
        self.threads = torch.get_num_threads()
        self.environ = dict(os.environ)
        self.modules = set(sys.modules)

    def forget_scripts_modules(self) -> None:
        """Another script's commands come next (a kept group, driver/keeper.py): the modules imported since
        the worker started from outside the Python installation -- the last script's own, beside it or on
        its path -- are imported again, as the new script has them, when its trainer unpickles."""
        prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix}
        installed = tuple(os.path.realpath(p) + os.sep for p in prefixes)
        for name in set(sys.modules) - self.modules:
            module = sys.modules.get(name)
            path = getattr(module, "__file__", None)
            if (path and not name.startswith("raytrainer")
                    and not os.path.realpath(path).startswith(installed)):
                del sys.modules[name]

    def restore(self) -> None:
        py, np_state, cpu, cuda = self.rng
        random.setstate(py)
        np.random.set_state(np_state)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        torch.use_deterministic_algorithms(self.deterministic[0], warn_only=self.deterministic[1])
        for (holder, name), value in self.flags.items():
            setattr(holder, name, value)
        torch.set_default_dtype(self.dtype)
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        for key in set(os.environ) - set(self.environ):
            del os.environ[key]
        os.environ.update({k: v for k, v in self.environ.items() if os.environ.get(k) != v})


def empty_caches() -> None:
    """What a finished command leaves cached: the compiled graphs of its model, its garbage, CUDA's blocks."""
    if hasattr(torch, "_dynamo"):
        torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _backend_flags() -> dict:
    flags = {}
    matmul = ("allow_tf32", "allow_fp16_reduced_precision_reduction",
              "allow_bf16_reduced_precision_reduction")
    for holder, names in ((torch.backends.cuda.matmul, matmul),
                          (torch.backends.cudnn, ("allow_tf32", "benchmark", "deterministic"))):
        for name in names:
            flags[(holder, name)] = getattr(holder, name)
    return flags
