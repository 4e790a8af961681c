"""The GPU path (``pytest -m gpu``; skipped where torch sees no CUDA device). ``bash bench/gpu.sh`` runs these
on a GPU machine with the MFU benchmark.

Every test trains a tiny LLaMA-shaped decoder (built from a config, no download) on 8 random sequences it
can memorise, so a falling loss shows the step really learns. They need torch and transformers only; the
Ray tests need ray (skipped without it), the DeepSpeed test deepspeed too.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts: deterministic cuBLAS

import cloudpickle
import pytest
import torch

import raytrainer
from raytrainer import Trainer, TrainerCallback, TrainingArguments

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # callbacks defined here travel to Ray workers

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA device (bench/gpu.sh runs these on a GPU machine)"),
]

VOCAB, SEQ = 64, 32


def tiny_llama(seed: int = 0, attn: str = "sdpa"):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                        max_position_embeddings=SEQ, attn_implementation=attn))


def token_data(n: int = 8) -> list[dict]:
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": row, "labels": row} for row in ids]


def make_args(tmp_path, **kw) -> TrainingArguments:
    base = dict(output_dir=str(tmp_path / "out"), num_workers=0, report_to="none", disable_tqdm=True,
                save_strategy="no", per_device_train_batch_size=4, max_steps=16, logging_steps=1,
                learning_rate=3e-3, seed=0, data_seed=0)
    return TrainingArguments(**{**base, **kw})


def losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def assert_learns(trainer) -> None:
    logged = losses(trainer)
    assert len(logged) == trainer.args.max_steps
    assert all(torch.isfinite(torch.tensor(logged)))
    assert logged[-1] < 0.8 * logged[0], logged  # memorising 8 sequences: the loss falls


class Probe(TrainerCallback):
    """Runs ``fn(trainer)`` at the first step's end, in the process that trains, and keeps what it returns."""

    def __init__(self, trainer_ref: list, fn):
        self.trainer_ref, self.fn, self.seen = trainer_ref, fn, None

    def on_step_end(self, args, state, control, **kwargs):
        if self.seen is None:
            self.seen = self.fn(self.trainer_ref[0])


# -- num_workers=0: the script's own process ---------------------------------------------------------------
def test_trains_on_the_gpu_by_default_as_transformers(tmp_path):
    """No use_gpu, no device argument: a one-process run trains on the GPU, as transformers.Trainer does."""
    args = make_args(tmp_path)
    assert args.device.type == "cuda" and args.n_gpu == 1
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=token_data())
    trainer.train()
    assert_learns(trainer)
    assert {p.device.type for p in trainer.model.parameters()} == {"cuda"}


def test_use_cpu_keeps_training_on_the_cpu(tmp_path):
    args = make_args(tmp_path, use_cpu=True, max_steps=2)
    assert args.device.type == "cpu" and args.n_gpu == 0
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=token_data())
    trainer.train()
    assert {p.device.type for p in trainer.model.parameters()} == {"cpu"}


def _matmul_dtype(trainer):
    """The dtype a Linear layer computes in during a training forward, and the weights' dtype."""
    seen = []
    layer = trainer.model.model.layers[0].mlp.down_proj
    handle = layer.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    batch = {k: v[:1].cuda() for k, v in trainer.get_train_dataloader().__iter__().__next__().items()}
    with trainer.compute_loss_context_manager():
        trainer.model(**batch)
    handle.remove()
    return seen[0], layer.weight.dtype


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains_with_fp32_weights(tmp_path, precision):
    ref = []
    probe = Probe(ref, _matmul_dtype)
    scale_probe = Probe(ref, lambda t: getattr(t._strategy.precision, "scaler", None))
    trainer = Trainer(model=tiny_llama(), args=make_args(tmp_path, **{precision: True}),
                      train_dataset=token_data(), callbacks=[probe, scale_probe])
    ref.append(trainer)
    trainer.train()
    assert_learns(trainer)
    want = torch.bfloat16 if precision == "bf16" else torch.float16
    assert probe.seen == (want, torch.float32)  # autocast computes in half precision; weights stay fp32
    scaler = scale_probe.seen
    if precision == "fp16":  # dynamic loss scaling on CUDA
        assert isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled()
        assert 0 < scaler.get_scale() < float("inf")
    else:
        assert scaler is None


