"""Checkpoints in a real S3 server (moto, tests/s3server.py), in-process (num_workers=0): what lands in the
bucket, resume, rotation, best model, URIs with pyarrow options in their query string, an explicit
storage_filesystem, hub pushes to s3://, and the driver's storage check (fast, specific messages).
The 2-worker path (Ray Train's run folder in the bucket, per-rank resume reads) is
tests/integration/test_s3.py."""

from __future__ import annotations

import io
import json
import os
import time

import pyarrow.fs as pafs
import pytest
import torch
from test_checkpoint import DropoutNet, data

from raytrainer import Trainer, TrainingArguments

Net = DropoutNet  # test_checkpoint's: dropout, so an exact resume needs the RNG state back


def args(out, **kw):
    base = {"output_dir": str(out), "num_workers": 0, "per_device_train_batch_size": 4, "max_steps": 12,
            "learning_rate": 0.01, "save_strategy": "steps", "save_steps": 4, "disable_tqdm": True,
            "report_to": "none", "logging_steps": 4, "optim": "adamw_torch",
            "lr_scheduler_type": "constant"}  # a longer run continues a shorter one exactly
    base.update(kw)
    return TrainingArguments(**base)


def assert_same_weights(a, b):
    for name, tensor in a.state_dict().items():
        assert torch.equal(b.state_dict()[name], tensor), name


def test_checkpoints_rotation_best_and_resume_in_a_bucket(tmp_path, s3_bucket):
    uri = f"{s3_bucket.uri}/runs/digits"
    kw = {"storage_path": uri, "save_total_limit": 1, "eval_strategy": "steps", "eval_steps": 4,
          "metric_for_best_model": "loss", "load_best_model_at_end": True}
    full = Trainer(model=Net(), args=args(tmp_path / "full", **kw), train_dataset=data(),
                   eval_dataset=data(16, seed=2))
    full.train()
    committed = s3_bucket.committed("runs/digits")
    best = full.state.best_model_checkpoint
    assert best.startswith(f"{uri}/checkpoint-")
    # rotation (save_total_limit=1) kept the latest and the best, nothing else
    assert set(committed) == {"checkpoint-12", best.rsplit("/", 1)[1]}
    assert committed["checkpoint-12"]["global_step"] == 12
    # nothing was written to a local folder named after the URI
    assert not os.path.exists("s3:") and not (tmp_path / "full" / "s3:").exists()

    # resume_from_checkpoint=True: the latest committed checkpoint in the bucket (checkpoint-12), bitwise
    # equal to a straight 16-step run with the same evaluations (an evaluation draws from the RNG)
    evals = {"eval_strategy": "steps", "eval_steps": 4}
    straight = Trainer(model=Net(), args=args(tmp_path / "straight", max_steps=16, **evals),
                       train_dataset=data(), eval_dataset=data(16, seed=2))
    straight.train()
    longer = Trainer(model=Net(), args=args(tmp_path / "full", max_steps=16, storage_path=uri, **evals),
                     train_dataset=data(), eval_dataset=data(16, seed=2))
    out = longer.train(resume_from_checkpoint=True)
    assert out.global_step == 16
    assert_same_weights(straight.model, longer.model)

    # from an s3:// checkpoint path into a fresh output_dir with local storage
    fresh = Trainer(model=Net(), args=args(tmp_path / "fresh", max_steps=16, **evals), train_dataset=data(),
                    eval_dataset=data(16, seed=2))
    fresh.train(resume_from_checkpoint=f"{uri}/checkpoint-12")
    assert_same_weights(straight.model, fresh.model)


