import enum
import io
import math
import pickle
import warnings
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from raytrainer.optim import (
    METRIC_SCHEDULERS,
    OPTIMIZER_NAMES,
    SCHEDULER_NAMES,
    create_optimizer,
    create_scheduler,
    get_decay_parameter_names,
    get_scheduler,
    parse_optim_args,
    warmup_steps_for,
)

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


def test_warmup_steps_for():
    ns = SimpleNamespace
    assert warmup_steps_for(ns(warmup_steps=5, warmup_ratio=0.5), 100) == 5  # steps win over the ratio
    assert warmup_steps_for(ns(warmup_steps=0.1, warmup_ratio=0.0), 25) == 3  # a float < 1 is a ratio
    assert warmup_steps_for(ns(warmup_steps=0, warmup_ratio=0.1), 25) == 3
    assert warmup_steps_for(ns(warmup_steps=0, warmup_ratio=0.0), 25) == 0
    assert warmup_steps_for(ns(), 25) == 0  # neither attribute
    with pytest.raises(ValueError, match="must be >= 0"):
        warmup_steps_for(ns(warmup_steps=-1, warmup_ratio=0.0), 25)


def test_create_scheduler_reads_args():
    args = SimpleNamespace(lr_scheduler_type="cosine_with_restarts", lr_scheduler_kwargs={"num_cycles": 2},
                           warmup_steps=0, warmup_ratio=0.1)
    opt = _optimizer(lr=1.0)
    seq = [g[0] for g in _lrs(create_scheduler(opt, args, 20), opt, steps=20)]
    # warmup = ceil(20 * 0.1) = 2; two cosine cycles over the 18 remaining steps.
    assert seq[:3] == [0.0, 0.5, 1.0]
    assert seq[11] == 1.0  # the restart: progress exactly 0.5 of two cycles
    assert seq[10] < 0.05 and seq[20] == 0.0
    # lr_scheduler_kwargs may arrive as a JSON string (as from a command line); None means no kwargs.
    args.lr_scheduler_kwargs = '{"num_cycles": 2}'
    opt = _optimizer(lr=1.0)
    assert [g[0] for g in _lrs(create_scheduler(opt, args, 20), opt, steps=20)] == seq
    args.lr_scheduler_type, args.lr_scheduler_kwargs = "linear", None
    assert isinstance(create_scheduler(_optimizer(), args, 20), torch.optim.lr_scheduler.LambdaLR)


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


# --- weight decay groups ------------------------------------------------------------------------------


class LlamaRMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class PreNorm(nn.Module):
    """A wrapper named like a norm that holds a sublayer: only its own norm parameters are excluded."""

    def __init__(self, dim):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))
        self.fn = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        return self.fn(x * self.scale)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.ln = nn.LayerNorm(8)
        self.rms = LlamaRMSNorm(8)
        self.torch_rms = nn.RMSNorm(8)
        self.gn = nn.GroupNorm(2, 8)
        self.bn = nn.BatchNorm1d(8)
        self.pre = PreNorm(8)
        self.attn = nn.MultiheadAttention(8, 2)  # in_proj_weight, in_proj_bias, out_proj.{weight,bias}
        self.head = nn.Linear(8, 3)
        self.head_scale = nn.Parameter(torch.ones(3))  # a parameter owned by the model itself

    def forward(self, x):
        h = self.pre(self.bn(self.gn(self.torch_rms(self.rms(self.ln(self.embed(x)))))))
        return self.head(h) * self.head_scale


DECAYED = ["head_scale", "embed.weight", "pre.fn.weight", "attn.in_proj_weight", "attn.out_proj.weight",
           "head.weight"]


def test_decay_parameter_names():
    model = Net()
    names = get_decay_parameter_names(model)
    assert sorted(names) == sorted(DECAYED)
    assert set(names) <= dict(model.named_parameters()).keys()


def _args(**kw):
    base = dict(optim="adamw_torch", optim_args=None, learning_rate=1e-2, weight_decay=0.1,
                adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-6)
    base.update(kw)
    return SimpleNamespace(**base)