def test_fp16_skips_a_step_whose_gradients_overflow(tmp_path):
    """A loss scaled into inf/NaN gradients: the optimizer step is skipped and the scale halves."""

    class Overflow(TrainerCallback):
        def __init__(self, ref):
            self.ref, self.before = ref, None

        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 2:
                scaler = self.ref[0]._strategy.precision.scaler
                scaler.update(2.0 ** 120)  # finite in fp32; the next backward overflows in fp16
                self.before = ({k: v.detach().clone() for k, v in self.ref[0].model.state_dict().items()},
                               scaler.get_scale())

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 3:
                t = self.ref[0]
                self.after = ({k: v.detach().clone() for k, v in t.model.state_dict().items()},
                              t._strategy.precision.scaler.get_scale())

    ref = []
    cb = Overflow(ref)
    trainer = Trainer(model=tiny_llama(), args=make_args(tmp_path, fp16=True, max_steps=4, max_grad_norm=0.0,
                                                         lr_scheduler_type="constant"),
                      train_dataset=token_data(), callbacks=[cb])
    ref.append(trainer)
    trainer.train()
    weights_before, scale_before = cb.before
    weights_after, scale_after = cb.after
    assert scale_before == 2.0 ** 120 and scale_after == scale_before / 2  # backoff_factor 0.5
    assert all(torch.equal(weights_before[k], weights_after[k]) for k in weights_before)  # step 3 skipped
    assert trainer.state.global_step == 4


def test_tf32_is_switched_on(tmp_path):
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        backends = torch.backends
        probe = Probe([None], lambda t: (backends.cuda.matmul.allow_tf32, backends.cudnn.allow_tf32))
        trainer = Trainer(model=tiny_llama(), args=make_args(tmp_path, tf32=True), train_dataset=token_data(),
                          callbacks=[probe])
        trainer.train()
        assert probe.seen == (True, True)
        assert_learns(trainer)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_torch_compile_trains_the_compiled_graph(tmp_path):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    eager = Trainer(model=tiny_llama(), args=make_args(tmp_path / "eager"), train_dataset=token_data())
    eager.train()
    compiled = Trainer(model=tiny_llama(), args=make_args(tmp_path / "compiled", torch_compile=True),
                       train_dataset=token_data())
    compiled.train()
    assert counters["stats"]["unique_graphs"] >= 1  # inductor compiled the training forward
    assert_learns(compiled)
    # the same computation, other kernels: losses agree to float rounding
    assert losses(compiled) == pytest.approx(losses(eager), rel=2e-3)


def test_gpu_memory_metrics_as_transformers(tmp_path):
    trainer = Trainer(model=tiny_llama(), args=make_args(tmp_path, skip_memory_metrics=False, max_steps=4),
                      train_dataset=token_data())
    metrics = trainer.train().metrics
    n_params = sum(p.numel() for p in trainer.model.parameters())
    # AdamW's two fp32 moments stay allocated after training: at least 8 bytes per parameter more.
    assert metrics["train_mem_gpu_alloc_delta"] >= 8 * n_params
    assert metrics["train_mem_gpu_peaked_delta"] > 0  # gradients and activations, freed by the end
    assert isinstance(metrics["train_mem_cpu_alloc_delta"], int)


def test_resume_on_the_gpu_is_bitwise_equal(tmp_path):
    """Save at step 3, resume to step 6: the weights equal those of a run never interrupted, bit for bit,
    under torch.use_deterministic_algorithms(True) (eager attention: SDPA's backward kernels are not
    deterministic)."""
    torch.use_deterministic_algorithms(True)
    try:
        def run(out, **kw):
            args = make_args(tmp_path, output_dir=str(out), max_steps=6, save_strategy="steps", save_steps=3,
                             **kw)
            return Trainer(model=tiny_llama(attn="eager"), args=args, train_dataset=token_data())

        full = run(tmp_path / "full")
        full.train()
        resumed = run(tmp_path / "resumed")
        resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-3"))
    finally:
        torch.use_deterministic_algorithms(False)
    a, b = full.model.state_dict(), resumed.model.state_dict()
    assert resumed.state.global_step == 6
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    assert len(losses(resumed)) == 6 and losses(resumed)[3:] == losses(full)[3:]



