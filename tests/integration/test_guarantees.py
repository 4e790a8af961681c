"""raytrainer's guarantees, for every host: raytrainer's own Trainer, ``on_ray(transformers.Trainer)``
(transformers' loop on each rank) and TRL's ``SFTTrainer`` (``raytrainer.trl``), each on 2 workers.

Each test is parametrized over the three hosts (``HOSTS``; ci_tier.py names the one CI runs, the others run in
the full tier); the same tiny GPT-2, made from a config and saved as a model folder (no dropout: runs on
different worker counts draw the same numbers), trains under each.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
import torch
from hosted_fixtures import (
    ZERO3,
    OneRankDecides,
    ShardReport,
    numbers_saved,
    order_sensitive_metrics,
    write_tiny_lm,
)

HOSTS = ["raytrainer", "transformers", "trl"]


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """The working directory of a script, with the model folder it names by relative path."""
    monkeypatch.chdir(tmp_path)
    write_tiny_lm("tiny-model", dropout=0.0)
    return tmp_path


def counting_rows(n: int, offset: int = 0) -> list[dict]:
    """Counting sequences of the tiny model's words (w7 w8 w9 ...): as token ids for a causal LM, and as
    text for TRL's SFTTrainer."""
    rows = []
    for i in range(offset, offset + n):
        start = (i * 7) % 60
        ids = torch.tensor([3 + (start + k) % 60 for k in range(12)])
        rows.append({"input_ids": ids, "attention_mask": torch.ones(12, dtype=torch.long), "labels": ids,
                     "text": " ".join(f"w{(start + k) % 60}" for k in range(12))})
    return rows


def make_trainer(host: str, output_dir: str, callbacks=(), eval_rows: int = 8, compute_metrics=None,
                 train_rows: int = 48, by_path: bool = False, lora: bool = False, **overrides):
    """A trainer of ``host`` on 2 workers: 6 steps of 2 x 2 rows, an evaluation every 2 steps, no saves
    unless a callback asks (``overrides`` replace any argument). The model is loaded on the driver and sent,
    or with ``by_path`` loaded on the workers: ``model_init`` calling ``from_pretrained`` (TRL's SFTTrainer
    loads the path it is given on the workers either way). With ``lora``, PEFT's LoRA (r=4) on the attention
    projection of the model loaded on the workers (TRL: its ``peft_config``)."""
    import datasets
    import transformers

    import raytrainer

    args = dict(output_dir=output_dir, num_workers=2, max_steps=6, per_device_train_batch_size=2,
                per_device_eval_batch_size=4, eval_strategy="steps", eval_steps=2, save_strategy="steps",
                save_steps=1000, logging_steps=1, learning_rate=1e-3, report_to="none", use_cpu=True,
                disable_tqdm=True)
    args.update(overrides)
    train, evaluation = counting_rows(train_rows), counting_rows(eval_rows, offset=100)
    if host == "trl":
        import raytrainer.trl as trl

        text = [{"text": r["text"]} for r in train], [{"text": r["text"]} for r in evaluation]
        peft = {}
        if lora:
            from peft import LoraConfig

            peft["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"])
        return trl.SFTTrainer(model="tiny-model", args=trl.SFTConfig(max_length=16, **args),
                              train_dataset=datasets.Dataset.from_list(text[0]),
                              eval_dataset=datasets.Dataset.from_list(text[1]), callbacks=list(callbacks),
                              compute_metrics=compute_metrics, **peft)
    if host == "transformers":
        trainer_cls = raytrainer.on_ray(transformers.Trainer)
        args_cls = raytrainer.config_on_ray(transformers.TrainingArguments)
    else:
        trainer_cls, args_cls = raytrainer.Trainer, raytrainer.TrainingArguments
    tokens = [[{k: v for k, v in r.items() if k != "text"} for r in rows] for rows in (train, evaluation)]
    if by_path or lora:
        from models import FromPretrained

        given = {"model_init": FromPretrained("tiny-model", lora=lora, targets=("c_attn",))}
    else:
        given = {"model": transformers.GPT2LMHeadModel.from_pretrained("tiny-model")}
    return trainer_cls(**given, args=args_cls(**args), train_dataset=tokens[0], eval_dataset=tokens[1],
                       callbacks=list(callbacks), compute_metrics=compute_metrics)


