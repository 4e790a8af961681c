import enum
import io
import math
import pickle
import re
import warnings

import pytest
import torch
import transformers
from torch import nn
from transformers.training_args import OptimizerNames

from raytrainer import Trainer, TrainingArguments
from raytrainer.optim import METRIC_SCHEDULERS, get_scheduler

SCHEDULER_NAMES = tuple(member.value for member in transformers.SchedulerType)

WARMUP, TOTAL, STEPS = 3, 20, 24  # stepping past TOTAL checks the tail of each schedule too


def _optimizer(lr=1e-3):
    # Two groups with different base lrs: a schedule must scale each group from its own lr.
    a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    return torch.optim.SGD([{"params": [a]}, {"params": [b], "lr": lr / 2}], lr=lr)


def _lrs(scheduler, optimizer, steps=STEPS, metrics=None):
    seq = [[g["lr"] for g in optimizer.param_groups]]
    for i in range(steps):
        optimizer.step()
        if metrics is None:
            scheduler.step()
        else:
            scheduler.step(metrics[i])
        seq.append([g["lr"] for g in optimizer.param_groups])
    return seq


CASES = [
    ("linear", {}),
    ("cosine", {}),
    ("cosine", {"num_cycles": 1.5}),
    ("cosine_with_restarts", {}),
    ("cosine_with_restarts", {"num_cycles": 3}),
    ("polynomial", {}),
    ("polynomial", {"lr_end": 1e-4, "power": 2.0}),
    ("constant", {}),
    ("constant_with_warmup", {}),
    ("inverse_sqrt", {}),
    ("inverse_sqrt", {"timescale": 7}),
    ("reduce_lr_on_plateau", {"patience": 1, "factor": 0.5}),
    ("cosine_with_min_lr", {"min_lr": 1e-4}),
    ("cosine_with_min_lr", {"min_lr_rate": 0.1, "num_cycles": 1.0}),
    ("cosine_warmup_with_min_lr", {"min_lr_rate": 0.1}),
    ("cosine_warmup_with_min_lr", {"min_lr": 2e-4, "warmup_lr_rate": 0.2}),
    ("warmup_stable_decay", {"num_decay_steps": 5}),
    ("warmup_stable_decay", {"num_decay_steps": 4, "num_stable_steps": 6, "warmup_type": "cosine",
                             "decay_type": "1-sqrt", "min_lr_ratio": 0.1}),
    ("warmup_stable_decay", {"num_decay_steps": 6, "warmup_type": "1-sqrt", "decay_type": "linear"}),
]
# ReduceLROnPlateau moves on a metric: plateaus, then improvements.
PLATEAU_METRICS = [1.0, 1.0, 1.0, 0.9, 0.9, 0.9, 0.9, 0.5] + [0.5] * (STEPS - 8)


def test_every_scheduler_name_is_covered():
    assert {name for name, _ in CASES} | {"greedy"} == set(SCHEDULER_NAMES)


def test_schedulers_are_transformers_own():
    import transformers

    assert get_scheduler is transformers.get_scheduler
    assert set(SCHEDULER_NAMES) == {member.value for member in transformers.SchedulerType}
    # The metric-driven ones are those the loop steps after an evaluation instead of after each step.
    assert isinstance(get_scheduler("reduce_lr_on_plateau", _optimizer()), METRIC_SCHEDULERS)
    assert isinstance(get_scheduler("greedy", _optimizer()), METRIC_SCHEDULERS)
    assert not isinstance(get_scheduler("linear", _optimizer(), 1, 10), METRIC_SCHEDULERS)