def test_uri_query_options_are_kept_on_every_uri(tmp_path, s3_bucket, monkeypatch):
    endpoint = s3_bucket.server.endpoint.split("://", 1)[1]
    monkeypatch.delenv("AWS_ENDPOINT_URL")  # the URI alone says where the server is
    query = f"?endpoint_override={endpoint}&scheme=http"
    uri = f"{s3_bucket.uri}/q/run{query}"
    evals = {"eval_strategy": "steps", "eval_steps": 4, "metric_for_best_model": "loss"}
    first = Trainer(model=Net(), args=args(tmp_path / "a", storage_path=uri, max_steps=8, **evals),
                    train_dataset=data(), eval_dataset=data(16, seed=2))
    first.train()
    assert first.state.best_model_checkpoint.endswith(query)
    assert first.state.best_model_checkpoint.startswith(f"{s3_bucket.uri}/q/run/checkpoint-")
    assert set(s3_bucket.committed("q/run")) == {"checkpoint-4", "checkpoint-8"}
    resumed = Trainer(model=Net(), args=args(tmp_path / "a", storage_path=uri, max_steps=12, **evals),
                      train_dataset=data(), eval_dataset=data(16, seed=2))
    resumed.train(resume_from_checkpoint=True)
    straight = Trainer(model=Net(), args=args(tmp_path / "b", max_steps=12, **evals), train_dataset=data(),
                       eval_dataset=data(16, seed=2))
    straight.train()
    assert_same_weights(straight.model, resumed.model)
    state = json.loads(s3_bucket.get_object("q/run/checkpoint-12/trainer_state.json"))
    assert state["global_step"] == 12


def test_an_explicit_storage_filesystem(tmp_path, s3_bucket, monkeypatch):
    server = s3_bucket.server
    for key in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(key)
    fs = pafs.S3FileSystem(endpoint_override=server.endpoint, access_key=server.env["AWS_ACCESS_KEY_ID"],
                           secret_key=server.env["AWS_SECRET_ACCESS_KEY"], region="us-east-1")
    uri = f"{s3_bucket.uri}/explicit"
    trainer = Trainer(model=Net(), args=args(tmp_path, storage_path=uri, storage_filesystem=fs, max_steps=8),
                      train_dataset=data())
    trainer.train()
    assert set(s3_bucket.committed("explicit")) == {"checkpoint-4", "checkpoint-8"}
    resumed = Trainer(model=Net(), args=args(tmp_path, storage_path=uri, storage_filesystem=fs, max_steps=12),
                      train_dataset=data())
    resumed.train(resume_from_checkpoint=f"{uri}/checkpoint-8")
    assert resumed.state.global_step == 12
    # the filesystem object (its secret) is in no file: training_args.json names its type only
    saved = json.loads(s3_bucket.get_object("explicit/checkpoint-12/training_args.json"))
    assert saved["storage_filesystem"] == "S3FileSystem"
    # transformers' training_args.bin too: the arguments, without the filesystem object
    pickled = torch.load(io.BytesIO(s3_bucket.get_object("explicit/checkpoint-12/training_args.bin")),
                         weights_only=False)
    assert pickled.storage_filesystem is None and pickled.max_steps == 12 and pickled.storage_path == uri
    with pytest.raises(ValueError, match=r"storage_path.*not a location of storage_filesystem"):
        TrainingArguments(output_dir=str(tmp_path), storage_path=str(tmp_path), storage_filesystem=fs)


def test_hub_push_to_s3_and_no_credential_anywhere(tmp_path, s3_bucket):
    hub = f"{s3_bucket.uri}/models/net"
    trainer = Trainer(model=Net(), args=args(tmp_path / "out", storage_path=f"{s3_bucket.uri}/run",
                                             push_to_hub=True, hub_model_id=hub, hub_strategy="checkpoint",
                                             hub_always_push=True, hub_token="hf_s3_test_token_1234"),
                      train_dataset=data())
    trainer.train()
    objects = s3_bucket.list_objects()
    model = {k for k in objects if k.startswith("models/net/main/") and not k.endswith("/")}
    assert "models/net/main/model.safetensors" in model
    assert "models/net/main/last-checkpoint/manifest.json" in model
    pushed = json.loads(s3_bucket.get_object("models/net/main/last-checkpoint/trainer_state.json"))
    assert pushed["global_step"] == 12
    secret = s3_bucket.server.env["AWS_SECRET_ACCESS_KEY"].encode()
    key_id = s3_bucket.server.env["AWS_ACCESS_KEY_ID"].encode()
    for key in objects:
        body = s3_bucket.get_object(key)
        assert secret not in body and key_id not in body and b"hf_s3_test_token_1234" not in body, key
    for root, _, names in os.walk(tmp_path):
        for name in names:
            with open(os.path.join(root, name), "rb") as f:
                body = f.read()
            assert secret not in body and key_id not in body, name