def end(trainer) -> None:
    trainer.end() if hasattr(trainer, "end") else trainer.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("host", HOSTS)
def test_a_flag_set_on_one_rank_is_every_ranks(workdir, host):
    """A save asked in on_evaluate on rank 0 only (step 2) and a stop asked in on_step_end on rank 1 only
    (step 3): both ranks save at step 2 (a collective: a save on one rank hung the other), the checkpoint is
    committed, and both ranks stop at step 3 (a stop on one rank left the other in the next step's
    all-reduce), as one process would."""
    trainer = make_trainer(host, str(workdir / "run"), callbacks=[OneRankDecides(save_at=2, stop_at=3)])
    try:
        out = trainer.train()
    finally:
        end(trainer)
    assert out.global_step == 3 and trainer.state.global_step == 3
    for rank in (0, 1):
        ended = json.loads((workdir / "run" / f"ended-rank{rank}.json").read_text())
        assert ended == {"saved": [2], "step": 3}, (rank, ended)
    assert (workdir / "run" / "checkpoint-2" / "manifest.json").exists()
    assert not (workdir / "run" / "checkpoint-3").exists()
    assert [h["step"] for h in trainer.state.log_history if "loss" in h] == [1, 2, 3]


def alive(pid: int, wait_s: float) -> bool:
    """Whether process ``pid`` is still there after at most ``wait_s`` seconds."""
    import time

    deadline = time.time() + wait_s
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        time.sleep(0.2)
    return True


def steps_by_group(folder) -> list[list[int]]:
    """The steps StepLog recorded in ``folder/steps``, one list per worker group (rank 0's process)."""
    lines = [line.split() for line in (folder / "steps").read_text().splitlines()]
    groups = list(dict.fromkeys(pid for pid, _ in lines))
    return [[int(s) for pid, s in lines if pid == g] for g in groups]


def assert_bitwise(plain: tuple, other: tuple, steps: int) -> None:
    """Two runs' (losses, weights): a loss at every step, and every loss and weight equal, bit for bit."""
    (plain_losses, plain_weights), (other_losses, other_weights) = plain, other
    assert sorted(other_losses) == list(range(1, steps + 1)) and other_losses == plain_losses
    assert sorted(other_weights) == sorted(plain_weights)
    for name, tensor in plain_weights.items():
        assert torch.equal(other_weights[name], tensor), name


def losses(trainer) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("host", HOSTS)
def test_a_resume_verifies_the_checkpoint_and_falls_back_past_a_damaged_one(workdir, host, caplog):
    """resume_from_checkpoint=True picks the latest committed checkpoint; its weights were damaged after the
    commit (same size: only the manifest's checksum can tell). The ranks refuse it before reading it, and
    the run resumes from the committed checkpoint before it, with a warning naming both, following the
    uninterrupted run's loss curve."""
    out = workdir / "run"
    first = make_trainer(host, str(out), save_steps=2)
    try:
        first.train()
    finally:
        end(first)
    uninterrupted = losses(first)
    assert sorted(uninterrupted) == [1, 2, 3, 4, 5, 6]
    for name in ("checkpoint-2", "checkpoint-4", "checkpoint-6"):
        assert (out / name / "manifest.json").exists(), name
    for path in sorted((out / "checkpoint-6").rglob("*"), reverse=True):  # as if the run stopped after 4
        path.unlink() if path.is_file() else path.rmdir()
    (out / "checkpoint-6").rmdir()
    weights = out / "checkpoint-4" / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-5] ^= 0xFF
    weights.write_bytes(bytes(raw))

    again = make_trainer(host, str(out), save_steps=2)
    try:
        with caplog.at_level("WARNING", logger="raytrainer"):
            again.train(resume_from_checkpoint=True)
    finally:
        end(again)
    assert f"{out}/checkpoint-4 is damaged" in caplog.text
    assert "model.safetensors does not match its manifest checksum" in caplog.text
    assert f"resuming from {out}/checkpoint-2" in caplog.text
    assert again.state.global_step == 6
    resumed = losses(again)
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6]  # steps 1-2 come from checkpoint-2's own history
    for step in (3, 4, 5, 6):
        assert resumed[step] == pytest.approx(uninterrupted[step], rel=1e-5), (step, resumed, uninterrupted)


