"""What transformers' language-modeling example scripts (run_clm.py, run_mlm.py) show and write, with
raytrainer in place of transformers.Trainer: the train metrics of a resumed run, ``log_metrics``' console
table, transformers' console lines for ``save_model()`` and ``max_steps``, and those lines on the main Ray
worker. In-process (num_workers=0, no Ray), a tiny GPT-2 built from a config.
"""

from __future__ import annotations

import collections
import logging

import pytest
import torch
import transformers.utils.logging as hf_logging
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.trainer_pt_utils import log_metrics as hf_log_metrics

from raytrainer import Trainer, TrainingArguments


def _tiny_gpt2(seed: int = 0) -> GPT2LMHeadModel:
    config = GPT2Config(vocab_size=40, n_embd=16, n_layer=1, n_head=2, n_positions=16)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return GPT2LMHeadModel(config)


def _blocks(n: int, length: int = 8) -> list[dict]:
    """run_clm.py's grouped blocks: input_ids with labels equal to them."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 40, (n, length), generator=g)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


@pytest.fixture
def hf_lines():
    """Messages logged on transformers' loggers (which do not propagate) while the test runs."""
    root = hf_logging.get_logger("transformers")
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield seen
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


def test_resumed_train_steps_per_second_counts_only_the_steps_this_call_ran(make_args, tmp_path):
    """transformers: num_steps = global_step - the resumed step (and samples likewise). A resume from step 4
    of 8 ran 4 steps; raytrainer counted all 8, doubling train_steps_per_second."""
    data = _blocks(32)
    args = make_args(max_steps=8, per_device_train_batch_size=2, save_strategy="steps", save_steps=4)
    Trainer(model=_tiny_gpt2(), args=args, train_dataset=data).train()
    resumed = Trainer(model=_tiny_gpt2(), args=args, train_dataset=data)
    m = resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4")).metrics
    runtime = m["train_runtime"]
    assert resumed.state.global_step == 8
    assert m["train_steps_per_second"] == pytest.approx(4 / runtime, rel=0.05, abs=0.01)
    assert m["train_samples_per_second"] == pytest.approx(4 * 2 / runtime, rel=0.05, abs=0.01)


@pytest.mark.parametrize("runtime", [2.999, 0.5, 3725.25])
def test_log_metrics_prints_the_table_transformers_prints(make_args, capsys, runtime):
    """The values right-aligned to the widest one (not a fixed 9), runtimes as transformers' h:mm:ss.hh
    with the hundredths truncated (2.999 s is 0:00:02.99, not 0:00:03.00)."""
    trainer = Trainer(model=_tiny_gpt2(), args=make_args())
    metrics = {"epoch": 0.14285714, "eval_loss": 10.46431, "perplexity": 35040.40981234,
               "eval_runtime": runtime, "eval_samples": 104, "total_flos": 3.0 * 2**30}
    hf_log_metrics(trainer, "eval", metrics)  # transformers' own function, with this trainer as its self
    expected = capsys.readouterr().out
    trainer.log_metrics("eval", metrics)
    assert capsys.readouterr().out == expected


def test_save_model_and_max_steps_log_transformers_lines(make_args, tmp_path, hf_lines):
    """run_clm.py's trainer.save_model() prints "Saving model checkpoint to <output_dir>" (transformers'
    _save), and a Trainer with max_steps says it overrides num_train_epochs, on transformers.trainer's
    logger."""
    out = tmp_path / "final"
    trainer = Trainer(model=_tiny_gpt2(), args=make_args(max_steps=2, per_device_train_batch_size=2),
                      train_dataset=_blocks(8))
    assert "max_steps is given, it will override any value given in num_train_epochs" in hf_lines
    trainer.save_model(str(out))
    assert f"Saving model checkpoint to {out}" in hf_lines
    assert (out / "model.safetensors").exists()


class _Channel:
    """What a rank's log routing sends to the driver's console (the worker side of driver/channel.py)."""

    def __init__(self):
        self.texts: list[str] = []

    def send(self, kind, payload, urgent=False):
        self.texts.append(payload.text)

    def flush(self):
        pass


