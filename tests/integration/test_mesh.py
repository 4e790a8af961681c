"""transformers' ``parallelism_config`` on 4 Ray workers (gloo, CPU): FSDP2 x tensor parallelism and HSDP
train a pretrained tiny Llama as DDP does on the same global batch, its parameters really 2-D DTensors, and
a checkpoint saved on one mesh resumes on another."""

from __future__ import annotations

import pytest
import torch
from models import (
    FromPretrained,
    ReportBlocks,
    ReportMesh,
    TPBlocks,
    counting_data,
    make_data,
    save_tiny_llama,
    seeded_tp_blocks,
)

from raytrainer import Trainer, TrainingArguments

Q = "model.layers.0.self_attn.q_proj.weight"
NORM = "model.norm.weight"


def _args(out, **kw) -> TrainingArguments:
    base = {"output_dir": str(out), "num_workers": 4, "per_device_train_batch_size": 2, "max_steps": 6,
            "learning_rate": 0.01, "optim": "adamw_torch", "logging_steps": 1, "save_strategy": "no",
            "disable_tqdm": True, "report_to": "none", "seed": 3}
    base.update(kw)
    return TrainingArguments(**base)


def _losses(trainer) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


def _close(a: dict, b: dict, tol: float = 2e-3) -> bool:
    return a.keys() == b.keys() and all(abs(a[k] - b[k]) <= tol for k in a)


@pytest.mark.timeout(600)
def test_fsdp_x_tp_and_hsdp_train_like_ddp_and_a_checkpoint_resumes_on_another_mesh(tmp_path, capfd):
    path = save_tiny_llama(tmp_path / "pretrained")
    data = counting_data(48)

    def run(name, resume=None, **kw):
        trainer = Trainer(model_init=FromPretrained(path), args=_args(tmp_path / name, **kw),
                          train_dataset=data, callbacks=[ReportMesh()])
        trainer.train(resume_from_checkpoint=resume)
        return trainer, "".join(capfd.readouterr())

    ddp, _ = run("ddp")  # 4 ranks x 2 examples: the same global batch of 8 at every step as the meshes below
    # dp_shard=2 x tp=2: 2 data-parallel ranks x 4 examples, each pair of tensor-parallel ranks the same batch
    tp, console = run("tp", per_device_train_batch_size=4, save_strategy="steps", save_steps=3,
                      parallelism_config={"dp_shard_size": 2, "tp_size": 2})
    for rank in range(4):  # q_proj (32 x 32): rows split over tp, then over dp_shard -- 8 rows per rank
        assert (f"rank {rank}: {Q} mesh=dp_shard_cp,tp placements=StridedShard0,Shard0 local=(8, 32) of "
                f"(32, 32)") in console, console[-3000:]
        assert f"rank {rank}: {NORM} mesh=dp_shard_cp placements=Shard0 local=(16,) of (32,)" in console
    # HSDP: replicated over dp_replicate, sharded over dp_shard -- 4 data-parallel ranks of 2 examples
    hsdp, console = run("hsdp", parallelism_config={"dp_replicate_size": 2, "dp_shard_size": 2})
    for rank in range(4):
        assert (f"rank {rank}: {Q} mesh=dp_replicate,dp_shard_cp placements=Replicate,Shard0 local=(16, 32) "
                "of (32, 32)") in console, console[-3000:]

    reference = _losses(ddp)
    assert sorted(reference) == [1, 2, 3, 4, 5, 6] and reference[6] < reference[1] - 0.1, reference
    assert _close(_losses(tp), reference), (_losses(tp), reference)
    assert _close(_losses(hsdp), reference), (_losses(hsdp), reference)
    # the driver's model holds the consolidated trained weights, as DDP's does
    ddp_weights = ddp.model.state_dict()
    for trained in (tp, hsdp):
        for name, tensor in trained.model.state_dict().items():
            assert torch.allclose(tensor, ddp_weights[name], atol=2e-3), name

    # the checkpoint of the dp_shard=2 x tp=2 mesh (DCP: each rank's 2-D shards) resumes on dp_shard=4
    # (no tensor parallelism) and continues the loss curve
    resumed, _ = run("resumed", parallelism_config={"dp_shard_size": 4},
                     resume=str(tmp_path / "tp" / "checkpoint-3"))
    after = {k: v for k, v in _losses(resumed).items() if k > 3}
    assert _close(after, {k: v for k, v in _losses(tp).items() if k > 3}), (after, _losses(tp))

    # evaluation on the tensor-parallel mesh: each tensor-parallel pair reads one batch, and its outputs
    # count once -- the loss and every prediction as DDP's (13 examples: a last, partial batch)
    held_out = counting_data(61)[48:]
    ddp_eval, tp_eval = ddp.evaluate(held_out), tp.evaluate(held_out)
    assert abs(ddp_eval["eval_loss"] - tp_eval["eval_loss"]) < 2e-3, (ddp_eval, tp_eval)
    ddp_pred, tp_pred = ddp.predict(held_out), tp.predict(held_out)
    assert tp_pred.predictions.shape == ddp_pred.predictions.shape == (13, 16, 32)
    assert abs(tp_pred.predictions - ddp_pred.predictions).max() < 2e-2