@pytest.mark.parametrize("name,kwargs", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_every_schedule_moves_and_stays_finite(name, kwargs):
    metrics = PLATEAU_METRICS if name == "reduce_lr_on_plateau" else None
    opt = _optimizer()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # wsd warns when both step counts are given
        seq = _lrs(get_scheduler(name, opt, WARMUP, TOTAL, dict(kwargs)), opt, metrics=metrics)
    assert len(seq) == STEPS + 1 and all(math.isfinite(v) for lrs in seq for v in lrs)
    # Each group follows the same shape from its own lr, and the schedule is not flat (but for constant).
    assert [lrs[1] for lrs in seq] == pytest.approx([lrs[0] / 2 for lrs in seq])
    if name != "constant":
        assert len({round(lrs[0], 15) for lrs in seq}) > 1


def test_linear_values():
    opt = _optimizer(lr=1.0)
    lrs = [g[0] for g in _lrs(get_scheduler("linear", opt, 3, 10), opt, steps=12)]
    assert lrs[0] == 0.0
    assert lrs[1] == pytest.approx(1 / 3)
    assert lrs[3] == 1.0  # end of warmup: the base lr
    assert lrs[4] == pytest.approx(6 / 7)
    assert lrs[10] == 0.0 and lrs[12] == 0.0  # zero at the end and beyond


def test_cosine_values():
    opt = _optimizer(lr=1.0)
    lrs = [g[0] for g in _lrs(get_scheduler("cosine", opt, 2, 12), opt, steps=12)]
    assert lrs[:3] == [0.0, 0.5, 1.0]
    assert lrs[7] == pytest.approx(0.5)  # half way through the decay
    assert lrs[12] == pytest.approx(0.0, abs=1e-15)
    opt = _optimizer(lr=1.0)
    sched = get_scheduler("cosine_with_min_lr", opt, 2, 12, {"min_lr": 0.1})
    lrs = [g[0] for g in _lrs(sched, opt, steps=12)]
    assert lrs[2] == 1.0 and lrs[12] == pytest.approx(0.1)


def test_name_may_be_a_str_enum():
    import transformers

    class Kind(str, enum.Enum):
        LINEAR = "linear"

    opt = _optimizer(lr=1.0)
    sched = get_scheduler(Kind.LINEAR, opt, 0, 4)
    assert _lrs(sched, opt, steps=2) == [[1.0, 0.5], [0.75, 0.375], [0.5, 0.25]]
    opt = _optimizer(lr=1.0)
    sched = get_scheduler(transformers.SchedulerType.COSINE, opt, 0, 2)
    assert _lrs(sched, opt, steps=1)[1][0] == pytest.approx(0.5)


@pytest.mark.parametrize(
    "name,warmup,total,error,match",
    [
        ("linear", None, 10, ValueError, "LINEAR requires `num_warmup_steps`"),
        ("cosine", 2, None, ValueError, "COSINE requires `num_training_steps`"),
        ("polynomial", 2, None, ValueError, "POLYNOMIAL requires `num_training_steps`"),
        ("constant_with_warmup", None, None, ValueError, "CONSTANT_WITH_WARMUP requires `num_warmup_steps`"),
        ("warmup_stable_decay", 2, 10, TypeError, "num_decay_steps"),
        ("cosine_with_min_lr", 2, 10, ValueError, "One of min_lr or min_lr_rate"),
    ],
)
def test_missing_settings_name_the_scheduler(name, warmup, total, error, match):
    with pytest.raises(error, match=match):
        get_scheduler(name, _optimizer(), warmup, total)


def test_schedulers_that_need_no_step_counts():
    opt = _optimizer(lr=1.0)
    assert _lrs(get_scheduler("constant", opt), opt, steps=2) == [[1.0, 0.5]] * 3
    plateau = get_scheduler("reduce_lr_on_plateau", _optimizer())
    assert isinstance(plateau, torch.optim.lr_scheduler.ReduceLROnPlateau)
    opt = _optimizer(lr=1.0)
    sched = get_scheduler("warmup_stable_decay", opt, 1, None, {"num_decay_steps": 2, "num_stable_steps": 1})
    assert [g[0] for g in _lrs(sched, opt, steps=5)] == pytest.approx([0.0, 1.0, 1.0, 0.5, 0.0, 0.0])


def test_unknown_scheduler_and_bad_kwargs():
    with pytest.raises(ValueError, match="cosin is not a valid SchedulerType") as err:
        get_scheduler("cosin", _optimizer(), 1, 10)
    for name in SCHEDULER_NAMES:
        assert repr(name) in str(err.value)
    with pytest.raises(TypeError, match="unexpected keyword argument 'num_cycles'"):
        get_scheduler("linear", _optimizer(), 1, 10, {"num_cycles": 2})
    with pytest.raises(ValueError, match="Unknown decay type: square"):
        get_scheduler("warmup_stable_decay", _optimizer(), 1, 10,
                      {"num_decay_steps": 2, "decay_type": "square"})
    with pytest.raises(ValueError, match="Only one of min_lr or min_lr_rate"):
        get_scheduler("cosine_with_min_lr", _optimizer(), 1, 10, {"min_lr": 0.1, "min_lr_rate": 0.1})
    with pytest.raises(ValueError, match="lr_end"):
        get_scheduler("polynomial", _optimizer(lr=1e-8), 1, 10)


def _save_load(obj, weights_only=True):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=weights_only)