# -- the driver's storage check: within 5 s, naming the URI and the fix, nothing started ---------------------
def _fails_fast(tmp_path, storage_path, match, **kw):
    trainer = Trainer(model=Net(), args=args(tmp_path, storage_path=storage_path, **kw), train_dataset=data())
    started = time.monotonic()
    with pytest.raises(ValueError, match=match) as info:
        trainer.train()
    elapsed = time.monotonic() - started
    assert elapsed < 5, f"took {elapsed:.1f}s"
    assert trainer.state.global_step == 0
    return str(info.value)


def test_unreachable_endpoint(tmp_path, s3_bucket, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens on the discard port
    message = _fails_fast(tmp_path, f"{s3_bucket.uri}/run", r"endpoint http://127\.0\.0\.1:9 did not answer")
    assert f"'{s3_bucket.uri}/run'" in message and "AWS_ENDPOINT_URL" in message


def test_missing_bucket(tmp_path, s3_bucket):
    message = _fails_fast(tmp_path, "s3://rt-no-such-bucket/run",
                          r"bucket 'rt-no-such-bucket' does not exist")
    assert "aws s3 mb s3://rt-no-such-bucket" in message


def test_a_bucket_root_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"storage_path.*s3://some-bucket.*bucket's root.*s3://some-bucket/runs"):
        TrainingArguments(output_dir=str(tmp_path), storage_path="s3://some-bucket")


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory):
    """A second S3 server that checks credentials and IAM policies (moto enforces them after its first
    INITIAL_NO_AUTH_ACTION_COUNT requests: here the 4 that set up a bucket and a user). The user may read
    the whole bucket and write only under ``rw/``."""
    import boto3
    from s3server import S3Server

    saved = os.environ.get("INITIAL_NO_AUTH_ACTION_COUNT")
    os.environ["INITIAL_NO_AUTH_ACTION_COUNT"] = "4"
    try:
        server = S3Server().start()
    finally:
        if saved is None:
            os.environ.pop("INITIAL_NO_AUTH_ACTION_COUNT")
        else:
            os.environ["INITIAL_NO_AUTH_ACTION_COUNT"] = saved
    try:
        kw = {"endpoint_url": server.endpoint, "region_name": "us-east-1",
              "aws_access_key_id": server.env["AWS_ACCESS_KEY_ID"],
              "aws_secret_access_key": server.env["AWS_SECRET_ACCESS_KEY"]}
        boto3.client("s3", **kw).create_bucket(Bucket="guarded")
        iam = boto3.client("iam", **kw)
        iam.create_user(UserName="reader")
        bucket, objects = "arn:aws:s3:::guarded", "arn:aws:s3:::guarded/*"
        iam.put_user_policy(UserName="reader", PolicyName="read-all-write-rw", PolicyDocument=json.dumps({
            "Version": "2012-10-17", "Statement": [
                {"Effect": "Allow", "Action": ["s3:GetObject", "s3:ListBucket"],
                 "Resource": [bucket, objects]},
                {"Effect": "Allow", "Action": ["s3:*"], "Resource": ["arn:aws:s3:::guarded/rw/*"]}]}))
        key = iam.create_access_key(UserName="reader")["AccessKey"]
        yield server, key["AccessKeyId"], key["SecretAccessKey"]
    finally:
        server.stop()