@pytest.mark.timeout(400)
@pytest.mark.parametrize(("host", "strategy"), [
    (host, strategy) for strategy in ("ddp", "fsdp") for host in HOSTS])
def test_a_save_does_not_block_the_step_and_a_failed_write_fails_the_run_naming_it(workdir, host, strategy):
    """Rank 0's write of checkpoint-5's optimizer state (DDP: ``optimizer.pt``; FSDP saving sharded: its DCP
    shards) is held back 5 s and checkpoint-10's fails as a full disk does (ENOSPC): the step after the save
    goes on before checkpoint-5's files exist, the run fails naming checkpoint-10 and the error,
    checkpoint-5 alone is committed -- weights, optimizer, scheduler, trainer state, each rank's RNG state
    -- and a run resumes from it to the end."""
    from models import SlowThenFullDisk, train_into_the_full_disk

    common = dict(max_steps=12, save_steps=5, eval_strategy="no", max_failures=0)
    if strategy == "fsdp":
        common.update(fsdp="full_shard auto_wrap", fsdp_config={"state_dict_type": "SHARDED_STATE_DICT"},
                      bf16=False)
    out = workdir / "out"
    disk = SlowThenFullDisk(slow=5, full=10, writer="optimizer" if strategy == "ddp" else "dcp")
    trainer = make_trainer(host, str(out), callbacks=[disk], **common)
    try:
        files = train_into_the_full_disk(trainer, out)
    finally:
        end(trainer)
    # rng_state_<r>.pth (.safetensors from raytrainer's loop); FSDP's shards in DCP folders
    stems = {name.split("/")[0].split(".")[0] for name in files}
    saved = {"model", "optimizer"} if strategy == "ddp" else {"pytorch_model_fsdp_0", "optimizer_0"}
    assert saved | {"scheduler", "trainer_state", "rng_state_0", "rng_state_1"} <= stems, files
    again = make_trainer(host, str(workdir / "again"), **common)
    try:
        assert again.train(resume_from_checkpoint=str(out / "checkpoint-5")).global_step == 12
    finally:
        end(again)
    assert sorted(losses(again)) == list(range(1, 13))  # 1-5 from checkpoint-5's own history


