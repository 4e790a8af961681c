"""Hub pushes from the driver, in-process (num_workers=0): a real file:// repository for every
hub_strategy, the Hugging Face path at the HfApi call boundary (the network calls replaced, nothing
else), the skip / queue rules of the background pusher, failed pushes, the model card and token hygiene."""

from __future__ import annotations

import json
import logging
import os
import threading
import types

import pytest
import torch
from safetensors.torch import load_file
from transformers.modelcard import TrainingSummary

from raytrainer import Trainer
from raytrainer.hosted_recipe import Recipe
from raytrainer.hub import FilesystemTarget, HubPusher
from raytrainer.hub.model_card import _as_transformers_sees_it
from raytrainer.protocol import CheckpointCommitted

TOKEN = "hf_unit_secret_token_9f8e7d"


def _trainer(make_args, make_classifier, make_examples, max_steps=8, model_seed=0, **overrides):
    train, _, _ = make_examples(64)
    evaluation, _, _ = make_examples(16, seed=1)
    kwargs = dict(per_device_train_batch_size=8, max_steps=max_steps, save_strategy="steps", save_steps=4,
                  logging_steps=2, learning_rate=0.1, eval_strategy="steps", eval_steps=4, push_to_hub=True,
                  hub_always_push=True)
    kwargs.update(overrides)
    return Trainer(model=make_classifier(seed=model_seed), args=make_args(**kwargs), train_dataset=train,
                   eval_dataset=evaluation)


def _files(folder) -> set[str]:
    return {os.path.relpath(os.path.join(r, n), folder) for r, _, ns in os.walk(folder) for n in ns}


def _assert_weights(path, model):
    loaded = load_file(path)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded[name], tensor), name


def test_every_save_pushes_model_files_at_each_committed_checkpoint(tmp_path, make_args, make_classifier,
                                                                     make_examples):
    repo = tmp_path / "hub" / "tiny"
    trainer = _trainer(make_args, make_classifier, make_examples, hub_model_id=f"file://{repo}",
                       hub_strategy="every_save")
    trainer.train()
    pushed = _files(repo / "main")
    assert pushed == {"model.safetensors", "training_args.bin", "training_args.json"}  # no training state:
    assert not pushed & {"optimizer.pt", "scheduler.pt", "rng_state_0.safetensors", "trainer_state.json",
                         "manifest.json"}
    for name in pushed:  # the checkpoint's own bytes
        assert (repo / "main" / name).read_bytes() == (tmp_path / "checkpoint-8" / name).read_bytes(), name
    _assert_weights(repo / "main" / "model.safetensors", trainer.model)  # step 8 = the final model
    commits = FilesystemTarget(f"file://{repo}").commits()
    assert [c["message"] for c in commits] == ["Training in progress, step 4", "Training in progress, step 8"]
    assert {c["revision"] for c in commits} == {"main"}


# A checkpoint with every kind of file: a sharded model with its index, a PEFT adapter, its generation
# config, the training arguments; optimizer / scheduler / RNG / trainer state, a DCP optimizer folder,
# DeepSpeed's global_step folder with its `latest` and conversion script, a shard no index names.
_MODEL = {"config.json": b'{"model_type": "tiny"}', "generation_config.json": b"{}",
          "model-00001-of-00002.safetensors": b"shard one" * 1000, "model-00002-of-00002.safetensors": b"two",
          "model.safetensors.index.json": json.dumps({"metadata": {}, "weight_map": {
              "a.weight": "model-00001-of-00002.safetensors", "b.weight": "model-00002-of-00002.safetensors",
              "c.weight": "model-00001-of-00002.safetensors"}}).encode(),
          "adapter_config.json": b'{"r": 8}', "adapter_model.safetensors": b"adapter",
          "training_args.json": b'{"hub_token": "<HUB_TOKEN>"}'}
_STATE = {"optimizer.pt": b"adam" * 1000, "scheduler.pt": b"sched", "scaler.pt": b"scale",
          "rng_state_0.safetensors": b"rng0", "rng_state_1.safetensors": b"rng1",
          "trainer_state.json": b'{"global_step": 8, "epoch": 2.0}', "optimizer_0/__0_0.distcp": b"dcp",
          "optimizer_0/.metadata": b"meta", "global_step8/zero_pp_rank_0_mp_rank_00_optim_states.pt": b"zero",
          "latest": b"global_step8", "zero_to_fp32.py": b"print()", "manifest.json": b"{}",
          "model-00003-of-00003.safetensors": b"old"}