# -- Ray Train workers (with ray importable) ---------------------------------------------------------------
@pytest.fixture(scope="module")
def ray_instance():
    ray = pytest.importorskip("ray")
    yield ray
    raytrainer.shutdown()  # the idle worker groups the tests leave for the next Trainer of the same shape
    if ray.is_initialized():
        ray.shutdown()


class WhereItRan(TrainerCallback):
    """Writes, from the worker, the device of its weights and the process group's backend."""

    def __init__(self, path: str):
        self.path = path

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        import torch.distributed as dist

        with open(self.path, "w") as f:
            json.dump({"device": next(model.parameters()).device.type,
                       "backend": dist.get_backend() if dist.is_initialized() else None,
                       "visible": os.environ.get("CUDA_VISIBLE_DEVICES")}, f)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", [{}, {"fsdp": "full_shard auto_wrap"}], ids=["ddp", "fsdp"])
def test_ray_worker_trains_on_its_gpu_over_nccl(tmp_path, ray_instance, strategy):
    where = str(tmp_path / "where.json")
    model = tiny_llama()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    args = make_args(tmp_path, num_workers=1, use_gpu=True, bf16=True, **strategy)
    trainer = Trainer(model=model, args=args, train_dataset=token_data(), callbacks=[WhereItRan(where)])
    trainer.train()
    with open(where) as f:
        seen = json.load(f)
    assert seen["device"] == "cuda" and seen["backend"] == "nccl" and seen["visible"]
    assert_learns(trainer)
    changed = [k for k, v in trainer.model.state_dict().items() if not torch.equal(v.cpu(), initial[k])]
    assert len(changed) == len(initial)  # the trained weights came back to the driver's model


@pytest.mark.timeout(600)
def test_deepspeed_zero3_on_a_ray_gpu_worker(tmp_path, ray_instance):
    pytest.importorskip("deepspeed")
    config = {"zero_optimization": {"stage": 3}, "bf16": {"enabled": "auto"},
              "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "gradient_clipping": "auto"}
    where = str(tmp_path / "where.json")
    args = make_args(tmp_path, num_workers=1, use_gpu=True, bf16=True, deepspeed=config,
                     save_strategy="steps", save_steps=8)
    trainer = Trainer(model=tiny_llama(), args=args,
                      train_dataset=token_data(), callbacks=[WhereItRan(where)])
    trainer.train()
    with open(where) as f:
        assert json.load(f)["device"] == "cuda"
    assert_learns(trainer)
    # the engine's files, written from CUDA state in the background (a host copy first), are committed
    # whole, and a resume from the first checkpoint goes on along the same loss curve
    files = json.loads((tmp_path / "out" / "checkpoint-8" / "manifest.json").read_text())["files"]
    assert "global_step8/zero_pp_rank_0_mp_rank_00_model_states.pt" in files, files
    assert any(f.startswith("global_step8/") and f.endswith("zero_pp_rank_0_mp_rank_00_optim_states.pt")
               for f in files), files
    again = Trainer(model=tiny_llama(), args=make_args(tmp_path / "again", num_workers=1, use_gpu=True,
                                                       bf16=True, deepspeed=config),
                    train_dataset=token_data())
    assert again.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-8")).global_step == 16
    later = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h and h["step"] > 8}
    resumed = {h["step"]: h["loss"] for h in again.state.log_history if "loss" in h and h["step"] > 8}
    assert resumed.keys() == later.keys()
    assert all(abs(resumed[k] - later[k]) < 0.05 * later[k] + 1e-3 for k in later), (resumed, later)