@pytest.mark.timeout(300)
@pytest.mark.parametrize("host", HOSTS)
def test_evaluation_is_gathered_on_rank_zero_and_equals_one_process(workdir, host):
    """11 evaluation rows in batches of 2 on 2 workers: the last step's batch on rank 1 holds one row and one
    of padding (accelerate pads an uneven split with rows from the start, and cuts them after the
    gathering), so transformers' per-batch loss there is a mean over a row that one process never sees:
    raytrainer takes that batch's loss over its own rows. compute_metrics runs once, on rank 0, over every
    row in dataset order, and every metric (eval_loss included) equals the same trainer's in one process.
    transformers' loop all-gathered every batch onto every rank and ran compute_metrics on each."""
    metrics = {}
    for workers in (0, 2):
        trainer = make_trainer(host, str(workdir / f"run-{workers}"), num_workers=workers, eval_rows=11,
                               per_device_eval_batch_size=2, compute_metrics=order_sensitive_metrics)
        try:
            metrics[workers] = trainer.evaluate()
            if host != "trl":  # SFTTrainer tokenizes its own data sets; predict() takes one given ready
                prediction = trainer.predict(trainer.eval_dataset)
                assert prediction.predictions.shape[0] == 11
                metrics[workers]["predicted"] = prediction.predictions
        finally:
            end(trainer)
        assert sorted(p.name for p in workdir.glob("metrics-ran-on-rank*")) == ["metrics-ran-on-rank0"]
        assert len((workdir / "metrics-ran-on-rank0").read_text().split()) == (1 if host == "trl" else 2)
        (workdir / "metrics-ran-on-rank0").unlink()
    one, two = metrics[0], metrics[2]
    assert one["eval_rows"] == two["eval_rows"] == 11
    assert two["eval_ordered"] == one["eval_ordered"]
    for key in ("eval_logit_mean", "eval_loss"):
        assert two[key] == pytest.approx(one[key], rel=1e-5), (key, one, two)
    if host != "trl":
        np.testing.assert_allclose(two["predicted"], one["predicted"], rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("host", HOSTS)
def test_a_checkpoint_of_two_workers_resumes_on_one_along_the_uninterrupted_curve(workdir, host):
    """Saved on 2 workers x 2 rows, resumed on 1 worker x 4 (the same global batch) from step 2 of 6, with
    16 rows (4 steps an epoch: the resumed run crosses an epoch boundary): the losses of steps 3 to 6 are
    the uninterrupted run's -- the same rows in each step, the weights and optimizer state carried over."""
    full = make_trainer(host, str(workdir / "full"), train_rows=16, save_steps=2, eval_strategy="no")
    try:
        full.train()
    finally:
        end(full)
    one = make_trainer(host, str(workdir / "one"), train_rows=16, save_steps=2, eval_strategy="no",
                       num_workers=1, per_device_train_batch_size=4)
    try:
        one.train(resume_from_checkpoint=str(workdir / "full" / "checkpoint-2"))
    finally:
        end(one)
    uninterrupted, resumed = losses(full), losses(one)
    assert one.state.global_step == 6 and sorted(resumed) == [1, 2, 3, 4, 5, 6]
    for step in (3, 4, 5, 6):
        assert resumed[step] == pytest.approx(uninterrupted[step], rel=1e-4), (step, resumed, uninterrupted)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("host", HOSTS)
def test_a_preemption_notice_saves_commits_and_the_restart_resumes_there(workdir, host, capfd):
    """Ray's preemption notice reaches rank 1 at step 3 (deadline 3 s): every rank saves checkpoint-4 (the
    ranks agree one check behind), the hold says it is committed only once the manifest is written, no
    rank steps until Ray Train restarts the group at the deadline (max_failures=0 is not spent), and the
    restart resumes from checkpoint-4: no step trained twice, the loss curve the uninterrupted run's."""
    from models import PreemptionNoticeAt, StepLog

    common = dict(max_steps=8, save_strategy="no", eval_strategy="no", max_failures=0)
    plain = make_trainer(host, str(workdir / "plain"), **common)
    try:
        plain.train()
    finally:
        end(plain)
    trainer = make_trainer(host, str(workdir / "out"), **common,
                           callbacks=[PreemptionNoticeAt(rank=1, step=3, deadline_s=3.0), StepLog()])
    capfd.readouterr()
    try:
        assert trainer.train().global_step == 8
    finally:
        end(trainer)
    console = "".join(capfd.readouterr())
    assert sorted(p.name for p in (workdir / "out").glob("checkpoint-*")) == ["checkpoint-4"]
    assert json.loads((workdir / "out" / "checkpoint-4" / "manifest.json").read_text())["global_step"] == 4
    assert "checkpoint-4 is committed; no step until the node goes" in console
    assert "restart 1: Ray Train started the worker group again" in console
    assert steps_by_group(workdir / "out") == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert losses(trainer) == pytest.approx(losses(plain), rel=1e-6)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("host", HOSTS)
def test_a_sigterm_to_a_workers_process_saves_commits_and_the_restart_ends_bitwise(workdir, host, capfd):
    """max_failures=1: rank 1's process is sent SIGTERM as step 5 of 12 begins (a scheduler ending the
    job). Every rank saves checkpoint-6 (the ranks agree one check behind), commits it and stops; Ray Train
    starts the group again, which resumes there (no step trained twice), the signalled process is gone, and
    the run ends with the losses and every weight of an uninterrupted run, bit for bit (CPU, no dropout)."""
    from models import SigtermOnceOnRank, StepLog

    # enable_jit_checkpoint: transformers' own SIGTERM handling, replaced on the workers by raytrainer's
    common = dict(max_steps=12, save_strategy="no", eval_strategy="no", max_failures=1,
                  enable_jit_checkpoint=True)
    runs = {}
    for name, callbacks in (("plain", []), ("signalled", [SigtermOnceOnRank(step=5, rank=1), StepLog()])):
        trainer = make_trainer(host, str(workdir / name), callbacks=callbacks, **common)
        capfd.readouterr()
        try:
            assert trainer.train().global_step == 12
            runs[name] = (losses(trainer), {k: v.clone() for k, v in trainer.model.state_dict().items()})
        finally:
            end(trainer)
    console = "".join(capfd.readouterr())
    out = workdir / "signalled"
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-6"]
    assert json.loads((out / "checkpoint-6" / "manifest.json").read_text())["global_step"] == 6
    assert "rank 1's process received a SIGTERM: every rank saves a checkpoint at step 6" in console
    assert "restart 1: Ray Train started the worker group again" in console
    # the start said, and a worker's library noise kept off the console: transformers' "Writing model
    # shards" bar at the save, DeepSpeed's accelerator warning when that save first imports it
    assert "raytrainer: starting 2 worker(s) on Ray Train (DDP)" in console and "workers up in" in console
    assert "Writing model shards" not in console and "Setting accelerator" not in console, console
    assert steps_by_group(out) == [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]]
    assert not alive(int((out / "sigterm").read_text()), wait_s=15)  # the signalled process ended
    assert_bitwise(runs["plain"], runs["signalled"], steps=12)