class _Tokenizer:
    def save_pretrained(self, folder):
        with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
            f.write('{"model_max_length": 16}')


@pytest.mark.parametrize("strategy", ["every_save", "checkpoint"])
def test_a_checkpoint_push_streams_the_model_files_only(tmp_path, make_args, monkeypatch, strategy):
    """What transformers' _push_from_checkpoint copies, streamed from the storage (file://, so through
    pyarrow) to the staging folder: no optimizer or other training state is read for the model's push, and
    no file is read whole into memory but the shards' index and trainer_state.json (an epoch's commit
    message). The checkpoint push (hub_strategy="checkpoint") is the whole folder, downloaded once."""
    from types import SimpleNamespace

    from raytrainer.storage import Storage

    checkpoint = tmp_path / "run" / "checkpoint-8"
    for rel, body in {**_MODEL, **_STATE}.items():
        (checkpoint / rel).parent.mkdir(parents=True, exist_ok=True)
        (checkpoint / rel).write_bytes(body)
    downloads, whole_reads = [], []
    monkeypatch.setattr(Storage, "download", _spy(Storage.download, downloads))
    monkeypatch.setattr(Storage, "download_dir", _spy(Storage.download_dir, downloads))
    monkeypatch.setattr(Storage, "read_bytes", _spy(Storage.read_bytes, whole_reads))
    repo = tmp_path / "hub"
    args = make_args(push_to_hub=True, hub_strategy=strategy, save_strategy="epoch")
    trainer = SimpleNamespace(processing_class=_Tokenizer())
    pusher = HubPusher(FilesystemTarget(f"file://{repo}"), args, trainer)
    pusher.submit("checkpoint-8", pusher._push_checkpoint,
                  CheckpointCommitted("checkpoint-8", 8, f"file://{checkpoint}")).result()

    pushed = _files(repo / "main") - {os.path.join("last-checkpoint", f) for f in [*_MODEL, *_STATE]}
    assert pushed == {*_MODEL, "tokenizer_config.json"}
    assert not pushed & {"optimizer.pt", "scheduler.pt", "rng_state_0.safetensors", "trainer_state.json",
                         "latest", "zero_to_fp32.py", "model-00003-of-00003.safetensors", "manifest.json"}
    assert not any(p.startswith(("optimizer_0", "global_step8")) for p in pushed)
    for rel, body in _MODEL.items():
        assert (repo / "main" / rel).read_bytes() == body, rel
    message = "Training in progress, epoch 2"
    if strategy == "every_save":
        # only the model's files left the storage, one streamed copy each
        assert sorted(downloads) == sorted(f"{checkpoint}/{rel}" for rel in _MODEL)
        assert [c["message"] for c in FilesystemTarget(f"file://{repo}").commits()] == [message]
    else:  # the whole checkpoint once; the model's files then come from that local copy
        assert [d for d in downloads if d.startswith(str(tmp_path))] == [str(checkpoint)]
        for rel, body in {**_MODEL, **_STATE}.items():
            assert (repo / "main" / "last-checkpoint" / rel).read_bytes() == body, rel
        assert [c["message"] for c in FilesystemTarget(f"file://{repo}").commits()] == [
            message, message + ", checkpoint"]
    assert {os.path.basename(p) for p in whole_reads} <= {"model.safetensors.index.json",
                                                          "trainer_state.json", "commits.json"}


def _spy(method, calls: list):
    def spy(storage, path, *rest):
        calls.append(path)
        return method(storage, path, *rest)

    return spy


def test_a_push_from_a_bucket_never_fetches_the_optimizer_state(tmp_path, make_args, make_classifier,
                                                               make_examples, s3_bucket):
    """Checkpoints in a bucket, pushed every save: the bucket serves the model's files and nothing else."""
    repo = tmp_path / "hub" / "tiny"
    trainer = _trainer(make_args, make_classifier, make_examples, hub_model_id=f"file://{repo}",
                       hub_strategy="every_save", storage_path=f"{s3_bucket.uri}/run")
    trainer.train()
    fetched = {r["key"].split("/", 1)[1] for r in s3_bucket.server.requests()
               if r["method"] == "GET" and (r["key"] or "").startswith("run/checkpoint-")}
    assert fetched == {f"checkpoint-{step}/{name}" for step in (4, 8)
                       for name in ("model.safetensors", "training_args.bin", "training_args.json")}
    # the bucket's bytes, as they were
    for name in ("model.safetensors", "training_args.bin", "training_args.json"):
        assert (repo / "main" / name).read_bytes() == s3_bucket.get_object(f"run/checkpoint-8/{name}"), name
    assert s3_bucket.list_objects("run/checkpoint-8/optimizer.pt")  # it was there to fetch