def test_a_passive_log_level_gives_the_main_worker_the_drivers_transformers_verbosity(make_args, tmp_path):
    """run_clm.py calls transformers.logging.set_verbosity_info() where should_log (log_level stays passive):
    under torchrun rank 0 then prints transformers.Trainer's INFO lines ("***** Running training *****", the
    resume lines, "Saving model checkpoint to"). A Ray worker never runs the script, so it must take the
    driver's verbosity from the call: without it, a 2-worker run printed none of them. Replicas keep
    log_level_replica (warning)."""
    import copy

    from raytrainer.worker.logs import driver_transformers_level, rank_logging

    args = make_args()
    before = hf_logging.get_verbosity()
    channels = {}
    try:
        hf_logging.set_verbosity_info()  # the script, on the driver
        level = driver_transformers_level()  # what each call's spec carries to the ranks (both hosts)
        hf_logging.set_verbosity_warning()  # a fresh worker process: transformers' default verbosity
        for rank in (0, 1):
            worker_args = copy.deepcopy(args)
            worker_args._set_process(2, rank, rank, 0, torch.device("cpu"))
            channels[rank] = _Channel()
            with rank_logging(worker_args, rank, channels[rank], level):
                hf_logging.get_logger("transformers.trainer").info("***** Running training *****")
            assert hf_logging.get_verbosity() == logging.WARNING  # restored after the call
    finally:
        hf_logging.set_verbosity(before)
    assert any("***** Running training *****" in text for text in channels[0].texts)
    assert not any("***** Running training *****" in text for text in channels[1].texts)


def _word_tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(35)]
    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                                   cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")


def test_labels_made_by_the_data_collator_train_as_in_run_mlm(make_args):
    """run_mlm.py's examples have no labels: DataCollatorForLanguageModeling makes them (the masked tokens).
    The driver's check for a label column refused the run before it started; it looks at the collated
    batch now, as transformers, which never checks, would train."""
    from transformers import BertConfig, BertForMaskedLM, DataCollatorForLanguageModeling

    tokenizer = _word_tokenizer()
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=16)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = BertForMaskedLM(config)
    texts = [" ".join(f"w{(i * 7 + j) % 35}" for j in range(8)) for i in range(16)]
    data = [tokenizer(t, return_special_tokens_mask=True) for t in texts]  # input_ids, ..., no labels
    assert "labels" not in data[0]
    collator = DataCollatorForLanguageModeling(tokenizer=tokenizer, mlm_probability=0.5)
    trainer = Trainer(model=model, args=make_args(max_steps=2, per_device_train_batch_size=4),
                      train_dataset=data, data_collator=collator, processing_class=tokenizer)
    out = trainer.train()
    assert out.global_step == 2 and torch.isfinite(torch.tensor(out.training_loss))


def _padded_blocks(n: int) -> list[dict]:
    """Blocks with a padded tail (attention_mask 0) of varying length, so the two counts differ."""
    rows = _blocks(n)
    for i, row in enumerate(rows):
        mask = torch.ones(8, dtype=torch.long)
        mask[8 - i % 4:] = 0
        row["attention_mask"] = mask
    return rows


