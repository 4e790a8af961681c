"""What transformers' language-modeling example scripts (run_clm.py, run_mlm.py) show and write, with
raytrainer in place of transformers.Trainer: the train metrics of a resumed run, ``log_metrics``' console
table, transformers' console lines for ``save_model()`` and ``max_steps``, and those lines on the main Ray
worker. In-process (num_workers=0, no Ray), a tiny GPT-2 built from a config.
"""

from __future__ import annotations

import logging

import pytest
import torch
import transformers.utils.logging as hf_logging
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.trainer_pt_utils import log_metrics as hf_log_metrics

from raytrainer import Trainer


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
    import cloudpickle

    from raytrainer.driver import spec as run_spec
    from raytrainer.worker.logs import rank_logging

    trainer = Trainer(model=_tiny_gpt2(), args=make_args())
    before = hf_logging.get_verbosity()
    channels = {}
    try:
        hf_logging.set_verbosity_info()  # the script, on the driver
        shipped = run_spec.build(trainer, "train", {})  # the call's spec carries the verbosity
        hf_logging.set_verbosity_warning()  # a fresh worker process: transformers' default verbosity
        for rank in (0, 1):
            worker = cloudpickle.loads(shipped.trainer)
            worker.args._set_process(2, rank, rank, 0, torch.device("cpu"))
            channels[rank] = _Channel()
            with rank_logging(worker.args, rank, channels[rank], shipped.transformers_log_level):
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