def test_create_optimizer_groups():
    model = Net()
    model.head.bias.requires_grad_(False)
    model.pre.fn.weight.requires_grad_(False)
    opt = create_optimizer(model, _args())
    assert isinstance(opt, torch.optim.AdamW)
    by_id = {id(p): n for n, p in model.named_parameters()}
    decay, no_decay = ([by_id[id(p)] for p in g["params"]] for g in opt.param_groups)
    assert sorted(decay) == sorted(set(DECAYED) - {"pre.fn.weight"})
    assert sorted(no_decay) == sorted(
        n for n, p in model.named_parameters() if n not in DECAYED and n != "head.bias"
    )
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    d = opt.defaults
    assert (d["lr"], d["betas"], d["eps"], d["fused"]) == (1e-2, (0.8, 0.95), 1e-6, False)
    assert d["foreach"] is None  # torch picks


def test_create_optimizer_needs_trainable_params():
    model = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no parameter with requires_grad"):
        create_optimizer(model, _args())


def _small():
    # Well-conditioned gradients: in Net, a GroupNorm feeding a BatchNorm gets gradients near 1e-10,
    # below adam_epsilon, where fused and foreach AdamW legitimately round differently.
    return nn.Sequential(nn.Linear(4, 16), nn.LayerNorm(16), LlamaRMSNorm(16), nn.Tanh(), nn.Linear(16, 3))


def _train(optim, steps=5):
    torch.manual_seed(0)
    model = _small()
    opt = create_optimizer(model, _args(optim=optim))
    before = [p.detach().clone() for p in model.parameters()]
    for i in range(steps):
        torch.manual_seed(100 + i)
        x = torch.randn(6, 4)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    return opt, before, [p.detach().clone() for p in model.parameters()]


def test_fused_adamw_on_cpu_matches_unfused():
    fused_opt, before, fused = _train("adamw_torch_fused")
    plain_opt, before2, plain = _train("adamw_torch")
    assert fused_opt.defaults["fused"] is True and plain_opt.defaults["fused"] is False
    assert all(torch.equal(a, b) for a, b in zip(before, before2))
    assert any(not torch.equal(a, b) for a, b in zip(before, fused))  # it did step
    for a, b in zip(fused, plain):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("optim,cls", [("sgd", torch.optim.SGD), ("adagrad", torch.optim.Adagrad),
                                       ("rmsprop", torch.optim.RMSprop)])
def test_other_optimizers(optim, cls):
    opt = create_optimizer(Net(), _args(optim=optim))
    assert type(opt) is cls and opt.defaults["lr"] == 1e-2
    assert "betas" not in opt.defaults


def test_optim_enum_and_unknown_optim():
    class OptimizerNames(str, enum.Enum):
        SGD = "sgd"

    assert isinstance(create_optimizer(Net(), _args(optim=OptimizerNames.SGD)), torch.optim.SGD)
    with pytest.raises(ValueError, match="Unknown optim 'adamw_apex'") as err:
        create_optimizer(Net(), _args(optim="adamw_apex"))
    for name in OPTIMIZER_NAMES:
        assert repr(name) in str(err.value)


def test_parse_optim_args():
    assert parse_optim_args(None) == {} and parse_optim_args("") == {}
    parsed = parse_optim_args("momentum=0.9, nesterov=true,dampening=0,foreach=None,centered=False,mode=max")
    assert parsed == {"momentum": 0.9, "nesterov": True, "dampening": 0, "foreach": None, "centered": False,
                      "mode": "max"}
    assert type(parsed["dampening"]) is int and type(parsed["momentum"]) is float
    assert parse_optim_args("eps=1e-6,") == {"eps": 1e-6}
    assert parse_optim_args({"lr_decay": 0.1}) == {"lr_decay": 0.1}
    with pytest.raises(ValueError, match="k1=v1,k2=v2"):
        parse_optim_args("momentum")


def test_optim_args_reach_the_optimizer():
    opt = create_optimizer(Net(), _args(optim="sgd", optim_args="momentum=0.9,nesterov=true"))
    assert opt.defaults["momentum"] == 0.9 and opt.defaults["nesterov"] is True
    opt = create_optimizer(Net(), _args(optim_args="amsgrad=true,eps=1e-5"))
    assert opt.defaults["amsgrad"] is True and opt.defaults["eps"] == 1e-5  # optim_args win over adam_epsilon
    opt = create_optimizer(Net(), _args(optim="rmsprop", optim_args="alpha=0.5,centered=true"))
    assert (opt.defaults["alpha"], opt.defaults["centered"]) == (0.5, True)
    with pytest.raises(TypeError, match=r"optim 'sgd' does not accept \['betas1'\]"):
        create_optimizer(Net(), _args(optim="sgd", optim_args="betas1=0.9"))


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