@pytest.mark.timeout(400)
def test_a_sigterm_with_no_failures_left_stops_at_a_committed_checkpoint_the_next_run_resumes(workdir):
    """max_failures=0 (TRL's SFTTrainer): the SIGTERM's checkpoint is committed on every rank, then train()
    raises failures.Terminated naming it, with the fix; the next run resumes there and ends with every
    weight of an uninterrupted run, bit for bit."""
    from models import SigtermOnceOnRank, StepLog

    from raytrainer.failures import Terminated

    common = dict(max_steps=12, save_strategy="no", eval_strategy="no", max_failures=0)
    plain = make_trainer("trl", str(workdir / "plain"), **common)
    try:
        plain.train()
        weights = {k: v.clone() for k, v in plain.model.state_dict().items()}
    finally:
        end(plain)
    out = workdir / "out"
    stopped = make_trainer("trl", str(out), callbacks=[SigtermOnceOnRank(step=5, rank=1)], **common)
    try:
        with pytest.raises(Terminated, match=r"rank 1's process received a SIGTERM: every rank saved "
                                             r"checkpoint-6, committed it.*resume_from_checkpoint=True"):
            stopped.train()
    finally:
        end(stopped)
    assert json.loads((out / "checkpoint-6" / "manifest.json").read_text())["global_step"] == 6
    resumed = make_trainer("trl", str(out), callbacks=[StepLog()], **common)
    try:
        assert resumed.train(resume_from_checkpoint=True).global_step == 12
        assert steps_by_group(out) == [[7, 8, 9, 10, 11, 12]]
        for name, tensor in weights.items():
            assert torch.equal(resumed.model.state_dict()[name], tensor), name
    finally:
        end(resumed)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("host", HOSTS)
def test_a_lost_worker_is_replaced_and_the_run_ends_bitwise_where_an_uninterrupted_one_ends(workdir, host):
    """max_failures=1: rank 1's process dies at the end of step 5; Ray Train starts the group again, which
    resumes from the latest committed checkpoint (not from the start): the losses and every final weight
    equal the uninterrupted run's bit for bit (CPU, no dropout)."""
    from models import DieOnceOnRank, StepLog

    common = dict(max_steps=8, save_steps=2, eval_strategy="no", max_failures=1)
    runs = {}
    for name, callbacks in (("plain", []), ("lost", [DieOnceOnRank(step=5, rank=1), StepLog()])):
        trainer = make_trainer(host, str(workdir / name), callbacks=callbacks, **common)
        try:
            trainer.train()
            runs[name] = (losses(trainer), {k: v.clone() for k, v in trainer.model.state_dict().items()})
        finally:
            end(trainer)
    assert (workdir / "lost" / "died").exists()  # the worker did die
    # the new group resumed from the latest committed checkpoint: 4, or 2 while 4's commit was in flight
    # (raytrainer's loop commits a save in the step after it, where rank 1 died)
    assert steps_by_group(workdir / "lost")[-1] in ([5, 6, 7, 8], [3, 4, 5, 6, 7, 8])
    assert_bitwise(runs["plain"], runs["lost"], steps=8)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("host", HOSTS)
