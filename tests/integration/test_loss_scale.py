"""The loss and its gradient do not depend on the number of workers or on gradient accumulation, for a model
whose loss is a mean (BERT's sequence classifier: its forward takes ``**kwargs`` but ignores
``num_items_in_batch``) and for one that divides by it (GPT-2's causal LM, padded rows of different lengths),
with raytrainer's Trainer and with transformers' own (``on_ray(transformers.Trainer)``).

Each case is 2 workers x 4 and 2 workers x 2 x 2 accumulation steps against transformers.Trainer in this
process with a batch of 8 (where transformers is right): every logged loss, grad_norm and eval_loss within
1e-5 relative. No dropout (each rank would draw its own mask); the data order is the same for one process
and two ranks (each step's global batch holds the same rows). Under transformers' own accounting the mean
loss came out x2 (the workers) and x2 again (the accumulation steps).
"""

from __future__ import annotations

import pytest
import torch
import transformers

import raytrainer

STEPS = 6


def bert_classifier():
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=64, max_position_embeddings=32,
                                     num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.BertForSequenceClassification(config)


def gpt2_lm():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50, n_positions=32,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def rows(n: int, causal: bool, offset: int = 0) -> list[dict]:
    """Rows of 12 tokens; for the causal LM 4 to 12 of them real (the rest padding, labels -100), so the
    label counts of the ranks and micro-batches differ."""
    out = []
    for i in range(offset, offset + n):
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(1, 50, (12,), generator=g)
        if not causal:
            out.append({"input_ids": ids, "attention_mask": torch.ones(12, dtype=torch.long),
                        "labels": int(ids[0]) % 3})
            continue
        real = int(torch.randint(4, 13, (1,), generator=g))
        mask = (torch.arange(12) < real).long()
        out.append({"input_ids": ids * mask, "attention_mask": mask,
                    "labels": torch.where(mask.bool(), ids, torch.full_like(ids, -100))})
    return out


def logged(history: list[dict]) -> list[tuple]:
    keys = ("loss", "grad_norm", "eval_loss")
    return [(h["step"], key, h[key]) for h in history for key in keys if key in h]


def run(trainer_cls, args_cls, tmp_path, name: str, build, causal: bool, batch: int, accumulation: int,
        **ray):
    args = args_cls(output_dir=str(tmp_path / name), per_device_train_batch_size=batch,
                    gradient_accumulation_steps=accumulation, per_device_eval_batch_size=4, max_steps=STEPS,
                    logging_steps=1, eval_strategy="steps", eval_steps=3, learning_rate=1e-3,
                    optim="adamw_torch", save_strategy="no", report_to="none", use_cpu=True,
                    disable_tqdm=True, **ray)
    trainer = trainer_cls(model=build(), args=args, train_dataset=rows(96, causal),
                          eval_dataset=rows(16, causal, offset=1000))
    trainer.train()
    history = logged(trainer.state.log_history)
    if ray:
        trainer.end() if hasattr(trainer, "end") else trainer.close()
    return history


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("model", "host"), [
    ("bert-classifier", "raytrainer"), ("bert-classifier", "hosted"),
    ("gpt2-lm", "raytrainer"), ("gpt2-lm", "hosted")])
def test_two_workers_log_one_process_loss_grad_norm_and_eval_loss(tmp_path, host, model):
    build, causal = {"bert-classifier": (bert_classifier, False), "gpt2-lm": (gpt2_lm, True)}[model]
    one = run(transformers.Trainer, transformers.TrainingArguments, tmp_path, "one", build, causal, 8, 1)
    assert len(one) == 2 * STEPS + 2  # a loss and a grad_norm per step, two evaluations
    if host == "raytrainer":
        trainer_cls, args_cls = raytrainer.Trainer, raytrainer.TrainingArguments
    else:
        trainer_cls = raytrainer.on_ray(transformers.Trainer)
        args_cls = raytrainer.config_on_ray(transformers.TrainingArguments)
    for batch, accumulation in ((4, 1), (2, 2)):
        two = run(trainer_cls, args_cls, tmp_path, f"two-{batch}x{accumulation}", build, causal, batch,
                  accumulation, num_workers=2)
        assert [(step, key) for step, key, _ in two] == [(step, key) for step, key, _ in one]
        for (step, key, mine), (_, _, theirs) in zip(two, one):
            assert mine == pytest.approx(theirs, rel=1e-5), (batch, accumulation, step, key, two, one)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
def test_a_mean_loss_under_a_sharding_strategy_logs_one_process_loss(tmp_path, strategy):
    """The question asked of the model (two extra forwards on the first batch) runs on sharded engines too:
    FSDP2 and ZeRO-3 on 2 workers x 2 x 2 accumulation steps against one process."""
    from models import STRATEGY_ARGS

    one = run(transformers.Trainer, transformers.TrainingArguments, tmp_path, "one", bert_classifier, False,
              8, 1)
    two = run(raytrainer.Trainer, raytrainer.TrainingArguments, tmp_path, "two", bert_classifier, False, 2, 2,
              num_workers=2, **STRATEGY_ARGS[strategy])
    assert [(step, key) for step, key, _ in two] == [(step, key) for step, key, _ in one]
    for (step, key, mine), (_, _, theirs) in zip(two, one):
        assert mine == pytest.approx(theirs, rel=1e-5), (step, key, two, one)
