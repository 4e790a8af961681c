"""Bad input, measured: each case is a mistake a user makes, on a 2-worker run (the path where something
could start). For each: the error raised on the driver, how long it took, and whether anything started (a
Ray instance, or the training). Writes the table of docs/reliability.md.

    .venv/bin/python bench/reliability.py                          # print the table
    .venv/bin/python bench/reliability.py --soak 20 --write docs/reliability.md
    .venv/bin/python bench/reliability.py --keep-soak --chaos chaos-*.json --write docs/reliability.md

A case passes when a ValueError / TypeError / CheckpointError names the offending value, within 5 s, with
Ray not started and no training step taken. The fault scenarios (killed workers, corrupted checkpoints,
deterministic failures on workers) are integration tests; the table lists them with the test that
measures each. ``--chaos`` adds the tables of bench/chaos.py's runs (its ``--json`` files); without it, the
chaos section of the file ``--write`` replaces is kept as it is.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from _machine import machine_info  # noqa: E402
from torch import nn  # noqa: E402

from raytrainer import Trainer, TrainingArguments  # noqa: E402
from raytrainer.checkpoint import CheckpointError  # noqa: E402


class Net(nn.Module):
    def __init__(self, width: int = 4):
        super().__init__()
        self.linear = nn.Linear(width, 3)

    def forward(self, x, labels=None):
        logits = self.linear(x)
        if labels is None:
            return {"logits": logits}
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


class NoLoss(Net):
    def forward(self, x, labels=None):
        return {"logits": self.linear(x)}


def data(n: int = 16, width: int = 4) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, width, generator=g)
    return [{"x": x[i], "labels": int(i % 3)} for i in range(n)]


class Unpicklable:
    """A callback holding a lock: it cannot travel to a worker."""

    def __init__(self):
        self.lock = threading.Lock()


def _args(out: str, **kw) -> TrainingArguments:
    base = {"output_dir": out, "num_workers": 2, "report_to": "none", "disable_tqdm": True, "max_steps": 2}
    return TrainingArguments(**{**base, **kw})


def _train(out, model=None, dataset=None, call="train", call_kwargs=None, trainer_kw=None, **kw):
    trainer = Trainer(model=model if model is not None else Net(), args=_args(out, **kw),
                      train_dataset=data() if dataset is None else dataset, **(trainer_kw or {}))
    return getattr(trainer, call)(**(call_kwargs or {}))


def _hosted(out, dataset=(), **kw):
    """transformers' own Trainer on 2 workers (``raytrainer.on_ray``), as a TRL script's trainer runs."""
    import transformers

    from raytrainer import config_on_ray, on_ray

    kw = {"output_dir": out, "num_workers": 2, "report_to": "none", **kw}
    args = config_on_ray(transformers.TrainingArguments)(**kw)
    return on_ray(transformers.Trainer)(model_init=Net, args=args,
                                        train_dataset=data() if dataset == () else dataset)


def _foreign_folder(out):
    folder = os.path.join(out, "not-a-checkpoint")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "notes.txt"), "w") as f:
        f.write("hello")
    return folder


def _other_model_checkpoint(out):
    """A committed checkpoint of a 4-feature model, resumed by a 5-feature one."""
    saved = os.path.join(out, "saved")
    Trainer(model=Net(4), args=TrainingArguments(output_dir=saved, num_workers=0, max_steps=1, save_steps=1,
                                                 report_to="none", disable_tqdm=True),
            train_dataset=data()).train()
    return os.path.join(saved, "checkpoint-1")


def _blocked_path(out):
    blocker = os.path.join(out, "a-file")
    with open(blocker, "w") as f:
        f.write("not a folder")
    return os.path.join(blocker, "runs")


CASES = [
    # (what the user did, how)
    ("learning_rate=-1", lambda o: _args(o, learning_rate=-1)),
    ("per_device_train_batch_size=0", lambda o: _args(o, per_device_train_batch_size=0)),
    ("max_steps=0", lambda o: _args(o, max_steps=0)),
    ("eval_strategy='sometimes'", lambda o: _args(o, eval_strategy="sometimes")),
    ("save_total_limit=0", lambda o: _args(o, save_total_limit=0)),
    ("warmup_steps=-1", lambda o: _args(o, warmup_steps=-1)),
    ("lr_scheduler_type='zigzag'", lambda o: _args(o, lr_scheduler_type="zigzag")),
    ("optim='adamw_fast'", lambda o: _args(o, optim="adamw_fast")),
    ("log_level='loud'", lambda o: _args(o, log_level="loud")),
    ("nonfinite_loss='stop'", lambda o: _args(o, nonfinite_loss="stop")),
    ("max_failures=-2", lambda o: _args(o, max_failures=-2)),
    ("placement_strategy='NEAR'", lambda o: _args(o, placement_strategy="NEAR")),
    ("resources_per_worker={'CPU': -1}", lambda o: _args(o, resources_per_worker={"CPU": -1})),
    ("fsdp='full_shard shard_grad_op' (two modes)", lambda o: _args(o, fsdp="full_shard shard_grad_op")),
    ("fsdp='explode'", lambda o: _args(o, fsdp="explode")),
    ("fp16 with FSDP sharding", lambda o: _args(o, fsdp="full_shard", fp16=True)),
    ("deepspeed config file missing", lambda o: _args(o, deepspeed=os.path.join(o, "missing.json"))),
    ("deepspeed with num_workers=0", lambda o: _args(o, num_workers=0, deepspeed={"zero_optimization": {
        "stage": 2}})),
    ("deepspeed with fsdp", lambda o: _args(o, fsdp="full_shard", deepspeed={"zero_optimization": {
        "stage": 2}})),
    ("load_best_model_at_end, eval 'steps' / save 'epoch'",
     lambda o: _args(o, load_best_model_at_end=True, eval_strategy="steps", save_strategy="epoch")),
    ("optim='galore_adamw' without target modules", lambda o: _args(o, optim="galore_adamw")),
    ("use_liger_kernel=True", lambda o: _args(o, use_liger_kernel=True)),
    ("debug='tpu_metrics_debug'", lambda o: _args(o, debug="tpu_metrics_debug")),
    ("accelerator_config split_batches=True", lambda o: _args(o, accelerator_config={"split_batches": True})),
    ("report_to='tensorbord' (a typo)", lambda o: _train(o, report_to="tensorbord")),
    ("use_gpu=True on a machine without GPUs", lambda o: _train(o, use_gpu=True)),
    ("storage_path under a file", lambda o: _train(o, storage_path=_blocked_path(o))),
    ("storage_path='ftp://host/x'", lambda o: _train(o, storage_path="ftp://host/x")),
    ("no model and no model_init", lambda o: Trainer(args=_args(o), train_dataset=data())),
    ("model_init with optimizers", lambda o: Trainer(model_init=Net, args=_args(o), train_dataset=data(),
                                                     optimizers=(torch.optim.SGD(Net().parameters(), 0.1),
                                                                 None))),
    ("train() without train_dataset", lambda o: Trainer(model=Net(), args=_args(o)).train()),
    ("evaluate() without eval_dataset", lambda o: _train(o, call="evaluate")),
    ("eval_on_start without eval_dataset", lambda o: _train(o, eval_on_start=True)),
    ("an empty train_dataset", lambda o: _train(o, dataset=[])),
    ("a model that returns no loss", lambda o: _train(o, model=NoLoss())),
    ("examples without the model's input", lambda o: _train(o, dataset=[{"y": torch.zeros(4),
                                                                          "labels": 1}] * 8)),
    ("an unpicklable callback", lambda o: _train(o, trainer_kw={"callbacks": [Unpicklable()]})),
    ("num_workers=(3, 2) (min above max)", lambda o: _args(o, num_workers=(3, 2))),
    ("num_workers=(2, 4) with a global batch 3 workers cannot split",
     lambda o: _args(o, num_workers=(2, 4), per_device_train_batch_size=8)),
    ("auto_find_batch_size with num_workers=(1, 2)",
     lambda o: _args(o, num_workers=(1, 2), auto_find_batch_size=True)),
    ("parallelism_config of 4 ranks on num_workers=2",
     lambda o: _args(o, parallelism_config={"dp_shard_size": 2, "tp_size": 2})),
    ("parallelism_config={'tpsize': 4} (a typo)", lambda o: _args(o, parallelism_config={"tpsize": 4})),
    ("parallelism_config with deepspeed",
     lambda o: _args(o, num_workers=4, parallelism_config={"dp_shard_size": 2, "tp_size": 2},
                     deepspeed={"zero_optimization": {"stage": 3}})),
    ("parallelism_config on CPU workers, transformers' own Trainer (on_ray)",
     lambda o: _hosted(o, parallelism_config={"dp_shard_size": 2})),
    ("report_to='tensorbord' (a typo), transformers' own Trainer (on_ray)",
     lambda o: _hosted(o, report_to="tensorbord")),
    ("train() without train_dataset, transformers' own Trainer (on_ray)",
     lambda o: _hosted(o, dataset=None).train()),
    ("an empty train_dataset, transformers' own Trainer (on_ray)", lambda o: _hosted(o, dataset=[]).train()),
    ("resume from a folder that does not exist",
     lambda o: _train(o, call_kwargs={"resume_from_checkpoint": os.path.join(o, "nope")})),
    ("resume from a folder that is not a checkpoint",
     lambda o: _train(o, call_kwargs={"resume_from_checkpoint": _foreign_folder(o)})),
    ("resume=True with no checkpoint in output_dir",
     lambda o: _train(o, call_kwargs={"resume_from_checkpoint": True})),
    ("resume a checkpoint of another model shape",
     lambda o: _train(o, model=Net(5), dataset=data(width=5),
                      call_kwargs={"resume_from_checkpoint": _other_model_checkpoint(o)})),
]

# Fault scenarios and the test that measures each (CI runs those tests/integration/ci_tier.py lists; the full
# tier, scripts/test.sh --full, runs every one).
SCENARIOS = [
    ('a worker process lost mid-run (rank 1 exits at step 5), max_failures=1',
     'a new worker group resumes from the last committed checkpoint; final weights bitwise equal to '
     "an uninterrupted run's",
     'tests/integration/test_failures.py'),
    ("Ray Train's preemption notice (a node drain: a spot reclaim, `ray drain-node`), with a deadline "
     '3 s away, reaches rank 1 at step 3 of 8, 2 workers, `max_failures=0`',
     'every rank saves at step 4 (the ranks compare at every step for the first 8, about once a '
     'second after; a decision lands one check after the notice, without a blocking collective); '
     "checkpoint-4 is committed with both ranks' files and no rank takes step 5; Ray Train restarts "
     'the group at the deadline without spending `max_failures`; the restart resumes from '
     "checkpoint-4 (the first group's steps 1-4, the second's 5-8) and ends bitwise where an "
     "uninterrupted run ends. The notice is set on the worker as Ray's watcher sets it",
     'tests/integration/test_preemption.py'),
    ("SIGTERM to rank 1's process as step 5 of 12 begins (a scheduler ending the job), 2 workers, "
     '`save_strategy="no"`, `max_failures=1`; raytrainer\'s Trainer, `on_ray(transformers.Trainer)` '
     "and TRL's SFTTrainer, with `enable_jit_checkpoint=True`",
     'every rank saves checkpoint-6 and commits it, then stops; Ray Train starts the group again, '
     'which resumes there (steps 1-6, then 7-12: none trained twice); the signalled process is gone; '
     "losses and every weight equal an uninterrupted run's, bitwise. Before: no checkpoint, training "
     'went on to step 12, the worker then died and the restart had nothing to do; a hosted trainer '
     "with `enable_jit_checkpoint=True` failed on every worker (transformers' handler needs the main "
     'thread)',
     'tests/integration/test_guarantees.py'),
    ("the same with `max_failures=0` (TRL's SFTTrainer)",
     '`train()` raises `Terminated` naming checkpoint-6, committed; '
     "`train(resume_from_checkpoint=True)` trains steps 7-12 and ends with an uninterrupted run's "
     'weights, bitwise',
     'tests/integration/test_guarantees.py'),
    ("a worker's node drained for preemption on a fresh 3-node local cluster, 2 workers, "
     '`save_steps=1000`: (a) `ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION` with a 15 s '
     "deadline, the node's processes SIGKILLed after it, `max_failures=0`; (b) SIGTERM to the node's "
     '`ray start`, as a pod eviction (Ray drains the node for 8 s, then stops it), `max_failures=1`',
     "Ray's watcher gives notice; both ranks save at the same step, commit, and wait; Ray restarts "
     'the group on the two nodes left ((a) without counting a failure; in (b) Ray counts one when the '
     "node stops its processes before Ray Train's controller restarts the group at the same deadline, "
     'as it did on a loaded machine); the run resumes from that checkpoint and finishes its 60 steps, '
     "no step trained twice. Before raytrainer pinned its channel actor to the driver's node, the "
     'channel could sit on the drained node and the restart failed',
     'tests/integration/test_preemption_multinode.py ((b) full tier)'),
    ('an elastic run, `num_workers=(2, 3)`, batch 4 (a global batch of 12), on a fresh 3-node local '
     "cluster: a worker's node loses every process (SIGKILL, no notice) after step 12, "
     '`max_failures=1`',
     'Ray Train restarts the group on the 2 nodes left; it resumes from checkpoint-10 on 2 workers '
     'with 3 x 2 accumulation steps each (the console: "shrunk from 3 to 2 workers"; '
     '`trainer.state.log_history` records the change) and finishes the epoch; every one of the 360 '
     "samples is trained exactly once in the run's history, each step trains 12, and losses and final "
     'weights are those of the same training uninterrupted with a batch of 12, to 1e-4',
     'tests/integration/test_elastic.py'),
    ('the same run on 2 nodes; a third node joins after step 7 (`cluster/local-multinode.sh add`)',
     "at the controller's next check (3 s in the test) raytrainer's scaling policy asks the ranks for "
     'a checkpoint instead of restarting at once: every rank saves at the same step (checkpoint-13), '
     'commits and waits; the group restarts on 3 workers from it, no step trained twice ("grown from '
     '2 to 3 workers"); the same sample count and losses as above',
     'tests/integration/test_elastic.py'),
    ('`num_workers=(2, 4)` with a batch of 8 (32 samples a step, which 3 workers cannot split); `(3, '
     '2)`; `"a:b"`; a range with `auto_find_batch_size`',
     'refused on the driver before Ray starts, naming the value, the global batch, the sizes that '
     'cannot split it and the least multiple that works',
     'tests/unit/test_elastic_args.py'),
    ('a non-finite loss on one rank, max_failures=1',
     "NonFiniteLossError naming rank 1 and the step; Ray's restart does not train again (one training "
     'start per rank)',
     'tests/integration/test_failures.py'),
    ('a non-finite loss in one process',
     'stops before the bad update; weights and checkpoints finite; skip_step / ignore as asked',
     'tests/unit/test_precision.py'),
    ('raytrainer installed without extras (`pip install -c constraints.txt .` in a clean venv): the '
     'demo in one process, `resume_from_checkpoint=True`, a 2-worker run whose rank 1 dies at step 5 '
     '(max_failures=1)',
     "the demo ends above 90%; the resume goes on from checkpoint-8 to step 10; the lost worker's run "
     "ends at the uninterrupted run's weights, bitwise",
     'scripts/plain_install_check.sh (the first step of `.ci/run`)'),
    ('a stop or save flag set on one rank in on_log / on_evaluate',
     'agreed on every rank in the same step, no hang',
     'tests/integration/test_ddp.py'),
    ('a partial latest checkpoint (its save never finished)',
     'resume_from_checkpoint=True skips it with a warning naming it and takes the previous one; an '
     'explicit path is an error',
     'tests/unit/test_checkpoint.py'),
    ('flipped bytes in a committed checkpoint',
     'refused when read (sha256 against its manifest), naming the file; resume_from_checkpoint=True '
     '(or a restart) resumes from the checkpoint before it with a warning naming both, bitwise as an '
     'uninterrupted run; an explicit path is an error',
     'tests/unit/test_checkpoint.py'),
    ('flipped bytes in a part of a sharded checkpoint in a bucket that a rank reads in ranges',
     "refused when that part is read (the sha256 of each block it touches, against the manifest's "
     'block hashes), naming the file, with the same fallback; the blocks a rank does not need are '
     'neither read nor checked by it (each file is checked whole by the rank that owns it)',
     'tests/unit/test_block_hashes.py'),
    ('rank 0 killed half-way through writing a checkpoint, max_failures=1',
     'that checkpoint is never used: the new worker group resumes from the one before, writes it '
     'again whole, and ends bitwise equal to an uninterrupted run',
     'tests/integration/test_failures.py (full tier)'),
    ('the storage is full during a save (ENOSPC)',
     'the run stops with an error naming the checkpoint and the file; the checkpoint is not '
     'committed, the earlier ones are intact and resume',
     'tests/unit/test_checkpoint.py'),
    ('an unwritable storage_path (`/proc/raytrainer-runs`) with save_strategy="no" on 2 workers '
     '(train, or an evaluate that starts a group)',
     "refused on the driver within 5 s, naming the path, before Ray starts (Ray's run folder and the "
     'final weights go there)',
     'tests/unit/test_checkpoint.py'),
    ("use_gpu=True on a cluster without GPUs once Ray is up in the process (the script's own "
     "ray.init, a notebook's second run)",
     "refused at once, naming each node's resources and the fix; no worker group started",
     'tests/integration/test_resources.py'),
    ('resources_per_worker naming a resource no node has',
     "refused at once, naming it and each node's resources",
     'tests/integration/test_resources.py'),
    ('a worker group the nodes cannot hold, on a cluster whose autoscaler may add nodes',
     'a warning at once (what the run waits for, what the cluster has); the same message as an error '
     'after RAYTRAINER_RESOURCE_WAIT_S (600 s)',
     'tests/integration/test_resources.py'),
    ("Ray Train's own log records on the workers (each reported checkpoint at INFO)",
     "kept off the console at every log level above debug (in the rank's log file); a 2-worker run "
     "that saves, evaluates and resumes prints no line of Ray's modules",
     'tests/integration/test_failures.py'),
    ("Ray's bookkeeping in output_dir",
     '`checkpoint_manager_snapshot.json`, `.validate_storage_marker` and the final weights are under '
     '`.raytrainer/`; output_dir lists the checkpoints (and `logs/`); get_last_checkpoint and a '
     '`checkpoint-*` glob find only checkpoints; rotation and the lazy best-model load work',
     'tests/integration/test_checkpoints.py'),
    ('a hub token planted in a Ray Tune search',
     "not in Tune's trial spec, the output folder, the bucket's objects or Ray's session files; "
     'trials do not push (warned)',
     'tests/integration/test_search.py'),
    ('the driver killed (SIGKILL) mid-run, the script run again with resume_from_checkpoint=True',
     'the rerun goes on from the last committed checkpoint through the same steps and losses as an '
     'uninterrupted run; no checkpoint is pushed to the hub twice',
     'tests/unit/test_driver_killed.py'),
    ('a DeepSpeed checkpoint file holding a pickle payload',
     "DeepSpeed's own loader runs with weights_only=True and its checkpoint types allow-listed: "
     'refused, naming the file; the payload never runs',
     'tests/unit/test_deepspeed_load.py'),
    ('the driver of a 2-worker Ray run killed (SIGKILL) mid-run, the script run again with '
     'resume_from_checkpoint=True',
     "Ray ends the killed job's controller, workers, channel and placement group; the rerun resumes "
     'from the last committed checkpoint through the same steps and losses as an uninterrupted run; '
     'no checkpoint is pushed to the hub twice',
     'tests/integration/test_driver_killed_on_ray.py (full tier)'),
    ('a worker lost more often than max_failures (rank 1 dies twice, max_failures=1)',
     'an error naming rank 1; no controller, worker or channel actor and no placement group left; the '
     'last committed checkpoint resumes',
     'tests/integration/test_failures.py (full tier)'),
    ('a worker process lost during a warm `evaluate()` (rank 1 exits at its first prediction step), '
     'max_failures=1',
     'Ray Train restarts the group; the new ranks find the command unanswered and run it again: the '
     'same loss as the trained weights give; the new group serves `predict()`',
     'tests/integration/test_warm_workers.py (full tier)'),
    ('Ctrl-C on the driver while `train()` runs on a live group',
     'KeyboardInterrupt reaches the caller; the run is aborted through its controller; its '
     'controller, workers and channel end; the next call starts a new group',
     'tests/integration/test_warm_workers.py (full tier)'),
    ('`close()` / the `with` block after train, evaluate, predict',
     "no controller, worker or channel actor and no placement group left (Ray's state API)",
     'tests/integration/test_warm_workers.py'),
    ('one worker slower than the others (rank 1 reads each batch 0.15 s slower)',
     "the driver names rank 1 and its node once (straggler warning); the run's result is unchanged",
     'tests/integration/test_ddp.py'),
    ('FSDP or ZeRO-3 fine-tuning from `model_init=lambda: from_pretrained(path)`, plain and with PEFT '
     'LoRA, 2 workers',
     "every rank starts from exactly the saved weights (LoRA B zero); FSDP's rank 1 builds a "
     'weightless skeleton (reads no tensor), ZeRO-3 loads partition-wise; the loss falls; LoRA moves '
     'the adapters only; under transformers 5.23.0 and 5.24.0',
     'tests/integration/test_from_pretrained.py'),
    ('PEFT LoRA under FSDP or ZeRO-3, 2 workers, a run resumed from its step-4 checkpoint',
     "the checkpoint holds PEFT's adapter files and no base weight, in the strategy's own files "
     "neither (ZeRO's engine state leaves the frozen base out, as transformers.Trainer saves it); it "
     "loads with `PeftModel.from_pretrained`; the resumed run ends on the uninterrupted run's "
     'weights, bit for bit',
     'tests/integration/test_from_pretrained.py'),
    ('PEFT LoRA on 2 workers: `load_best_model_at_end`, a search over `r` and `lora_alpha`, '
     '`push_to_hub`',
     "the driver's model holds the best checkpoint's adapter (the same logits as "
     "`PeftModel.from_pretrained` of it); each trial's checkpoint is an adapter of its trial's `r` "
     "and `lora_alpha`; every push holds the adapter's files and no whole model's weights",
     'tests/integration/test_lora.py'),
    ('a ZeRO-1/2 (or bf16) checkpoint of 1 worker resumed on 2 where an optimizer group is too small '
     'to reach rank 1 (a model whose only bias is one number)',
     "rank 1 takes the group's hyperparameters and no state (its share is padding); the run goes on "
     "along the uninterrupted run's loss curve, both ways, ZeRO stages 1, 2 and 3",
     'tests/integration/test_deepspeed.py (stages 1, 2 and 3)'),
    ("workers' prints and Ray's own output",
     "prints reach the console once with their rank; Ray's lines stay in its log folder",
     'tests/integration/test_failures.py'),
    ("a Ray Tune trial's actor SIGKILLed mid-search",
     "the trial fails; its worker group's placement group (its controller died with the actor) is removed "
     "while the next trial trains, not when the search ends; the search returns the trial that ended",
     'tests/integration/test_search.py'),
    ("20 faults in one run on the 3-node cluster: workers and raylets SIGKILLed, drained nodes, SIGTERM to "
     "every process of a node, a checkpoint write failing with ENOSPC, the driver SIGKILLed (the script "
     "run again after the last two)",
     "the uninterrupted run's final weights bit for bit, every checkpoint of the save schedule committed "
     "and whole, no actor, placement group, process or temporary file of the run left (tables below)",
     'tests/integration/test_chaos.py (full tier: DDP, FSDP, ZeRO-3, TRL SFT)'),
]


def run_case(name, make) -> dict:
    import ray

    with tempfile.TemporaryDirectory() as out:
        started = time.monotonic()
        error = None
        try:
            make(out)
        except (ValueError, TypeError, CheckpointError, RuntimeError, FileNotFoundError) as exc:
            error = exc
        seconds = time.monotonic() - started
    ray_started = ray.is_initialized()
    if ray_started:
        ray.shutdown()
    message = str(error).splitlines()[0] if error is not None else "(no error)"
    ok = error is not None and seconds < 5 and not ray_started
    return {"case": name, "error": type(error).__name__ if error else "-", "message": message,
            "seconds": seconds, "ray_started": ray_started, "ok": ok}


def chaos_section(results: list[dict], kept: str = "") -> list[str]:
    """bench/chaos.py's results, one table each: faults injected by kind, survived, steps redone, pauses.
    A host these results lack keeps its table from ``kept`` (the file's chaos section; each table dated)."""
    from chaos import HOSTS, problems
    from chaos import table as chaos_table

    lines = ["## Chaos run: many faults in one run (bench/chaos.py; tests/integration/test_chaos.py, full)",
             "", "One 2-worker run on a local 3-node cluster, faults at random steps from a seed, the script "
             "run again after the two that end it; held = the final weights equal an uninterrupted run's "
             "bit for bit, every checkpoint of the save schedule committed and whole, and no actor, "
             "placement group, process or temporary file of the run left after it."]
    blocks = {part.split("**", 1)[0]: "**" + part.rstrip("\n") for part in kept.split("\n**")[1:]}
    for r in results:
        broken = problems(r)
        verdict = "held." if not broken else "BROKEN: " + "; ".join(broken)
        blocks[r["host"]] = "\n".join([
            f"**{r['host']}**: {len(r['faults'])} faults over {r['steps']} steps "
            f"(seed {r['seed']}), {r['launches']} launches of the script, {r['chaos_s']:.0f} s against "
            f"{r['reference_s']:.0f} s uninterrupted; measured {r.get('date', '?')}: {verdict}", "",
            chaos_table(r)])
    for host in sorted(blocks, key=lambda h: (HOSTS.index(h) if h in HOSTS else len(HOSTS), h)):
        lines += ["", blocks[host]]
    return lines


def _kept_section(path: str | None, heading: str) -> str:
    """The section of ``path`` that starts with ``heading`` (up to the next ``## ``), or ''."""
    if not path or not os.path.exists(path):
        return ""
    with open(path) as f:
        old = f.read()
    if f"\n{heading}" not in old:
        return ""
    body = old.split(f"\n{heading}", 1)[1]
    return heading + body.split("\n## ", 1)[0].rstrip("\n") + "\n"


def table(rows: list[dict], machine: dict, soaked: dict | None = None) -> str:
    passed = sum(r["ok"] for r in rows)
    lines = [
        "# Reliability: bad input and fault scenarios",
        "",
        "Produced by `bench/reliability.py` (rerun it: `.venv/bin/python bench/reliability.py --soak 20 "
        "--write docs/reliability.md`).",
        f"Measured {machine['date']} on {machine['cpu']} ({machine['nproc']} CPUs), raytrainer "
        f"{machine.get('raytrainer_commit', '?')}.",
        "",
        f"## Bad input: {passed} of {len(rows)} cases refused on the driver within 5 s, nothing started",
        "",
        "Every case asks for a 2-worker run (`num_workers=2`): a case passes when the error names the value "
        "and the fix before Ray starts.",
        "",
        "| # | what the user did | error | seconds | Ray started | the message (first line) |",
        "|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(rows, 1):
        message = r["message"].replace("|", "\\|")
        if len(message) > 230:
            message = message[:227] + "..."
        lines.append(f"| {i} | {r['case']} | {r['error']} | {r['seconds']:.2f} | "
                     f"{'yes' if r['ray_started'] else 'no'} | {message} |")
    lines += ["", "## Fault scenarios (automated tests)", "", "| scenario | outcome | test |",
              "|---|---|---|"]
    for scenario, outcome, test in SCENARIOS:
        path, _, tier = test.partition(" (")
        lines.append(f"| {scenario} | {outcome} | `{path}`{' (' + tier if tier else ''} |")
    if soaked is not None:
        from soak import markdown

        lines += ["", *markdown(soaked)]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", help="write the markdown table to this file")
    parser.add_argument("--soak", type=int, default=0, metavar="N",
                        help="then N back-to-back runs on Ray, counting what each leaves (bench/soak.py)")
    parser.add_argument("--chaos", nargs="*", default=[], metavar="JSON",
                        help="bench/chaos.py --json results: the chaos section (else the file's is kept)")
    parser.add_argument("--keep-soak", action="store_true",
                        help="without --soak: keep the soak section of the file --write replaces (dated)")
    opts = parser.parse_args()
    rows = [run_case(name, make) for name, make in CASES]
    for r in rows:
        verdict = "ok " if r["ok"] else "BAD"
        print(f"{verdict} {r['seconds']:5.2f}s {r['case']}: {r['error']}: {r['message'][:150]}")
    soaked = None
    if opts.soak:  # after the bad-input cases, which need Ray not started
        from soak import soak

        soaked = soak(opts.soak)
    text = table(rows, machine_info(os.path.dirname(HERE)), soaked)
    if opts.keep_soak and soaked is None and opts.write and os.path.exists(opts.write):
        with open(opts.write) as f:
            old = f.read()
        heading, _, kept = old.partition("\n## Soak")[2].partition("\n")
        kept = kept.split("\n## ", 1)[0]  # the soak section only (the chaos section after it is its own)
        earlier = [line for line in kept.splitlines() if line.startswith("Kept from an earlier run")]
        if earlier:  # kept once already: its date stays the measuring run's
            when = earlier[0].split(". ", 1)[1]
            kept = kept.replace(f"\n{earlier[0]}\n", "", 1)
        else:
            when = next((line for line in old.splitlines() if line.startswith("Measured ")), "")
        if kept:  # the soak of an earlier run, said so with that run's date and commit
            text += f"\n## Soak{heading}\n\nKept from an earlier run of this script. {when}\n{kept}"
    chaos_kept = _kept_section(opts.write, "## Chaos run")
    if opts.chaos:
        import json

        results = []
        for path in opts.chaos:
            with open(path) as f:
                results.append(json.load(f))
        text += "\n" + "\n".join(chaos_section(results, chaos_kept)) + "\n"
    elif chaos_kept:
        text += "\n" + chaos_kept
    if opts.write:
        with open(opts.write, "w") as f:
            f.write(text)
    else:
        print(text)
    soak_ok = soaked is None or all(r["ok"] for r in soaked["report"].values())
    sys.exit(0 if all(r["ok"] for r in rows) and soak_ok else 1)


if __name__ == "__main__":
    main()