def test_checkpoint_strategy_keeps_a_resumable_last_checkpoint(tmp_path, make_args, make_classifier,
                                                              make_examples, weights):
    repo = tmp_path / "hub" / "tiny"
    first = _trainer(make_args, make_classifier, make_examples, hub_model_id=f"file://{repo}",
                     hub_strategy="checkpoint", lr_scheduler_type="constant")
    first.train()
    last = repo / "main" / "last-checkpoint"
    assert {"manifest.json", "optimizer.pt", "trainer_state.json", "model.safetensors"} <= _files(last)
    assert json.loads((last / "trainer_state.json").read_text())["global_step"] == 8
    messages = [c["message"] for c in FilesystemTarget(f"file://{repo}").commits()]
    assert messages[-1] == "Training in progress, step 8, checkpoint"

    # Resume from the hub's last-checkpoint (a file:// URI) to step 12, in another output_dir, from other
    # initial weights (replaced by the checkpoint's): bitwise the weights of an uninterrupted 12-step run.
    resumed = _trainer(make_args, make_classifier, make_examples, max_steps=12, push_to_hub=False,
                       model_seed=7, output_dir=str(tmp_path / "resumed"), lr_scheduler_type="constant")
    resumed.train(resume_from_checkpoint=f"file://{last}")
    straight = _trainer(make_args, make_classifier, make_examples, max_steps=12, push_to_hub=False,
                        output_dir=str(tmp_path / "straight"), lr_scheduler_type="constant")
    straight.train()
    assert resumed.state.global_step == 12
    weights.assert_same(weights.copy(resumed.model), weights.copy(straight.model))