@pytest.mark.timeout(600)
def test_fsdp_checkpoints_on_a_ray_gpu_worker_are_sharded_resume_and_consolidate(tmp_path, ray_instance):
    """FSDP on a Ray GPU worker (NCCL): each checkpoint holds the model as DCP shards written from CUDA
    tensors, no consolidated ``model.safetensors``; ``raytrainer consolidate`` of the last one, on the CPU,
    gives the trained weights bit for bit; a resume from the middle checkpoint continues the same loss
    curve."""
    from safetensors.torch import load_file

    from raytrainer.consolidate import consolidate

    def run(name: str, resume: str | None = None) -> Trainer:
        args = make_args(tmp_path, output_dir=str(tmp_path / name), num_workers=1, use_gpu=True, bf16=True,
                         fsdp="full_shard auto_wrap", save_strategy="steps", save_steps=8)
        trainer = Trainer(model=tiny_llama(attn="eager"), args=args, train_dataset=token_data())
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    full = run("full")
    assert_learns(full)
    files = set(json.loads((tmp_path / "full" / "checkpoint-8" / "manifest.json").read_text())["files"])
    assert {"pytorch_model_fsdp_0/.metadata", "pytorch_model_fsdp_0/__0_0.distcp", "optimizer_0/.metadata",
            "optimizer_0/__0_0.distcp", "trainer_state.json"} <= files, files
    assert "model.safetensors" not in files and "optimizer.pt" not in files, files

    assert consolidate(str(tmp_path / "full" / "checkpoint-16"), str(tmp_path / "merged")) == [
        "model.safetensors"]
    merged, live = load_file(str(tmp_path / "merged" / "model.safetensors")), full.model.state_dict()
    assert merged.keys() == live.keys()
    for name, tensor in live.items():
        assert torch.equal(merged[name], tensor.cpu()), name

    resumed = run("resumed", resume=str(tmp_path / "full" / "checkpoint-8"))
    assert resumed.state.global_step == 16
    assert losses(resumed)[:8] == losses(full)[:8]  # from the checkpoint's trainer state
    assert losses(resumed)[8:] == pytest.approx(losses(full)[8:], rel=1e-3)
    for name, tensor in full.model.state_dict().items():
        torch.testing.assert_close(resumed.model.state_dict()[name], tensor, rtol=1e-3, atol=1e-4)


class WorkerIdentity(TrainerCallback):
    """Appends, from the worker at train begin, its process id and the GPU it trains on."""

    def __init__(self, path: str):
        self.path = path

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        with open(self.path, "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "device": str(next(model.parameters()).device)}) + "\n")


@pytest.mark.timeout(600)
def test_a_second_trainer_runs_on_the_first_ones_gpu_group(tmp_path, ray_instance):
    """A script's second Trainer of the same shape trains on the first one's idle GPU worker (the same
    process, after the warm reset of seeds and CUDA caches) to the same losses; raytrainer.shutdown() ends
    that worker."""
    raytrainer.shutdown()  # groups of the tests before: the first Trainer here starts its own
    seen = str(tmp_path / "seen.jsonl")

    def run(name: str) -> Trainer:
        args = make_args(tmp_path, output_dir=str(tmp_path / name), num_workers=1, use_gpu=True, bf16=True)
        trainer = Trainer(model=tiny_llama(attn="eager"), args=args, train_dataset=token_data(),
                          callbacks=[WorkerIdentity(seen)])
        trainer.train()
        return trainer

    first, second = run("first"), run("second")
    with open(seen) as f:
        workers = [json.loads(line) for line in f]
    assert len(workers) == 2 and workers[0] == workers[1], workers  # one process, one GPU
    assert workers[0]["device"].startswith("cuda")
    assert_learns(second)
    assert losses(second) == pytest.approx(losses(first), rel=1e-4)
    raytrainer.shutdown()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            os.kill(workers[0]["pid"], 0)
        except ProcessLookupError:
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"the worker process {workers[0]['pid']} outlived raytrainer.shutdown()")


# -- Seq2SeqTrainer: generation on the GPU ------------------------------------------------------------------
def _t5_helpers():
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "integration"))
    import models

    cloudpickle.register_pickle_by_value(models)  # compute_metrics and the data travel to Ray workers
    return models


@pytest.fixture(scope="module")
def trained_t5(tmp_path_factory):
    """A tiny T5 trained on the reversal task on the GPU (an untrained one generates only pad ids)."""
    from raytrainer import Seq2SeqTrainer, Seq2SeqTrainingArguments

    m = _t5_helpers()
    args = Seq2SeqTrainingArguments(output_dir=str(tmp_path_factory.mktemp("t5")), num_workers=0,
                                    max_steps=150, learning_rate=3e-3, per_device_train_batch_size=8,
                                    save_strategy="no", report_to="none", disable_tqdm=True, seed=0)
    trainer = Seq2SeqTrainer(model=m.tiny_t5(), args=args, train_dataset=m.reversal_pairs(96, seed=7))
    assert trainer.train().training_loss < 2.5
    return {k: v.detach().cpu().clone() for k, v in trainer.model.state_dict().items()}


