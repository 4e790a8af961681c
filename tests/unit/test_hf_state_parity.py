"""One script, two trainers: a tiny GPT-2 with a tokenizer (built in memory, no download), trained and saved
by transformers.Trainer and by raytrainer (num_workers=0) with the same arguments. What a user reads back
must be the same: trainer_state.json (every logged loss, learning rate, eval figure, total_flos, the
stateful callbacks), the saved config.json (aligned with the tokenizer's special tokens) and the weights."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file

import raytrainer

TIMINGS = {"train_runtime", "train_samples_per_second", "train_steps_per_second", "eval_runtime",
           "eval_samples_per_second", "eval_steps_per_second"}


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(40)}
    vocab["<eos>"] = 40
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", bos_token="<eos>",
                                                pad_token="<eos>")


def gpt2():
    torch.manual_seed(0)  # the config's bos/eos (50256) differ from the tokenizer's (40): train() aligns them
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=41,
                                                                n_positions=16))


def blocks(n: int, seed: int) -> list[dict]:
    ids = torch.randint(0, 41, (n, 12), generator=torch.Generator().manual_seed(seed))
    return [{"input_ids": row, "attention_mask": torch.ones_like(row), "labels": row} for row in ids]


def run(module, out, **extra):
    args = module.TrainingArguments(output_dir=str(out), num_train_epochs=2, per_device_train_batch_size=4,
                                    per_device_eval_batch_size=3, learning_rate=5e-3, logging_steps=2,
                                    eval_strategy="epoch", save_strategy="no", report_to="none",
                                    disable_tqdm=True, seed=0, **extra)
    trainer = module.Trainer(model=gpt2(), args=args, train_dataset=blocks(20, 1), eval_dataset=blocks(9, 2),
                             processing_class=tokenizer())
    trainer.train()
    trainer.save_model()
    trainer.save_state()
    with open(out / "trainer_state.json") as f:
        state = json.load(f)
    with open(out / "config.json") as f:
        config = json.load(f)
    return state, config, load_file(out / "model.safetensors")


def test_trainer_state_config_and_weights_equal_transformers(tmp_path):
    ours = run(raytrainer, tmp_path / "ours", num_workers=0)
    theirs = run(transformers, tmp_path / "theirs", use_cpu=True)
    (state, config, weights), (ref_state, ref_config, ref_weights) = ours, theirs
    history = [{k: v for k, v in h.items() if k not in TIMINGS} for h in state.pop("log_history")]
    ref_history = [{k: v for k, v in h.items() if k not in TIMINGS} for h in ref_state.pop("log_history")]
    assert [h["learning_rate"] for h in history if "loss" in h] == pytest.approx(
        [h["learning_rate"] for h in ref_history if "loss" in h], rel=1e-12)  # the rate each step used
    evals = [h["eval_loss"] for h in history if "eval_loss" in h]
    assert evals == pytest.approx([h["eval_loss"] for h in ref_history if "eval_loss" in h], rel=1e-6)
    assert len(evals) == 2  # eval_loss counted as transformers counts it
    assert len(history) == len(ref_history) == 8  # 10 steps logged every 2, 2 evaluations, the summary
    for ours_entry, ref_entry in zip(history, ref_history):
        assert ours_entry.keys() == ref_entry.keys()
        assert ours_entry == pytest.approx(ref_entry, rel=1e-5)
    assert state == ref_state  # total_flos, stateful_callbacks, steps, batch size...
    assert state["total_flos"] > 0 and "TrainerControl" in state["stateful_callbacks"]
    assert config["eos_token_id"] == config["bos_token_id"] == 40  # the tokenizer's, as transformers
    assert config == ref_config
    assert weights.keys() == ref_weights.keys()
    for name in weights:
        torch.testing.assert_close(weights[name], ref_weights[name], rtol=1e-5, atol=1e-6)


def test_a_checkpoint_written_by_transformers_resumes(tmp_path, caplog):
    """transformers.Trainer's checkpoint-5 (no manifest; weights, optimizer.pt, scheduler.pt,
    trainer_state.json, a pickled rng_state.pth) resumes under raytrainer: the same steps, learning rates
    and final weights as transformers' uninterrupted run (no dropout, so the skipped RNG file changes
    nothing here); the pickled RNG file is skipped with a warning, never unpickled."""
    def model():
        torch.manual_seed(0)
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_embd=16, n_layer=1, n_head=2, vocab_size=41, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0))

    def trainer(module, out, **extra):
        args = module.TrainingArguments(output_dir=str(out), num_train_epochs=2, learning_rate=5e-3,
                                        per_device_train_batch_size=4, logging_steps=1, save_strategy="steps",
                                        save_steps=5, report_to="none", disable_tqdm=True, seed=0, **extra)
        return module.Trainer(model=model(), args=args, train_dataset=blocks(20, 1))

    theirs = trainer(transformers, tmp_path / "theirs", use_cpu=True)
    theirs.train()
    checkpoint = tmp_path / "theirs" / "checkpoint-5"
    assert (checkpoint / "rng_state.pth").exists() and not (checkpoint / "manifest.json").exists()

    ours = trainer(raytrainer, tmp_path / "ours", num_workers=0)
    with caplog.at_level("WARNING"):
        ours.train(resume_from_checkpoint=str(checkpoint))
    assert "was not written by raytrainer" in caplog.text
    if not issubclass(raytrainer.Trainer, transformers.Trainer):  # transformers' loop reads it as
        assert "rng_state.pth not restored: it is pickled" in caplog.text  # transformers does (safe loader)
    steps = [(h["step"], h["loss"], h["learning_rate"]) for h in ours.state.log_history if "loss" in h]
    ref = [(h["step"], h["loss"], h["learning_rate"]) for h in theirs.state.log_history if "loss" in h]
    assert [s for s, _, _ in steps] == list(range(1, 11))  # steps 1-5 from the checkpoint's state
    assert [lr for _, _, lr in steps] == pytest.approx([lr for _, _, lr in ref], rel=1e-12)  # scheduler
    assert [loss for _, loss, _ in steps] == pytest.approx([loss for _, loss, _ in ref], rel=1e-5)
    ref_weights = theirs.model.state_dict()
    for name, tensor in ours.model.state_dict().items():
        torch.testing.assert_close(tensor, ref_weights[name], rtol=1e-5, atol=1e-6)