@pytest.mark.parametrize("name,kwargs", [c for c in CASES if c[0] != "reduce_lr_on_plateau"][::3])
def test_scheduler_state_dict_round_trip(name, kwargs):
    opt = _optimizer(lr=1.0)
    sched = get_scheduler(name, opt, WARMUP, TOTAL, dict(kwargs))
    _lrs(sched, opt, steps=7)
    # The state dict holds plain values only, so the safe loader takes it ...
    state = _save_load(sched.state_dict(), weights_only=True)
    assert state["last_epoch"] == 7
    # ... and a scheduler rebuilt from the same arguments continues exactly where this one was.
    # Order matters, as in a resume: build optimizer and scheduler, then load the optimizer state (it holds
    # the current lr), then the scheduler state (the step count). Loading the scheduler state alone does
    # not reset the optimizer's lr: a fresh scheduler left it at the step-0 value.
    opt2 = _optimizer(lr=1.0)
    sched2 = get_scheduler(name, opt2, WARMUP, TOTAL, dict(kwargs))
    opt2.load_state_dict(opt.state_dict())
    sched2.load_state_dict(state)
    assert _lrs(sched2, opt2, steps=10) == _lrs(sched, opt, steps=10)
    # The whole scheduler pickles too (its multiplier is a partial of a module-level function).
    clone = pickle.loads(pickle.dumps(sched))
    assert clone.lr_lambdas[0](12) == sched.lr_lambdas[0](12)


def test_plateau_state_dict_round_trip():
    opt = _optimizer(lr=1.0)
    kwargs = {"patience": 0, "factor": 0.5}
    sched = get_scheduler("reduce_lr_on_plateau", opt, scheduler_specific_kwargs=kwargs)
    _lrs(sched, opt, steps=3, metrics=[1.0, 1.0, 1.0])
    assert opt.param_groups[0]["lr"] == 0.25
    state = _save_load(sched.state_dict(), weights_only=True)
    sched2 = get_scheduler("reduce_lr_on_plateau", _optimizer(lr=1.0))
    sched2.load_state_dict(state)
    assert sched2.best == 1.0 and sched2.factor == 0.5 and sched2.num_bad_epochs == sched.num_bad_epochs


def test_schedule_multiplier_is_finite_everywhere():
    # Degenerate step counts (no warmup, warmup == total) must not divide by zero.
    for name, kwargs in CASES:
        if name == "reduce_lr_on_plateau":
            continue
        for warmup, total in ((0, 5), (5, 5)):
            kw = dict(kwargs)
            if name == "warmup_stable_decay":
                kw = {"num_decay_steps": 0}
            opt = _optimizer(lr=1.0)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                sched = get_scheduler(name, opt, warmup, total, kw)
                if name == "polynomial" and warmup == total:
                    # transformers' polynomial decay divides by (total - warmup) at step == total, as the HF
                    # Trainer does: raytrainer takes the schedule as it is.
                    with pytest.raises(ZeroDivisionError):
                        _lrs(sched, opt, steps=7)
                    continue
                seq = _lrs(sched, opt, steps=7)
            assert all(math.isfinite(v) for lrs in seq for v in lrs), (name, warmup, total)