def test_all_checkpoints_on_a_revision(tmp_path, make_args, make_classifier, make_examples, monkeypatch):
    """checkpoint-4's push is held until checkpoint-8 is saved: rotation (``save_total_limit=1``) must not
    delete the folder it reads meanwhile."""
    from transformers import TrainerCallback

    from raytrainer.hub import staging

    saved_8 = threading.Event()
    whole = staging.local_checkpoint

    def held(storage, dest):
        if os.path.basename(storage.root) == "checkpoint-4":
            assert saved_8.wait(120)
        return whole(storage, dest)

    class Saved(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            if state.global_step == 8:
                saved_8.set()

    monkeypatch.setattr(staging, "local_checkpoint", held)
    repo = tmp_path / "hub" / "tiny"
    trainer = _trainer(make_args, make_classifier, make_examples, hub_model_id=f"file://{repo}",
                       hub_strategy="all_checkpoints", hub_revision="v1", save_total_limit=1)
    trainer.add_callback(Saved())
    trainer.train()
    assert saved_8.is_set()
    assert sorted(os.listdir(repo)) == ["commits.json", "v1"]
    assert {"checkpoint-4", "checkpoint-8", "model.safetensors"} <= set(os.listdir(repo / "v1"))
    for name in ("checkpoint-4", "checkpoint-8"):
        assert "manifest.json" in os.listdir(repo / "v1" / name)
    # rotation (save_total_limit=1) deleted checkpoint-4 locally only after its push had finished
    assert sorted(p for p in os.listdir(tmp_path) if p.startswith("checkpoint-")) == ["checkpoint-8"]


def test_push_to_hub_writes_the_model_card_and_the_final_model(tmp_path, make_args, make_classifier,
                                                              make_examples):
    repo = tmp_path / "hub" / "tiny"
    trainer = _trainer(make_args, make_classifier, make_examples, hub_model_id=f"file://{repo}",
                       hub_strategy="end")
    trainer.train()
    assert not repo.joinpath("main").exists()  # hub_strategy="end": nothing pushed during training
    result = trainer.push_to_hub(license="apache-2.0")
    assert result == f"file://{repo}/main"
    pushed = _files(repo / "main")
    assert {"README.md", "model.safetensors", "training_args.json"} <= pushed
    assert not any(p.startswith(("checkpoint-", "logs")) for p in pushed)
    _assert_weights(repo / "main" / "model.safetensors", trainer.model)
    card = (repo / "main" / "README.md").read_text()
    assert card == _transformers_card(trainer, license="apache-2.0", model_name="tiny")
    assert "license: apache-2.0" in card and "# tiny" in card
    assert "- learning_rate: 0.1" in card and "- training_steps: 8" in card
    final_eval = [e for e in trainer.state.log_history if "eval_loss" in e][-1]["eval_loss"]
    assert f"- Loss: {final_eval:.4f}" in card  # the final metrics
    assert "| Training Loss | Epoch | Step | Validation Loss |" in card
    assert card.count("\n| ") == 1 + 2  # the header and one row per evaluation (steps 4 and 8)
    assert FilesystemTarget(f"file://{repo}").commits()[-1]["message"] == "End of training"


def _transformers_card(trainer, **kwargs) -> str:
    """What transformers' ``TrainingSummary.from_trainer`` writes for this run."""
    return TrainingSummary.from_trainer(_as_transformers_sees_it(trainer), **kwargs).to_model_card()


class _GatedTarget(FilesystemTarget):
    """A real filesystem target whose uploads wait for a gate: a push that is 'still running'."""

    def __init__(self, uri):
        super().__init__(uri)
        self.gate = threading.Event()

    def upload(self, *args, **kwargs):
        self.gate.wait(30)
        return super().upload(*args, **kwargs)


@pytest.mark.parametrize("always_push", [False, True])
def test_a_push_is_skipped_while_the_previous_runs_unless_hub_always_push(tmp_path, make_args, always_push):
    args = make_args(push_to_hub=True, hub_always_push=always_push)
    target = _GatedTarget(f"file://{tmp_path}/repo")
    pusher = HubPusher(target, args)
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"w")
    first = pusher.submit("first", target.upload, str(folder), "", "one", None)
    second = pusher.submit("second", target.upload, str(folder), "", "two", None)
    assert first is not None and (second is not None) == always_push
    target.gate.set()
    assert pusher.wait() == []
    assert [c["message"] for c in target.commits()] == (["one", "two"] if always_push else ["one"])


def test_a_failed_push_keeps_the_checkpoint_and_says_what_failed(tmp_path, make_args, make_classifier,
                                                                make_examples, caplog):
    repo = tmp_path / "hub" / "tiny"
    repo.mkdir(parents=True)
    (repo / "main").write_text("a file where the revision folder should be")  # every push fails
    trainer = _trainer(make_args, make_classifier, make_examples, hub_model_id=f"file://{repo}",
                       hub_strategy="every_save")
    with caplog.at_level(logging.WARNING, logger="raytrainer.hub"):
        trainer.train()
    assert trainer.state.global_step == 8  # training did not stop
    assert trainer._hub.failures and trainer._hub.failures[0].startswith("checkpoint-4: ")
    assert os.path.isfile(tmp_path / "checkpoint-8" / "manifest.json")
    assert "2 push(es) to file://" in caplog.text and "the checkpoints are kept in storage" in caplog.text
    with pytest.raises(RuntimeError, match=r"pushing the model in .* failed"):
        trainer.push_to_hub()  # an explicit, blocking push raises


def test_no_token_is_an_error_before_training(tmp_path, monkeypatch, make_args, make_classifier,
                                              make_examples):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # no stored login either
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # at construction, where transformers' Trainer makes the repository, or at train() before any step
    with pytest.raises(ValueError, match="needs a token: set HF_TOKEN, pass hub_token"):
        _trainer(make_args, make_classifier, make_examples, hub_model_id="someone/tiny").train()
    assert not list(tmp_path.glob("checkpoint-*"))


