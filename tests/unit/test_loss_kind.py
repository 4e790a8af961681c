"""A loss that is a mean and a loss divided by ``num_items_in_batch``, in one process (worker/loss.py): the
kind is found by asking the loss, and a mean trains and logs the same with any gradient accumulation as the
whole batch at once. The same on 2 workers: tests/integration/test_loss_scale.py."""

from __future__ import annotations

import copy
import inspect
import pickle

import pytest
import torch
import transformers
from two_ranks import run_two_ranks

from raytrainer import Trainer, TrainingArguments
from raytrainer.worker.loss import MEAN, NORMALISED, UNDECIDED, MeanLossForward, adapt_mean_losses


def bert(kind=transformers.BertForSequenceClassification, labels: int = 3):
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=32, max_position_embeddings=16,
                                     num_labels=labels, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    return kind(config)


def gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=40, n_positions=16,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def rows(n: int, per_token: bool = False) -> list[dict]:
    """Rows of 10 tokens; per token: labels on 3 to 10 of them (-100 on the rest), so batches count
    different numbers of labels."""
    out = []
    for i in range(n):
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(1, 40, (10,), generator=g)
        if per_token:
            real = int(torch.randint(3, 11, (1,), generator=g))
            labels = torch.where(torch.arange(10) < real, ids % 3, torch.full_like(ids, -100))
        else:
            labels = int(ids[0]) % 3
        out.append({"input_ids": ids, "labels": labels})
    return out


def history(tmp_path, build, batch: int, accumulation: int, **kw) -> list[tuple]:
    args = TrainingArguments(output_dir=str(tmp_path / f"{batch}x{accumulation}"), num_workers=0,
                             per_device_train_batch_size=batch, gradient_accumulation_steps=accumulation,
                             per_device_eval_batch_size=8, max_steps=4, logging_steps=1,
                             eval_strategy="steps", eval_steps=2, learning_rate=1e-2, optim="adamw_torch",
                             save_strategy="no", report_to="none", disable_tqdm=True, use_cpu=True)
    per_token = build.__name__ == "token_classifier"
    trainer = Trainer(model=build(), args=args, train_dataset=rows(64, per_token),
                      eval_dataset=rows(16, per_token), **kw)
    trainer.train()
    return [(h["step"], key, h[key]) for h in trainer.state.log_history
            for key in ("loss", "grad_norm", "eval_loss") if key in h]


def sequence_classifier():
    return bert()


def token_classifier():
    return bert(transformers.BertForTokenClassification)


def mean_cross_entropy(outputs, labels, num_items_in_batch=None):
    """A user's compute_loss_func that ignores the count: a mean."""
    logits = outputs["logits"]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


@pytest.mark.parametrize("build,loss_func", [(sequence_classifier, None), (token_classifier, None),
                                             (sequence_classifier, mean_cross_entropy)])
def test_a_mean_loss_logs_and_trains_the_same_with_gradient_accumulation(tmp_path, build, loss_func):
    """4 x 2 accumulation steps against 8 at once: every loss, grad_norm and eval_loss (transformers.Trainer
    logs the first two x2 for these models, its loss then being twice the batch's mean). Token classification
    counts different labels per micro-batch: the step's loss is the mean over all 8 rows' labels, not the
    mean of the two micro-batches' means."""
    kw = {"compute_loss_func": loss_func} if loss_func else {}
    whole, accumulated = history(tmp_path, build, 8, 1, **kw), history(tmp_path, build, 4, 2, **kw)
    assert [(s, k) for s, k, _ in whole] == [(s, k) for s, k, _ in accumulated] and len(whole) == 10
    for (step, key, mine), (_, _, theirs) in zip(accumulated, whole):
        assert mine == pytest.approx(theirs, rel=1e-5), (step, key)


def _adapted(model):
    """What a trainer gives adapt_mean_losses: its model, that it takes loss kwargs, no compute_loss_func."""
    adapt_mean_losses(type("T", (), {"model": model, "model_accepts_loss_kwargs": True,
                                     "compute_loss_func": None})())
    return model


def _asked(model, batch) -> int:
    _adapted(model)
    model.train()
    model(**batch, num_items_in_batch=torch.tensor(17))
    return model.forward.kind


def test_the_kind_of_loss_is_asked_of_the_model_and_the_adapted_model_keeps_its_identity():
    ids = torch.randint(1, 40, (4, 10), generator=torch.Generator().manual_seed(0))
    assert _asked(bert(), {"input_ids": ids, "labels": ids[:, 0] % 3}) == MEAN
    lm = gpt2()
    assert _asked(lm, {"input_ids": ids, "labels": ids}) == NORMALISED
    classifier = bert()
    _asked(classifier, {"input_ids": ids, "labels": ids[:, 0] % 3})
    # the asking left training mode as it was, module by module, and the model reads as before
    assert classifier.training and all(m.training for m in classifier.modules())
    unadapted = type(classifier).forward.__get__(classifier)
    assert inspect.signature(classifier.forward) == inspect.signature(unadapted)
    assert isinstance(vars(classifier)["forward"], MeanLossForward)
    # a mean is its share of the step's sum: 4 of 17 labels
    labels = ids[:, 0] % 3
    plain = unadapted(input_ids=ids, labels=labels).loss.detach()
    shared = classifier(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(17)).loss.detach()
    assert float(shared) == pytest.approx(float(plain) * 4 / 17, rel=1e-6)
    assert float(classifier(input_ids=ids, labels=labels).loss.detach()) == pytest.approx(float(plain))
    # a copy and a pickled model call their own weights
    for other in (copy.deepcopy(classifier), pickle.loads(pickle.dumps(classifier))):
        with torch.no_grad():
            other.classifier.weight.zero_()
            other.classifier.bias.zero_()
        logits = other(input_ids=ids, num_items_in_batch=torch.tensor(17)).logits
        assert torch.count_nonzero(logits) == 0
    assert torch.count_nonzero(classifier(input_ids=ids).logits) > 0


def _rank(rank: int, store_path: str, results) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"file://{store_path}")
    try:
        model = gpt2()
        ids = torch.randint(1, 40, (2, 10), generator=torch.Generator().manual_seed(rank))
        # an evaluation first: rank 0's batch has no label to count, so it cannot tell (0 either way)
        labels = torch.full_like(ids, -100) if rank == 0 else ids
        _adapted(model).eval()
        with torch.no_grad():
            model(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(9))
        asked = model.forward.kind
        # then training: every rank agrees, rank 1 too, whose answer was already NORMALISED
        model.train()
        loss = model(input_ids=ids, labels=ids, num_items_in_batch=torch.tensor(18)).loss
        loss.backward()
        results.put((rank, asked, model.forward.kind, model.forward.agreed))
    finally:
        dist.destroy_process_group()


def test_ranks_that_answered_differently_in_an_evaluation_agree_at_the_first_training_step(tmp_path):
    """An evaluation before training may leave one rank undecided (a batch of -100 labels) and another sure;
    the first training forward agrees on every rank (one all-reduce), none skipping it."""
    # a rank that skipped the all-reduce left the other waiting in it (then failing once its peer was gone)
    items = run_two_ranks(_rank, str(tmp_path / "store"))
    got = sorted(items)
    assert got == [(0, UNDECIDED, NORMALISED, True), (1, NORMALISED, NORMALISED, True)]