# --- the optimizer, its decay groups and the schedule: transformers.Trainer's --------------------------


class LlamaRMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class Net(nn.Module):
    """Norms under names transformers recognises (``layernorm``, ``norm``, ``_norm``) and under names it does
    not (``rms``, ``gn``, ``bn``), a bias-less attention, and a parameter the model owns itself."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(4, 8)
        self.input_layernorm = LlamaRMSNorm(8)
        self.ln = nn.LayerNorm(8)
        self.norm = nn.RMSNorm(8)
        self.post_norm = nn.GroupNorm(2, 8)
        self.rms = LlamaRMSNorm(8)
        self.bn = nn.BatchNorm1d(8)
        self.attn = nn.MultiheadAttention(8, 2)  # in_proj_weight, in_proj_bias, out_proj.{weight,bias}
        self.head = nn.Linear(8, 3)
        self.head_scale = nn.Parameter(torch.ones(3))

    def forward(self, x, labels=None):
        h = self.bn(self.rms(self.post_norm(self.norm(self.ln(self.input_layernorm(self.embed(x)))))))
        logits = self.head(h) * self.head_scale
        return nn.functional.cross_entropy(logits, labels), logits


# what transformers decays on Net: not biases, not nn.LayerNorm's parameters, not parameters whose name holds
# layernorm / rmsnorm / norm / _norm; other norms' weights (rms, bn) are decayed
DECAYED = ["embed.weight", "rms.weight", "bn.weight", "attn.in_proj_weight", "attn.out_proj.weight",
           "head.weight", "head_scale"]

_COMMON = dict(learning_rate=1e-2, weight_decay=0.1, adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-6,
               report_to="none", use_cpu=True)


def _both(tmp_path, **kw):
    """raytrainer's Trainer and transformers' on equal copies of Net, with the same arguments."""
    ours = Trainer(model=Net(), args=TrainingArguments(output_dir=str(tmp_path / "ours"), **_COMMON, **kw))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_args = transformers.TrainingArguments(output_dir=str(tmp_path / "hf"), **_COMMON, **kw)
        theirs = transformers.Trainer(model=Net(), args=hf_args)
    return ours, theirs


def _described(trainer):
    """The optimizer's class, each group's parameter names and settings, and its defaults."""
    opt = trainer.create_optimizer()
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    groups = [({k: v for k, v in g.items() if k != "params"}, [names[id(p)] for p in g["params"]])
              for g in opt.param_groups]
    return type(opt), groups, dict(opt.defaults)


def test_decay_parameter_names_are_transformers(tmp_path):
    ours, theirs = _both(tmp_path)
    names = ours.get_decay_parameter_names(ours.model)
    assert names == theirs.get_decay_parameter_names(theirs.model)
    # transformers also lists unset (None) parameter slots, e.g. MultiheadAttention's q/k/v_proj_weight
    assert sorted(set(names) & dict(ours.model.named_parameters()).keys()) == sorted(DECAYED)


@pytest.mark.parametrize("optim,optim_args", [
    ("adamw_torch", None),
    ("adamw_torch_fused", None),
    ("adafactor", None),
    ("sgd", "momentum=0.9,nesterov=true,dampening=0"),
    ("adagrad", "lr_decay=0.1,eps=1e-8"),
    ("rmsprop", "alpha=0.5,centered=true,momentum=0.1"),
    ("adamw_8bit", None),
    ("lion_32bit", None),
    ("rmsprop_bnb", None),  # transformers passes its optim_args on as strings (alpha="0.9" fails)
])
def test_create_optimizer_is_transformers(tmp_path, optim, optim_args):
    if "8bit" in optim or "lion" in optim or "bnb" in optim:
        pytest.importorskip("bitsandbytes")
    ours, theirs = _both(tmp_path, optim=optim, optim_args=optim_args)
    cls, groups, defaults = _described(ours)
    assert (cls, groups, defaults) == _described(theirs)
    assert sorted(groups[0][1]) == sorted(DECAYED)
    assert [g[0]["weight_decay"] for g in groups] == [0.1, 0.0]
    assert defaults["lr"] == 1e-2
    if optim == "adafactor":
        assert cls is transformers.optimization.Adafactor  # not torch's
        assert (defaults["scale_parameter"], defaults["relative_step"]) == (False, False)
    if optim == "sgd":
        assert (defaults["momentum"], defaults["nesterov"]) == (0.9, True)


def test_frozen_parameters_are_left_out_as_in_transformers(tmp_path):
    ours, theirs = _both(tmp_path)
    for trainer in (ours, theirs):
        trainer.model.head.bias.requires_grad_(False)
        trainer.model.embed.weight.requires_grad_(False)
    described = _described(ours)
    assert described == _described(theirs)
    assert "embed.weight" not in described[1][0][1] and "head.bias" not in described[1][1][1]


def test_optimizer_cls_and_kwargs_and_a_factory(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), **_COMMON)
    trainer = Trainer(model=Net(), args=args, optimizer_cls_and_kwargs=(torch.optim.SGD, {"lr": 0.5}))
    opt = trainer.create_optimizer()
    assert type(opt) is torch.optim.SGD and opt.defaults["lr"] == 0.5
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]

    seen = {}

    class Factory:  # not an Optimizer class: called with the model (transformers' Muon / Dion form)
        def __call__(self, model, lr):
            seen["model"] = model
            return torch.optim.SGD(model.parameters(), lr=lr)

    trainer = Trainer(model=Net(), args=args, optimizer_cls_and_kwargs=(Factory, {"lr": 0.25}))
    assert trainer.create_optimizer().defaults["lr"] == 0.25 and seen["model"] is trainer.model
    assert Trainer.get_optimizer_cls_and_kwargs is transformers.Trainer.get_optimizer_cls_and_kwargs


@pytest.mark.parametrize("schedule,warmup,kwargs", [
    ("linear", 3, None),
    ("cosine", 0.25, None),
    ("cosine_with_restarts", 2, {"num_cycles": 2}),
    ("cosine_with_min_lr", 0.1, {"min_lr_rate": 0.1}),
    ("warmup_stable_decay", 2, {"num_decay_steps": 5}),
    ("polynomial", 0, {"power": 2.0}),
])
def test_warmup_and_schedule_are_transformers(tmp_path, schedule, warmup, kwargs):
    total = 20
    ours, theirs = _both(tmp_path, lr_scheduler_type=schedule, warmup_steps=warmup,
                         lr_scheduler_kwargs=kwargs)
    assert ours.args.get_warmup_steps(total) == theirs.args.get_warmup_steps(total)
    sequences = []
    for trainer in (ours, theirs):
        opt = trainer.create_optimizer()
        sched = trainer.create_scheduler(num_training_steps=total, optimizer=opt)
        sequences.append(_lrs(sched, opt, steps=total))
    assert sequences[0] == sequences[1]
    warm = ours.args.get_warmup_steps(total)
    assert warm == (warmup if warmup >= 1 else math.ceil(total * warmup))
    if warm:
        assert sequences[0][0][0] == 0.0 and sequences[0][warm][0] == pytest.approx(1e-2)


# --- optim is checked on the driver -------------------------------------------------------------------


def test_every_transformers_optimizer_is_accepted_or_named(tmp_path):
    """Each of transformers' optimizers is accepted when its package is installed; otherwise refused with the
    package and the install command; LOMO and the XLA / NPU ones are refused with the reason."""
    for name in OptimizerNames:
        kw = {"optim_target_modules": ["head"]} if name.value.startswith(("galore", "apollo")) else {}
        try:
            TrainingArguments(output_dir=str(tmp_path), optim=name.value, report_to="none", **kw)
        except ValueError as err:
            message = str(err)
            assert message.startswith(f"optim={name.value!r}")
            assert ("package: pip install" in message and "workers' environment too" in message) or \
                name.value in ("lomo", "adalomo", "adamw_torch_xla", "adamw_torch_npu_fused"), message


@pytest.mark.parametrize("optim,package,install", [
    ("grokadamw", "grokadamw", "grokadamw"),
    ("schedule_free_adamw", "schedulefree", "schedulefree"),
    ("adamw_torch_4bit", "torchao", "torchao"),
    ("apollo_adamw", "apollo_torch", "apollo-torch"),
])
def test_a_missing_optimizer_package_is_refused_on_the_driver(tmp_path, optim, package, install):
    import importlib.util

    if importlib.util.find_spec(package) is not None:
        pytest.skip(f"{package} is installed")
    kw = {"optim_target_modules": ["head"]} if optim.startswith("apollo") else {}
    message = f"optim='{optim}' needs the {package} package: pip install {install} (in the workers' " \
              "environment too)"
    with pytest.raises(ValueError, match=re.escape(message)):
        TrainingArguments(output_dir=str(tmp_path), optim=optim, **kw)


def test_missing_bitsandbytes_is_refused(tmp_path, monkeypatch):
    from transformers.utils import import_utils

    monkeypatch.setattr(import_utils, "is_bitsandbytes_available", lambda *a: False)
    with pytest.raises(ValueError) as err:
        TrainingArguments(output_dir=str(tmp_path), optim="adamw_bnb_8bit")
    assert str(err.value) == ("optim='adamw_bnb_8bit' needs the bitsandbytes package: pip install "
                              "bitsandbytes (in the workers' environment too)")


def test_unknown_optim_lomo_and_bad_optim_args(tmp_path):
    with pytest.raises(ValueError, match="optim='adamw_apex': unknown value, must be one of 'adamw_torch'"):
        TrainingArguments(output_dir=str(tmp_path), optim="adamw_apex")
    with pytest.raises(ValueError, match="optim='lomo': updates the weights inside its own fused backward"):
        TrainingArguments(output_dir=str(tmp_path), optim="lomo")
    for bad in ("momentum", "eps=1e-6,", "a=b=c"):
        with pytest.raises(ValueError, match=f"optim_args={bad!r}: must read 'key=value,key=value'"):
            TrainingArguments(output_dir=str(tmp_path), optim="sgd", optim_args=bad)


# --- metric-driven schedulers in the loop -------------------------------------------------------------


def test_a_greedy_scheduler_steps_on_the_eval_metric(make_args, make_classifier, make_examples):
    """transformers' GreedyLR, like ReduceLROnPlateau, takes a metric: the loop steps it after each evaluation
    with eval_loss (a plain ``step()`` after an optimizer step would be a TypeError)."""
    from transformers.optimization import GreedyLR

    from raytrainer import Trainer

    train, _, _ = make_examples(8)
    evaluation, _, _ = make_examples(4, seed=1)
    model = make_classifier()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = GreedyLR(optimizer, patience=1, min_lr=1e-4, max_lr=1.0)
    metrics = []
    original_step = scheduler.step

    def recording_step(metric, epoch=None):
        metrics.append(metric)
        return original_step(metric, epoch)

    scheduler.step = recording_step
    args = make_args(per_device_train_batch_size=2, num_train_epochs=3, eval_strategy="epoch",
                     per_device_eval_batch_size=4)
    trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=evaluation,
                      optimizers=(optimizer, scheduler))
    trainer.train()
    assert trainer.state.global_step == 12
    eval_losses = [entry["eval_loss"] for entry in trainer.state.log_history if "eval_loss" in entry]
    assert len(eval_losses) == 3 and metrics == pytest.approx(eval_losses)
    assert scheduler.last_epoch == 3