class _HubRecorder:
    """Replaces HfApi's network calls (create_repo, create_branch, upload_folder) and records them, with
    a snapshot of each uploaded folder taken at call time."""

    def __init__(self, monkeypatch):
        import huggingface_hub

        self.calls = []
        recorder = self

        def create_repo(api, repo_id, token=None, private=None, exist_ok=False, **kw):
            recorder.calls.append(("create_repo", {"repo_id": repo_id, "token": token, "private": private}))
            return huggingface_hub.RepoUrl(f"https://huggingface.co/someone/{repo_id.split('/')[-1]}")

        def create_branch(api, repo_id, branch, token=None, exist_ok=False, **kw):
            recorder.calls.append(("create_branch", {"repo_id": repo_id, "branch": branch, "token": token}))

        def upload_folder(api, repo_id, folder_path, path_in_repo=None, commit_message=None, token=None,
                          revision=None, ignore_patterns=None, **kw):
            from raytrainer.hub.targets import local_files

            files = {f: open(os.path.join(folder_path, f), "rb").read()  # noqa: SIM115
                     for f in local_files(folder_path, ignore_patterns)}
            recorder.calls.append(("upload_folder", {"repo_id": repo_id, "path_in_repo": path_in_repo,
                                                     "message": commit_message, "token": token,
                                                     "revision": revision, "files": files}))
            return huggingface_hub.CommitInfo(commit_url=f"https://huggingface.co/{repo_id}/commit/abc",
                                              commit_message=commit_message, commit_description="",
                                              oid="abc", pr_url=None)

        for name, fn in (("create_repo", create_repo), ("create_branch", create_branch),
                         ("upload_folder", upload_folder)):
            monkeypatch.setattr(huggingface_hub.HfApi, name, fn)

    def uploads(self):
        return [c for name, c in self.calls if name == "upload_folder"]


def test_huggingface_hub_pushes_through_hfapi_and_never_leaks_the_token(tmp_path, monkeypatch, make_args,
                                                                        make_classifier, make_examples,
                                                                        caplog, capsys):
    hub = _HubRecorder(monkeypatch)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    trainer = _trainer(make_args, make_classifier, make_examples, hub_model_id="tiny", hub_token=TOKEN,
                       hub_strategy="checkpoint", hub_private_repo=True, hub_revision="dev",
                       disable_tqdm=False)
    with caplog.at_level(logging.DEBUG):
        trainer.train()
        commit = trainer.push_to_hub(tags="digits")
    assert hub.calls[0] == ("create_repo", {"repo_id": "tiny", "token": TOKEN, "private": True})
    assert hub.calls[1] == ("create_branch", {"repo_id": "someone/tiny", "branch": "dev", "token": TOKEN})
    uploads = hub.uploads()
    step = "Training in progress, step"
    assert [(u["path_in_repo"], u["message"]) for u in uploads] == [
        (None, f"{step} 4"), ("last-checkpoint", f"{step} 4, checkpoint"),
        (None, f"{step} 8"), ("last-checkpoint", f"{step} 8, checkpoint"), (None, "End of training")]
    assert all(u["repo_id"] == "someone/tiny" and u["revision"] == "dev" and u["token"] == TOKEN
               for u in uploads)
    assert "manifest.json" in uploads[3]["files"] and "manifest.json" not in uploads[2]["files"]
    final = uploads[4]["files"]
    assert "README.md" in final and not any(f.startswith(("checkpoint-", "logs/")) for f in final)
    assert commit.oid == "abc"
    # the token is in no log record, no console output, no file written, nothing uploaded
    out = capsys.readouterr()
    assert caplog.records and TOKEN not in caplog.text and TOKEN not in out.out + out.err
    for root, _, names in os.walk(tmp_path):
        for name in names:
            assert TOKEN.encode() not in open(os.path.join(root, name), "rb").read(), name  # noqa: SIM115
    assert all(TOKEN.encode() not in data for u in uploads for data in u["files"].values())
    assert json.loads(uploads[4]["files"]["training_args.json"])["hub_token"] == "<HUB_TOKEN>"
    assert trainer.args.hub_token == TOKEN  # the driver keeps it for later pushes


def test_model_card_without_evaluation_has_no_results_table(make_args, make_classifier, make_examples):
    trainer = _trainer(make_args, make_classifier, make_examples, eval_strategy="no", push_to_hub=False,
                       save_strategy="no")
    trainer.train()
    trainer.create_model_card(model_name="tiny")
    with open(os.path.join(trainer.args.output_dir, "README.md")) as f:
        card = f.read()
    assert card == _transformers_card(trainer, model_name="tiny")
    # as transformers: without evaluations, no results table and no final metrics
    assert "| Training Loss" not in card and "achieves the following results" not in card