def test_a_collected_trainers_workers_serve_the_next_trainer_of_its_shape(workdir, host):
    """A notebook's cell run again, a script's second trainer: the first trainer is garbage collected, and
    the next one of the same shape trains on its worker group (the same worker processes, no start-up),
    from a clean slate: the same losses, bitwise, as the first run of the same arguments."""
    import gc

    from models import RecordPid

    first = make_trainer(host, str(workdir / "first"), callbacks=[RecordPid()], eval_strategy="no")
    try:
        first.train()
    except BaseException:
        end(first)
        raise
    group, first_losses = vars(first)["_group"], losses(first)
    del first
    gc.collect()
    second = make_trainer(host, str(workdir / "second"), callbacks=[RecordPid()], eval_strategy="no")
    try:
        assert group.alive and group.owner is None  # idle, for the next trainer of its shape
        second.train()
        assert vars(second)["_group"] is group
        for rank in (0, 1):
            pid = (workdir / "second" / f"pid-rank{rank}").read_text()
            assert pid == (workdir / "first" / f"pid-rank{rank}").read_text(), rank  # the same workers
        assert sorted(losses(second)) == [1, 2, 3, 4, 5, 6]
        assert losses(second) == first_losses
    finally:
        end(second)
        group.close()


def _owner(name: str) -> int | None:
    """The rank a checkpoint file is one rank's own for (its RNG state, a DCP shard, a ZeRO partition)."""
    found = re.search(r"(?:rng_state_|__|zero_pp_rank_)(\d+)[._]", name.rsplit("/", 1)[-1])
    return int(found.group(1)) if found else None


@pytest.mark.timeout(500)
@pytest.mark.parametrize("host", HOSTS)
def test_a_resume_from_a_bucket_reads_each_ranks_share(workdir, host, s3_bucket):
    """FSDP on 2 CPU workers saving sharded (``SHARDED_STATE_DICT``), committed to an S3 bucket; a new trainer
    resumes from the bucket's checkpoint-4 along the uninterrupted curve. Each rank's reads, counted at the
    server by process: the files that are its own (its RNG state, its model and optimizer shards) once,
    whole; of the other rank's own files at most ranged slices; the files every rank reads at most once. (Both
    workers share a node here, so a hosted rank finds the other's shards in the node's copy; ranged reads
    of another node's shards: tests/unit/test_hosted_resume.py.)"""
    from models import RecordPid

    sharded = dict(fsdp="full_shard auto_wrap", fsdp_config={"state_dict_type": "SHARDED_STATE_DICT"},
                   bf16=False, eval_strategy="no")
    uri = f"{s3_bucket.uri}/runs/{host}"
    full = make_trainer(host, str(workdir / "full"), save_steps=4, storage_path=uri, **sharded)
    try:
        full.train()
    finally:
        end(full)
    uninterrupted = losses(full)
    # committed to the bucket: the node keeps no copy of its own (worker/hosted_commit.py)
    assert not list((workdir / "full").glob("checkpoint-*"))
    files = s3_bucket.committed(f"runs/{host}")["checkpoint-4"]["files"]
    owners = {name: _owner(name) for name in files}
    assert {owners[n] for n in files if n.endswith(".distcp")} == {0, 1}, sorted(files)  # really sharded

    s3_bucket.server.clear_requests()
    again = make_trainer(host, str(workdir / "again"), save_strategy="no", callbacks=[RecordPid()], **sharded)
    try:
        again.train(resume_from_checkpoint=f"{uri}/checkpoint-4")
    finally:
        end(again)
    resumed = losses(again)
    assert again.state.global_step == 6
    for step in (5, 6):
        assert resumed[step] == pytest.approx(uninterrupted[step], rel=1e-5), (step, resumed, uninterrupted)

    pids = {int((workdir / "again" / f"pid-rank{r}").read_text()): r for r in (0, 1)}
    prefix = f"runs/{host}/checkpoint-4/"
    reads = {0: {}, 1: {}}
    for req in s3_bucket.server.requests():
        if req["method"] == "GET" and req["pid"] in pids and (req["key"] or "").startswith(prefix):
            got = reads[pids[req["pid"]]]
            got[req["key"][len(prefix):]] = got.get(req["key"][len(prefix):], 0) + req["bytes_out"]
    total = sum(meta["size"] for meta in files.values())
    for rank in (0, 1):  # the figures docs/architecture.md quotes
        print(f"{host} resume from S3, rank {rank}: {sum(reads[rank].values())} of {total} bytes, by file: "
              f"{reads[rank]}")
    for rank, other in ((0, 1), (1, 0)):
        for name, meta in files.items():
            if owners[name] == rank:
                assert reads[rank].get(name, 0) == meta["size"], (rank, name, reads[rank])  # once, whole
            elif owners[name] == other:
                # slices (entries DCP stored once for both ranks, in either rank's file), never it all
                assert reads[rank].get(name, 0) < meta["size"] / 2, (rank, name, reads[rank])
            else:  # a file every rank reads (the trainer state, DCP's metadata): at most once
                assert reads[rank].get(name, 0) <= meta["size"], (rank, name, reads[rank])


