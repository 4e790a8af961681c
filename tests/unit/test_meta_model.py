"""The driver's model_init model as a weightless skeleton (raytrainer.meta_model), in one process: when it
is one, that nothing random is drawn for it, the forward check on the meta device, the spec of evaluate,
and the skeleton made real in place on the trained weights' first use."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from raytrainer import meta_model
from raytrainer.driver.preflight import _check_returns_loss
from raytrainer.one_loop import DriverView, Trainer

CONFIG = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=64, max_position_embeddings=16)


class Counted:
    """model_init building a tiny Llama (seed 0), counting its calls and the devices it built on."""

    def __init__(self):
        self.devices = []

    def __call__(self):
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**CONFIG))
        self.devices.append(next(model.parameters()).device.type)
        return model


def tokens(n: int = 4) -> list[dict]:
    ids = torch.randint(0, 64, (n, 8), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": row, "labels": row} for row in ids]


@pytest.fixture
def above_threshold(monkeypatch):
    """Every model counts as big: the tiny Llama takes the skeleton path."""
    monkeypatch.setattr(meta_model, "DRIVER_META_ABOVE_PARAMS", 0)


def test_a_big_model_init_model_stays_a_skeleton_and_draws_no_random_numbers(make_args, above_threshold):
    """With workers, the driver builds model_init's model only when the script asks for ``trainer.model``
    before training, and then without weights: nothing random is drawn for it."""
    build = Counted()
    torch.manual_seed(123)
    trainer = Trainer(model_init=build, args=make_args(num_workers=2), train_dataset=tokens())
    model = trainer.model
    after = torch.rand(3)
    torch.manual_seed(123)
    assert torch.equal(after, torch.rand(3))  # model_init's own manual_seed(0) was undone
    assert build.devices == ["meta"]  # built once, on the meta device: no real weights on the driver
    assert meta_model.is_skeleton(model) and trainer.model is model
    assert model.config.vocab_size == 64


def test_small_models_and_in_process_runs_build_for_real(make_args):
    small = Counted()  # below the threshold: the skeleton only measured it, then the real one is built
    trainer = Trainer(model_init=small, args=make_args(num_workers=2), train_dataset=tokens())
    assert not meta_model.is_skeleton(trainer.model) and small.devices == ["meta", "cpu"]
    local = Counted()
    Trainer(model_init=local, args=make_args(num_workers=0), train_dataset=tokens())
    assert local.devices == ["cpu"]  # num_workers=0 trains here: never a skeleton


def test_a_model_init_that_names_its_device_is_built_once(make_args, above_threshold):
    build = Counted()

    def on_cpu():  # its own device context wins over the driver's meta one: that build is the real one
        with torch.device("cpu"):
            return build()

    trainer = Trainer(model_init=on_cpu, args=make_args(num_workers=2), train_dataset=tokens())
    assert not meta_model.is_skeleton(trainer.model) and build.devices == ["cpu"]


def test_a_model_init_that_refuses_the_meta_device_is_built_for_real(make_args, above_threshold, tmp_path):
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**CONFIG)).save_pretrained(tmp_path / "saved")

    def from_files():  # from_pretrained raises under a meta device context: the driver builds it for real
        return LlamaForCausalLM.from_pretrained(tmp_path / "saved")

    trainer = Trainer(model_init=from_files, args=make_args(num_workers=2), train_dataset=tokens())
    assert not meta_model.is_skeleton(trainer.model)


class LogitsOnly(torch.nn.Module):
    """Returns logits, never a loss."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(64, 8), torch.nn.Linear(8, 64)

    def forward(self, input_ids, labels=None):
        return (self.head(self.embed(input_ids)),)


class ReadsValues(LogitsOnly):
    """Reads a value in its forward, as some models do (a data-dependent branch)."""

    def forward(self, input_ids, labels=None):
        logits = self.head(self.embed(input_ids))
        scale = 2.0 if logits.abs().max().item() > 1e3 else 1.0
        return {"loss": scale * logits.float().mean()}