def test_a_plain_torch_model_with_a_tp_plan_initialises_its_shards_on_each_rank(tmp_path, capfd):
    """model_init building a plain torch model: every rank builds it on the meta device, tensor parallelism
    then FSDP shard the skeleton, and each rank initialises only its own shards (each module's own
    reset_parameters)."""
    args = _args(tmp_path, per_device_train_batch_size=8, max_steps=12, learning_rate=0.05,
                 parallelism_config={"dp_shard_size": 2, "tp_size": 2})
    trainer = Trainer(model_init=TPBlocks, args=args, train_dataset=make_data(64), callbacks=[ReportBlocks()])
    trainer.train()
    console = "".join(capfd.readouterr())
    import re

    for rank in range(4):  # up (64 x 16): colwise over tp, then dp_shard; down (16 x 64): rowwise
        assert f"rank {rank}: up mesh=dp_shard_cp,tp StridedShard0,Shard0 local=(16, 16)" in console, console
        assert f"rank {rank}: down mesh=dp_shard_cp,tp Shard0,Shard1 local=(8, 32)" in console
    ups = {int(r): (float(m), float(f)) for r, m, f in re.findall(
        r"rank (\d): up .* max=([\d.]+) first=(-?[\d.]+)", console)}
    assert sorted(ups) == [0, 1, 2, 3]
    assert all(0.1 < m <= 0.25 for m, _ in ups.values()), ups  # nn.Linear's U(-1/sqrt(16), 1/sqrt(16))
    assert len({f for _, f in ups.values()}) == 4, ups  # each rank drew its own shard
    assert "rank 0 builds the model" not in console and "initialising each rank's shard" not in console
    losses = _losses(trainer)
    assert losses[12] < 0.7 * losses[1], losses
    # the driver's model: the consolidated whole weights, which predict as the workers trained them
    assert trainer.model.blocks[0].up.weight.shape == (64, 16)
    data = make_data(64)
    x = torch.stack([d["x"] for d in data])
    labels = torch.tensor([d["labels"] for d in data])
    accuracy = (trainer.model(x)[0].argmax(-1) == labels).float().mean()
    assert accuracy > 0.8, accuracy


@pytest.mark.timeout(300)
def test_tensor_parallelism_alone_from_rank_0s_model_trains_as_ddp(tmp_path):
    """tp_size=2 on 2 workers: no data-parallel dimension (nothing for FSDP to shard), the model built once
    by rank 0 (cpu_ram_efficient_loading) and each rank's tensor-parallel shard filled from it. The run is
    DDP's on the same global batch: the same losses and weights."""
    data = make_data(32)
    kw = {"num_workers": 2, "max_steps": 6, "learning_rate": 0.05}
    ddp = Trainer(model_init=seeded_tp_blocks, train_dataset=data,
                  args=_args(tmp_path / "ddp", per_device_train_batch_size=4, **kw))
    ddp.train()
    tp = Trainer(model_init=seeded_tp_blocks, train_dataset=data, callbacks=[ReportBlocks()],
                 args=_args(tmp_path / "tp", per_device_train_batch_size=8, parallelism_config={"tp_size": 2},
                            fsdp_config={"cpu_ram_efficient_loading": True}, **kw))
    tp.train()
    assert _close(_losses(tp), _losses(ddp), tol=1e-4), (_losses(tp), _losses(ddp))
    for name, tensor in ddp.model.state_dict().items():
        assert torch.allclose(tp.model.state_dict()[name], tensor, atol=1e-4), name