def _use(monkeypatch, server, key_id, secret):
    monkeypatch.setenv("AWS_ENDPOINT_URL", server.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_REGION", "us-east-1")


def test_a_writable_prefix_passes_the_check(tmp_path, auth_server, monkeypatch):
    from raytrainer.storage import Storage

    server, key_id, secret = auth_server
    _use(monkeypatch, server, key_id, secret)
    Storage.from_uri("s3://guarded/rw/run").check_writable()  # no exception: the policy allows rw/


def test_read_only_prefix(tmp_path, auth_server, monkeypatch):
    server, key_id, secret = auth_server
    _use(monkeypatch, server, key_id, secret)
    message = _fails_fast(tmp_path, "s3://guarded/ro/run", r"Access is denied.*may not write under")
    assert "'s3://guarded/ro/run'" in message and "s3:PutObject" in message


@pytest.mark.parametrize("which", ["unknown key", "wrong secret"])
def test_wrong_credentials(tmp_path, auth_server, monkeypatch, which):
    server, key_id, secret = auth_server
    _use(monkeypatch, server, "AKIAUNKNOWN000000000" if which == "unknown key" else key_id,
         "wrong-secret" if which == "wrong secret" else secret)
    message = _fails_fast(tmp_path, "s3://guarded/rw/run", r"rejected the credentials")
    assert "AWS_ACCESS_KEY_ID" in message and "'s3://guarded/rw/run'" in message
    assert secret not in message and "wrong-secret" not in message


def test_search_trials_folders_in_a_bucket_with_uri_options(tmp_path, s3_bucket, monkeypatch):
    import optuna

    from raytrainer.search.common import TrialSummary

    endpoint = s3_bucket.server.endpoint.split("://", 1)[1]
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    query = f"?endpoint_override={endpoint}&scheme=http"
    run_args = args(tmp_path, storage_path=f"{s3_bucket.uri}/search{query}", max_steps=8,
                    eval_strategy="steps", eval_steps=4, save_total_limit=1)
    trainer = Trainer(model_init=lambda trial=None: Net(), train_dataset=data(),
                      eval_dataset=data(16, seed=2), args=run_args)
    best = trainer.hyperparameter_search(
        hp_space=lambda t: {"learning_rate": t.suggest_float("learning_rate", 1e-3, 1e-1, log=True)},
        n_trials=2, sampler=optuna.samplers.TPESampler(seed=0))
    for trial in ("0", "1"):  # each trial's run folder in the bucket, rotated to its latest checkpoint
        assert set(s3_bucket.committed(f"search/run-{trial}")) == {"checkpoint-8"}
        summary = TrialSummary.load(str(tmp_path / f"run-{trial}"))
        assert summary.checkpoints == [f"{s3_bucket.uri}/search/run-{trial}/checkpoint-8{query}"]
    assert best.run_summary.best_checkpoint == f"{s3_bucket.uri}/search/run-{best.run_id}/checkpoint-8{query}"


def test_uris_are_joined_on_their_path_part():
    import pyarrow.fs as pafs

    from raytrainer.checkpoint import step_of
    from raytrainer.storage import filesystem_matches, join_uri, strip_scheme, uri_basename

    q = "?endpoint_override=minio:9000&scheme=http"
    assert join_uri(f"s3://b/runs/x{q}", "checkpoint-4") == f"s3://b/runs/x/checkpoint-4{q}"
    assert join_uri(f"s3://b{q}", "run-1") == f"s3://b/run-1{q}"
    assert join_uri("gs://b/runs/", "run-1", "checkpoint-2") == "gs://b/runs/run-1/checkpoint-2"
    assert join_uri("file:///tmp/x", "c") == "file:///tmp/x/c"
    assert join_uri("/tmp/x", "c") == "/tmp/x/c"
    assert uri_basename(f"s3://b/runs/x/checkpoint-4{q}") == "checkpoint-4"
    assert step_of(f"s3://b/runs/x/checkpoint-4{q}") == 4 and step_of(f"s3://b/x{q}") is None
    assert strip_scheme(f"s3://b/runs/x{q}") == "b/runs/x"
    assert strip_scheme("gs://b/runs/x/") == "b/runs/x" and strip_scheme("file:///tmp/x") == "/tmp/x"
    s3 = pafs.S3FileSystem(endpoint_override="http://127.0.0.1:9", region="us-east-1")
    assert filesystem_matches(s3, "s3://b/x") and not filesystem_matches(s3, "gs://b/x")
    assert not filesystem_matches(s3, "/tmp/x")
    assert filesystem_matches(pafs.LocalFileSystem(), "/tmp/x")
    assert filesystem_matches(pafs.LocalFileSystem(), "file:///tmp/x")