def test_the_forward_check_runs_on_the_skeleton(make_args, above_threshold, caplog):
    """train() on workers is refused on the driver, before any worker starts, for a model that returns no
    loss or a batch its forward cannot take: the check runs on model_init's skeleton (shapes only)."""
    trainer = Trainer(model_init=Counted(), args=make_args(num_workers=2), train_dataset=tokens())
    _check_returns_loss(DriverView(trainer), tokens())  # shapes only: LLaMA's forward returns a loss
    trainer = Trainer(model_init=ReadsValues, args=make_args(num_workers=2), train_dataset=tokens())
    with caplog.at_level("DEBUG", logger="raytrainer.driver.preflight"):
        _check_returns_loss(DriverView(trainer), tokens())
    # a forward that reads a value (.item()) cannot run without weights: the check steps aside
    assert "the forward check does not run on the meta device: Tensor.item()" in caplog.text

    trainer = Trainer(model_init=LogitsOnly, args=make_args(num_workers=2), train_dataset=tokens())
    with pytest.raises(ValueError, match="LogitsOnly returned no loss"):
        trainer.train()
    assert meta_model.is_skeleton(trainer.model) and "_group" not in vars(trainer)
    bad = [{**e, "pixels": e["labels"]} for e in tokens()]
    trainer = Trainer(model_init=LogitsOnly, args=make_args(num_workers=2, remove_unused_columns=False),
                      train_dataset=bad)
    with pytest.raises(ValueError, match="could not take a collated batch with keys"):
        trainer.train()
    assert "_group" not in vars(trainer)


def test_evaluate_ships_no_skeleton_and_the_workers_build_the_model(make_args, above_threshold):
    """evaluate() before train(): what the ranks build from holds model_init and no model (each rank builds
    it under the run's seed, as the driver's Trainer.__init__ would have), and a trainer built from it
    evaluates exactly the seeded model."""
    import cloudpickle

    trainer = Trainer(model_init=Counted(), args=make_args(num_workers=2), eval_dataset=tokens())
    assert meta_model.is_skeleton(trainer.model)  # the driver's, asked for: it does not travel
    _, args, kwargs = cloudpickle.loads(trainer._recipe.payload)
    assert kwargs.get("model") is None and isinstance(kwargs["model_init"], Counted)
    metrics = Trainer(*args, **{**kwargs, "args": make_args(num_workers=0)}).evaluate()  # as a rank would
    reference = Trainer(model=Counted()(), args=make_args(num_workers=0), eval_dataset=tokens()).evaluate()
    assert metrics["eval_loss"] == pytest.approx(reference["eval_loss"], rel=1e-6)


def test_the_skeleton_becomes_real_in_place_on_the_trained_weights_first_use(make_args, above_threshold,
                                                                              tmp_path):
    from safetensors.torch import save_file

    trainer = Trainer(model_init=Counted(), args=make_args(num_workers=2), train_dataset=tokens())
    skeleton = trainer.model
    torch.manual_seed(7)
    trained = LlamaForCausalLM(LlamaConfig(**CONFIG)).state_dict()  # stands for the final weights
    (tmp_path / "final").mkdir()
    save_file(trained, str(tmp_path / "final" / "model.safetensors"))
    vars(trainer).update(_trained=True, _weights_at=f"file://{tmp_path}/final")  # as train() leaves it
    model = trainer.model
    assert model is skeleton  # the same object, now real
    assert not any(p.is_meta for p in model.parameters())
    for name, value in trained.items():
        assert torch.equal(model.state_dict()[name], value), name
    real = Counted()()
    for name, buffer in real.named_buffers():  # non-persistent buffers (rotary tables) are the init's
        assert torch.equal(dict(model.named_buffers())[name], buffer), name
    assert model(**{k: v[None] for k, v in tokens(1)[0].items()}).loss.isfinite()