def _seq2seq_args(cls, tmp_path, **kw):
    return cls(output_dir=str(tmp_path), per_device_eval_batch_size=4, report_to="none", disable_tqdm=True,
               predict_with_generate=True, bf16=True, **kw)


def test_bf16_generation_on_the_gpu_matches_transformers(tmp_path, trained_t5):
    """bf16 on CUDA: the decoder steps run under autocast as transformers' (accelerate's wrapped forward), the
    encoder outside it: the same beam-search ids as transformers.Seq2SeqTrainer on the same GPU."""
    import numpy as np
    import transformers

    from raytrainer import Seq2SeqTrainer, Seq2SeqTrainingArguments
    from raytrainer.seq2seq import _settled_generation_config

    m = _t5_helpers()
    data = m.reversal_pairs(12)
    ours = Seq2SeqTrainer(model=m.tiny_t5(trained_t5), compute_metrics=m.token_accuracy,
                          args=_seq2seq_args(Seq2SeqTrainingArguments, tmp_path / "ours", num_workers=0))
    theirs = transformers.Seq2SeqTrainer(model=m.tiny_t5(trained_t5), compute_metrics=m.token_accuracy,
                                         args=_seq2seq_args(transformers.Seq2SeqTrainingArguments,
                                                            tmp_path / "theirs"))
    _settled_generation_config(theirs.model)  # transformers fills the defaults after its first batch
    mine, ref = ours.predict(data, num_beams=2), theirs.predict(data, num_beams=2)
    assert next(ours.model.parameters()).device.type == "cuda"
    assert len(np.unique(mine.predictions)) > 5
    np.testing.assert_array_equal(mine.predictions, ref.predictions)
    assert mine.metrics["test_loss"] == pytest.approx(ref.metrics["test_loss"], rel=1e-5)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", [{}, {"fsdp": "full_shard auto_wrap"}], ids=["ddp", "fsdp"])
def test_seq2seq_generation_on_a_ray_gpu_worker(tmp_path, ray_instance, trained_t5, strategy):
    """predict_with_generate on a Ray GPU worker (NCCL; FSDP gathers the shards for generate): the same ids
    and token accuracy as the script's own process on the GPU."""
    import numpy as np

    from raytrainer import Seq2SeqTrainer, Seq2SeqTrainingArguments

    m = _t5_helpers()
    data = m.reversal_pairs(12)
    results = []
    for workers, kw in ((0, {}), (1, {"use_gpu": True, **strategy})):
        args = _seq2seq_args(Seq2SeqTrainingArguments, tmp_path / str(workers), num_workers=workers, **kw)
        trainer = Seq2SeqTrainer(model=m.tiny_t5(trained_t5), args=args, compute_metrics=m.token_accuracy)
        results.append(trainer.predict(data, num_beams=2))
    local, remote = results
    assert len(np.unique(local.predictions)) > 5
    np.testing.assert_array_equal(remote.predictions, local.predictions)
    assert remote.metrics["test_token_accuracy"] == local.metrics["test_token_accuracy"]


@pytest.mark.timeout(600)
@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="tensor parallelism needs 2 GPUs (nccl gives each rank its own GPU)")
def test_tensor_parallelism_on_two_gpus_trains_as_ddp(tmp_path, ray_instance):
    """parallelism_config tp_size=2 over nccl: the LLaMA's projections split across two GPUs, its losses
    those of DDP on the same global batch (rank 0 builds the model and fills both ranks' shards, so both
    runs start from the same weights)."""
    data = token_data()
    common = {"num_workers": 2, "use_gpu": True, "max_steps": 8}
    ddp = Trainer(model_init=tiny_llama, train_dataset=data,
                  args=make_args(tmp_path / "ddp", per_device_train_batch_size=2, **common))
    ddp.train()
    tp = Trainer(model_init=tiny_llama, train_dataset=data,
                 args=make_args(tmp_path / "tp", per_device_train_batch_size=4,
                                parallelism_config={"tp_size": 2},
                                fsdp_config={"cpu_ram_efficient_loading": True}, **common))
    tp.train()
    assert_learns(tp)
    assert losses(tp) == pytest.approx(losses(ddp), rel=2e-3)