SHARDED = {"fsdp": {"fsdp": "full_shard auto_wrap"}, "zero3": {"deepspeed": ZERO3}}


@pytest.mark.timeout(500)
@pytest.mark.parametrize(("host", "strategy"), [
    (host, strategy) for strategy in ("fsdp", "zero3") for host in HOSTS])
def test_a_sharded_strategy_shards_on_cpu_workers_trains_as_ddp_and_resumes(workdir, host, strategy):
    """FSDP (``fsdp="full_shard auto_wrap"``) or ZeRO-3 (a DeepSpeed config) on 2 CPU workers: each rank
    holds its half of the weights (for transformers' loop under FSDP, accelerate alone wrapped a CPU group
    in DDP, every rank holding everything); the losses and the final weights the driver gets are DDP's; a
    committed checkpoint of the sharded run resumes along the same curve. In float32 (bf16=False: TRL's
    default is bf16, which under FSDP computes with bf16 weights, accelerate's mixed-precision policy, and
    under DDP only autocasts, so the two differ)."""
    common = dict(save_steps=2, eval_strategy="no", bf16=False)
    sharded = dict(SHARDED[strategy], callbacks=[ShardReport()])
    runs = {}
    for name, extra in (("ddp", {}), ("sharded", sharded)):
        trainer = make_trainer(host, str(workdir / name), **common, **extra)
        try:
            trainer.train()
            runs[name] = (losses(trainer), {k: v.clone() for k, v in trainer.model.state_dict().items()})
        finally:
            end(trainer)
    reports = [json.loads((workdir / "sharded" / f"shard-rank{r}.json").read_text()) for r in (0, 1)]
    whole = reports[0]["whole"]
    for report in reports:
        assert report["sharded"] and report["whole"] == whole, reports
        assert report["held"] <= whole // 2 + 256, reports  # its half (splits padded to equal size)
    (ddp_losses, ddp_weights), (sharded_losses, sharded_weights) = runs["ddp"], runs["sharded"]
    assert sorted(sharded_losses) == [1, 2, 3, 4, 5, 6]
    assert sharded_losses == pytest.approx(ddp_losses, rel=1e-5)
    assert sorted(sharded_weights) == sorted(ddp_weights)
    for name, tensor in ddp_weights.items():
        torch.testing.assert_close(sharded_weights[name], tensor, rtol=1e-4, atol=1e-5)
    assert (workdir / "sharded" / "checkpoint-4" / "manifest.json").exists()

    again = make_trainer(host, str(workdir / "sharded"), **common, **sharded)
    try:
        again.train(resume_from_checkpoint=str(workdir / "sharded" / "checkpoint-4"))
    finally:
        end(again)
    resumed = losses(again)
    assert again.state.global_step == 6 and sorted(resumed) == [1, 2, 3, 4, 5, 6]
    for step in (5, 6):
        assert resumed[step] == pytest.approx(sharded_losses[step], rel=1e-5), (step, resumed, sharded_losses)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("host", HOSTS)