@pytest.mark.parametrize("count", ["all", "non_padding"])
def test_input_tokens_seen_are_counted_as_transformers_counts_them(make_args, tmp_path, count):
    """include_num_input_tokens_seen: raytrainer ignored it (no num_input_tokens_seen in any log). Each log
    now has the tokens seen so far, as transformers.Trainer's has, on the same model and data; with a rate of
    tokens per second, and the count carried through a resume."""
    import transformers

    data = _padded_blocks(24)
    common = dict(max_steps=6, per_device_train_batch_size=4, logging_steps=2, report_to="none",
                  disable_tqdm=True, include_num_input_tokens_seen=count, use_cpu=True)
    theirs = transformers.Trainer(model=_tiny_gpt2(), train_dataset=data, args=transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"), save_strategy="no", **common))
    theirs.train()
    ours = Trainer(model=_tiny_gpt2(), train_dataset=data, args=make_args(
        save_strategy="steps", save_steps=4, **common))
    ours.train()

    def seen(history):
        return [(e["step"], e["num_input_tokens_seen"]) for e in history if "loss" in e]

    expected = seen(theirs.state.log_history)
    per_step = 4 * 8 if count == "all" else sum(int(r["attention_mask"].sum()) for r in data[:4])
    assert expected[0] == (2, 2 * per_step if count == "all" else expected[0][1])  # what transformers counts
    assert seen(ours.state.log_history) == expected
    assert ours.state.num_input_tokens_seen == theirs.state.num_input_tokens_seen
    assert all(e["train_tokens_per_second"] > 0 for e in ours.state.log_history if "loss" in e)

    resumed = Trainer(model=_tiny_gpt2(), train_dataset=data, args=make_args(**common))
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    assert seen(resumed.state.log_history) == expected  # steps 2 and 4 from the checkpoint, 6 counted on


def test_an_unknown_token_count_is_named(tmp_path):
    from raytrainer import TrainingArguments

    with pytest.raises(ValueError, match="include_num_input_tokens_seen='yes': must be one of 'all', "
                                         "'non_padding', 'no'"):
        TrainingArguments(output_dir=str(tmp_path), include_num_input_tokens_seen="yes")


class _NoLossKwargsGPT2(GPT2LMHeadModel):
    """A model that says its forward does not normalise by num_items_in_batch (as transformers' Qwen2.5-VL
    and others do), though its forward takes **kwargs."""

    accepts_loss_kwargs = False


class _ScaledLossTrainerMixin:
    """A compute_loss of a subclass's own: a mean over its micro-batch, which it says is not scaled for
    gradient accumulation (the model itself would take num_items_in_batch)."""

    loss_is_scaled_for_ga = False

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        logits = model(input_ids=inputs["input_ids"]).logits[:, :-1]
        labels = inputs["labels"][:, 1:]
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _train_both(tmp_path, make_model, subclass=None, **overrides):
    """transformers.Trainer and raytrainer's on the same model, data and arguments: (theirs, ours)."""
    import transformers

    data = _padded_blocks(16)
    common = dict(max_steps=4, per_device_train_batch_size=2, gradient_accumulation_steps=2, logging_steps=1,
                  report_to="none", disable_tqdm=True, use_cpu=True, save_strategy="no")
    common.update(overrides)
    hf_cls = type("HF", (subclass, transformers.Trainer), {}) if subclass else transformers.Trainer
    rt_cls = type("RT", (subclass, Trainer), {}) if subclass else Trainer
    theirs = hf_cls(model=make_model(), train_dataset=data,
                    args=transformers.TrainingArguments(output_dir=str(tmp_path / "hf"), **common))
    theirs.train()
    ours = rt_cls(model=make_model(), train_dataset=data,
                  args=TrainingArguments(output_dir=str(tmp_path / "rt"), num_workers=0, **common))
    ours.train()
    return theirs, ours


def _losses(trainer) -> list[float]:
    return [e["loss"] for e in trainer.state.log_history if "loss" in e]


def _no_loss_kwargs_gpt2():
    config = GPT2Config(vocab_size=40, n_embd=16, n_layer=1, n_head=2, n_positions=16)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return _NoLossKwargsGPT2(config)


@pytest.mark.parametrize("case", ["label_smoothing", "accepts_loss_kwargs_false", "loss_is_scaled_for_ga"])
def test_the_step_s_loss_is_transformers_compute_loss(tmp_path, case):
    """Each case trained another loss than transformers.Trainer's: label smoothing on a causal LM did not
    shift the labels (a step's loss 7.06 against transformers' 3.23), a model whose ``accepts_loss_kwargs`` is
    False was given num_items_in_batch, and ``loss_is_scaled_for_ga=False`` on a subclass was not read (its
    micro-batch mean was not divided by the accumulation steps). The step's loss is transformers' own
    ``compute_loss`` now, scaled by its rule: the same losses and weights."""
    if case == "label_smoothing":
        theirs, ours = _train_both(tmp_path, _tiny_gpt2, label_smoothing_factor=0.1)
    elif case == "accepts_loss_kwargs_false":
        theirs, ours = _train_both(tmp_path, _no_loss_kwargs_gpt2)
        assert ours.model_accepts_loss_kwargs is False
    else:
        theirs, ours = _train_both(tmp_path, _tiny_gpt2, subclass=_ScaledLossTrainerMixin)
    assert _losses(ours) == pytest.approx(_losses(theirs), rel=1e-5)
    for (name, a), b in zip(theirs.model.state_dict().items(), ours.model.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)


def test_torch_empty_cache_steps_empties_the_cache_as_transformers_does(tmp_path, monkeypatch):
    """torch_empty_cache_steps was read by nothing. The device cache is now emptied on the micro-batches of
    every N-th step, as transformers' training_step does: as many calls of accelerate's function."""
    import accelerate.utils.memory as memory
    import transformers
    import transformers.trainer as hf_trainer_module

    calls = collections.Counter()
    real = memory.clear_device_cache
    running = ["transformers"]

    def counted(name):
        def clear(*args, **kwargs):
            calls[running[0], name] += 1
            return real(*args, **kwargs)
        return clear

    # transformers' training step calls the name its module imported (and accelerate's own code, once, the
    # name of accelerate's module); raytrainer's own loop, accelerate's
    monkeypatch.setattr(hf_trainer_module, "clear_device_cache", counted("step"))
    monkeypatch.setattr(memory, "clear_device_cache", counted("accelerate"))
    data = _padded_blocks(16)
    common = dict(max_steps=4, per_device_train_batch_size=2, gradient_accumulation_steps=2, report_to="none",
                  disable_tqdm=True, use_cpu=True, save_strategy="no", torch_empty_cache_steps=2)
    hf_args = transformers.TrainingArguments(output_dir=str(tmp_path / "hf"), **common)
    transformers.Trainer(model=_tiny_gpt2(), train_dataset=data, args=hf_args).train()
    running[0] = "raytrainer"
    Trainer(model=_tiny_gpt2(), train_dataset=data,
            args=TrainingArguments(output_dir=str(tmp_path / "rt"), num_workers=0, **common)).train()
    # steps 0 and 2 (global_step before the update), each on its 2 micro-batches
    assert calls["transformers", "step"] == 4
    if issubclass(Trainer, transformers.Trainer):  # transformers' loop: the same calls
        assert calls["raytrainer", "step"] == 4
        assert calls["raytrainer", "accelerate"] == calls["transformers", "accelerate"]
    else:
        assert calls["raytrainer", "accelerate"] == 4


def test_predictions_leave_out_the_models_cache_as_transformers_does(tmp_path):
    """With use_cache=True a transformers 5 model returns its cache under "cache"; transformers' prediction
    step leaves it out (keys_to_ignore_at_inference, else ["cache"]). raytrainer returned it as a second
    prediction, a DynamicCache in an object array, so compute_metrics got a tuple."""
    import transformers

    data = _padded_blocks(6)
    common = dict(report_to="none", disable_tqdm=True, use_cpu=True, use_cache=True, save_strategy="no")
    theirs = transformers.Trainer(model=_tiny_gpt2(), args=transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"), **common)).predict(data)
    ours = Trainer(model=_tiny_gpt2(), args=TrainingArguments(
        output_dir=str(tmp_path / "rt"), num_workers=0, **common)).predict(data)
    assert not isinstance(theirs.predictions, tuple) and not isinstance(ours.predictions, tuple)
    assert ours.predictions.shape == theirs.predictions.shape == (6, 8, 40)
    torch.testing.assert_close(torch.from_numpy(ours.predictions), torch.from_numpy(theirs.predictions))


def test_memory_metrics_are_where_transformers_puts_them(make_args):
    """skip_memory_metrics=False: the first train() also reports before_init_mem_cpu, and evaluate()
    returns its eval_mem_* figures without logging them (transformers stops its tracker after the log)."""
    data = _padded_blocks(8)
    trainer = Trainer(model=_tiny_gpt2(), train_dataset=data, eval_dataset=data,
                      args=make_args(max_steps=2, per_device_train_batch_size=4, skip_memory_metrics=False))
    train = trainer.train().metrics
    assert train["before_init_mem_cpu"] > 10_000_000  # a Python process with torch holds far more than 10 MB
    assert {"init_mem_cpu_alloc_delta", "train_mem_cpu_alloc_delta"} <= set(train)
    metrics = trainer.evaluate()
    assert "eval_mem_cpu_alloc_delta" in metrics and "eval_loss" in metrics
    logged = trainer.state.log_history[-1]
    assert "eval_loss" in logged and not any("_mem_" in key for key in logged)


@pytest.mark.parametrize("case", ["accumulation_past_the_epoch", "max_grad_norm_0"])
def test_logged_epoch_and_grad_norm_are_transformers(tmp_path, case):
    """Two logs differed from transformers.Trainer's: with 8 batches an epoch and 3 accumulated a step, the
    epoch after step 1 was 1/3 of the updates, where transformers logs 3/8 of the batches; and with
    max_grad_norm=0 no grad_norm was logged, where transformers measures it without clipping."""
    if case == "accumulation_past_the_epoch":
        overrides = dict(gradient_accumulation_steps=3, max_steps=-1, num_train_epochs=2,
                         per_device_train_batch_size=2)
    else:
        overrides = dict(max_grad_norm=0.0)
    theirs, ours = _train_both(tmp_path, _tiny_gpt2, **overrides)

    def logged(trainer):
        return [(e["step"], e["epoch"], e.get("grad_norm")) for e in trainer.state.log_history if "loss" in e]

    expected = logged(theirs)
    if case == "accumulation_past_the_epoch":
        assert [epoch for _, epoch, _ in expected] == [0.375, 0.75, 1.0, 1.375, 1.75, 2.0]
    assert all(norm is not None for _, _, norm in expected)
    assert [(s, e) for s, e, _ in logged(ours)] == [(s, e) for s, e, _ in expected]
    assert [n for _, _, n in logged(ours)] == pytest.approx([n for _, _, n in expected], rel=1e-5)


def test_a_prediction_with_no_whole_batch_returns_none_as_transformers(tmp_path):
    """dataloader_drop_last with fewer examples than a batch: transformers runs no batch and returns no
    predictions; raytrainer ran one batch of a dummy example and returned an empty (0, 8, 40) array."""
    import transformers

    common = dict(report_to="none", disable_tqdm=True, use_cpu=True, dataloader_drop_last=True,
                  per_device_eval_batch_size=8)
    data = _padded_blocks(6)
    theirs = transformers.Trainer(model=_tiny_gpt2(), args=transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"), **common)).predict(data)
    ours = Trainer(model=_tiny_gpt2(), args=TrainingArguments(
        output_dir=str(tmp_path / "rt"), num_workers=0, **common)).predict(data)
    assert theirs.predictions is None and ours.predictions is None
    assert theirs.label_ids is None and ours.label_ids is None