def test_the_workers_trainer_never_holds_the_hub_token(tmp_path, monkeypatch, make_args, make_classifier,
                                                       make_examples):
    """The run spec (the pickled Trainer shipped to the Ray workers) is captured at the launch boundary."""
    import cloudpickle

    from raytrainer.driver import launch

    class Captured(Exception):
        pass

    def capture(trainer, spec, method, registry):
        raise Captured(spec.trainer)

    monkeypatch.setattr(launch, "launch", capture)
    trainer = _trainer(make_args, make_classifier, make_examples, num_workers=2, hub_token=TOKEN,
                       hub_model_id=f"file://{tmp_path}/hub")
    with pytest.raises(Captured) as caught:
        trainer.train()
    spec = caught.value.args[0]
    assert TOKEN.encode() not in spec
    shipped = cloudpickle.loads(spec)  # the trainer itself, or the recipe each rank builds it from
    if isinstance(shipped, Recipe):  # whose payload goes to the ranks through Ray's object store
        assert TOKEN.encode() not in trainer._recipe.payload
        shipped = types.SimpleNamespace(args=trainer._recipe.unpack()[4])
    assert shipped.args.hub_token is None
    assert trainer.args.hub_token == TOKEN  # the driver keeps it


def test_create_model_card_writes_readme_from_the_run(tmp_path):
    import torch

    from raytrainer import Trainer, TrainingArguments

    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)

    class Wrap(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, x, labels):
            return {"loss": ((self.m(x).squeeze(-1) - labels) ** 2).mean()}

    data = [{"x": torch.randn(2), "labels": torch.tensor(1.0)} for _ in range(8)]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, logging_steps=1, report_to="none",
                             per_device_train_batch_size=4, save_strategy="no", disable_tqdm=True)
    trainer = Trainer(model=Wrap(), args=args, train_dataset=data)
    trainer.train()
    trainer.create_model_card(model_name="tiny-reg", license="apache-2.0", tags=["regression"])
    card = (tmp_path / "README.md").read_text()
    assert card == _transformers_card(trainer, model_name="tiny-reg", license="apache-2.0",
                                      tags=["regression"])
    assert "# tiny-reg" in card and "license: apache-2.0" in card and "- regression" in card
    assert "- learning_rate: 5e-05" in card and "- training_steps: 2" in card


def test_a_push_of_an_fsdp_sharded_checkpoint_takes_the_models_dcp_folder_as_it_is(tmp_path):
    """A SHARDED_STATE_DICT checkpoint has no consolidated weights: its pytorch_model_fsdp_0/ shards go with
    the config; the optimizer's shards and the training state stay behind."""
    from raytrainer.hub import staging
    from raytrainer.storage import Storage

    checkpoint = tmp_path / "checkpoint-8"
    for rel in ("config.json", "training_args.json", "trainer_state.json", "rng_state_0.safetensors",
                "pytorch_model_fsdp_0/.metadata", "pytorch_model_fsdp_0/__0_0.distcp",
                "pytorch_model_fsdp_0/__1_0.distcp", "optimizer_0/.metadata", "optimizer_0/__0_0.distcp"):
        (checkpoint / rel).parent.mkdir(parents=True, exist_ok=True)
        (checkpoint / rel).write_bytes(b"x")
    assert staging.model_files(Storage.from_uri(str(checkpoint))) == [
        "config.json", "training_args.json", "pytorch_model_fsdp_0/.metadata",
        "pytorch_model_fsdp_0/__0_0.distcp", "pytorch_model_fsdp_0/__1_0.distcp"]


def test_a_file_uri_repository_replaces_its_commit_list_whole(tmp_path):
    """commits.json on a file:// repository is replaced by a rename, never rewritten in place: a reader
    that opened it before a push reads the whole list as it was (an in-place write truncates the very file
    it reads, and a reader between the truncation and the write saw an empty file)."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    target = FilesystemTarget(f"file://{tmp_path / 'repo'}")
    target.upload(str(tmp_path / "model"), "", "Training in progress, step 2", None)
    with open(tmp_path / "repo" / "commits.json") as before:
        target.upload(str(tmp_path / "model"), "", "Training in progress, step 4", None)
        assert [c["message"] for c in json.load(before)] == ["Training in progress, step 2"]
    assert [c["message"] for c in target.commits()] == ["Training in progress, step 2",
                                                        "Training in progress, step 4"]
    assert sorted(os.listdir(tmp_path / "repo")) == ["commits.json", "main"]  # no temporary left