def test_under_fsdp_each_rank_reads_only_its_shards_of_a_pretrained_model(workdir, host, capfd):
    """FSDP on 2 workers, the model loaded on the workers by path (``model_init`` with ``from_pretrained``;
    TRL's ``model="tiny-model"``): each rank builds a skeleton and reads only its shards' bytes from the
    safetensors file, never the whole model, and starts from exactly the pretrained weights; then trains."""
    from models import ReportStartingWeights

    trainer = make_trainer(host, str(workdir / "out"), by_path=True, fsdp="full_shard auto_wrap", bf16=False,
                           eval_strategy="no", save_strategy="no", log_level="info",
                           log_level_replica="info", callbacks=[ReportStartingWeights("tiny-model")])
    capfd.readouterr()
    try:
        assert trainer.train().global_step == 6
        trained = losses(trainer)
    finally:
        end(trainer)
    console = "".join(capfd.readouterr())
    read = {int(r): (int(n), int(total)) for r, n, total in re.findall(
        r"\[rank(\d)\].*read (\d+) bytes of this rank's shards of the pretrained weights from the files "
        r"\(the whole weights: (\d+) bytes\)", console)}
    assert sorted(read) == [0, 1], console[-3000:]
    for n, total in read.values():
        assert 0.4 * total < n < 0.6 * total, read  # its half of the weights' bytes, not the whole
    starts = {int(r): (float(d), int(c), int(h), int(f)) for r, d, c, h, f in re.findall(
        r"rank (\d): built_on=\w+ start_diff=(\S+) compared=(\d+) lora_b_max=\S+ held=(\d+) full=(\d+)",
        console)}
    assert sorted(starts) == [0, 1], console[-3000:]
    for diff, compared, held, full in starts.values():
        assert diff == 0.0 and compared > 0 and held < 0.6 * full, starts  # the files' weights, a half each
    assert sorted(trained) == [1, 2, 3, 4, 5, 6] and trained[6] < trained[1], trained


@pytest.mark.timeout(500)
@pytest.mark.parametrize(("host", "strategy"), [
    (host, strategy) for strategy in ("fsdp", "zero3") for host in HOSTS])
def test_lora_under_a_sharded_strategy_checkpoints_the_adapter_only_and_resumes_bitwise(workdir, host,
                                                                                      strategy):
    """PEFT's LoRA on the tiny GPT-2 loaded on the workers, the frozen base sharded by FSDP or partitioned by
    ZeRO-3 on 2 workers: each checkpoint's model is the adapter alone (PEFT's files, loadable with
    ``PeftModel.from_pretrained``; no file, the strategy's own included, holds the base weights), and a run
    resumed from the step-4 checkpoint ends with the uninterrupted run's weights, bit for bit."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    common = dict(lora=True, save_steps=4, eval_strategy="no", bf16=False, learning_rate=5e-2,
                  **SHARDED[strategy])

    def run(name, resume=None):
        trainer = make_trainer(host, str(workdir / name), **common)
        try:
            trainer.train(resume_from_checkpoint=resume)
            if resume is None:  # the model saved at the end: the adapter alone, as in each checkpoint
                trainer.save_model(str(workdir / "final"))
            return losses(trainer), {k: v.clone() for k, v in trainer.model.state_dict().items()}
        finally:
            end(trainer)

    full_losses, full = run("full")
    final = {p.name for p in (workdir / "final").iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json"} <= final, final
    assert not final & {"model.safetensors", "pytorch_model.bin"}, final
    assert sorted(full_losses) == [1, 2, 3, 4, 5, 6]
    checkpoint = workdir / "full" / "checkpoint-4"
    files = {p.name for p in checkpoint.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "manifest.json"} <= files, files
    # the adapter once: no FSDP resume file of it beside PEFT's (worker/hosted_adapter.py)
    assert not files & {"model.safetensors", "pytorch_model.bin"}, files
    assert not any(f.startswith("pytorch_model_fsdp") for f in files), files
    adapter = load_file(str(checkpoint / "adapter_model.safetensors"))
    assert adapter and all(".lora_" in k for k in adapter), sorted(adapter)
    # nor the strategy's own files (FSDP's optimizer shards, ZeRO's engine state): the adapter's numbers,
    # Adam's 2 moments of them, ZeRO's fp32 master copy, a step counter per tensor; the base has 29x more,
    # its tied embedding 2x (which torch's filter of frozen weights missed:
    # worker/hosted_saves._no_frozen_aliases)
    adapter_numel = sum(t.numel() for t in adapter.values())
    assert numbers_saved(checkpoint) <= 4 * adapter_numel + len(adapter), numbers_saved(checkpoint)
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("tiny-model"), str(checkpoint))
    assert any(p.abs().max() > 0 for n, p in loaded.named_parameters() if "lora_B" in n)  # B starts at 0

    resumed_losses, resumed = run("resumed", resume=str(checkpoint))
    assert sorted(resumed_losses) == [1, 2, 3, 4, 5, 6]
    assert [resumed_losses[s] for s in (5, 6)] == [full_losses[s] for s in (5, 6)]
    assert resumed.keys() == full.keys() and any("lora_B" in k for k in full)
    for name, tensor in full.items():
        assert torch.equal(resumed[name], tensor), name
