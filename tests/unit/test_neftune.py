"""NEFTune in-process: noise on the input embeddings in train mode only, gone after training."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from raytrainer import Trainer, TrainerCallback, TrainingArguments

SEQ, DIM, ALPHA = 5, 8, 5.0


class TokenNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(20, DIM)
        self.head = nn.Linear(DIM, 2)

    def get_input_embeddings(self):  # what transformers' loop hooks the noise on
        return self.emb

    def forward(self, input_ids, labels=None):
        logits = self.head(self.emb(input_ids).mean(dim=1))
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


IDS = torch.arange(SEQ).unsqueeze(0)


class Probe(TrainerCallback):
    """During training: two train-mode lookups and one eval-mode lookup of the same ids."""

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == 1:
            clean = nn.functional.embedding(IDS, model.emb.weight).detach()
            model.train()
            self.noisy = [model.emb(IDS).detach() - clean for _ in range(2)]
            model.eval()
            self.eval_delta = (model.emb(IDS).detach() - clean).abs().max().item()
            model.train()


def data(n=16):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 20, (n, SEQ), generator=g)
    return [{"input_ids": ids[i], "labels": int(ids[i, 0] > 9)} for i in range(n)]


def test_noise_in_train_mode_only_and_removed_after(tmp_path):
    probe = Probe()
    model = TokenNet()
    trainer = Trainer(model=model, train_dataset=data(), callbacks=[probe],
                      args=TrainingArguments(output_dir=str(tmp_path), num_workers=0, max_steps=2,
                                             per_device_train_batch_size=4, save_strategy="no",
                                             disable_tqdm=True, neftune_noise_alpha=ALPHA))
    trainer.train()
    bound = ALPHA / (SEQ * DIM) ** 0.5
    first, second = probe.noisy
    assert 0 < first.abs().max().item() <= bound + 1e-6
    assert not torch.equal(first, second)  # fresh noise on every forward
    assert probe.eval_delta == 0.0  # no noise in eval mode
    # after training: no hook left, train-mode lookups are clean
    assert len(model.emb._forward_hooks) == 0 and not hasattr(model.emb, "neftune_noise_alpha")
    model.train()
    assert torch.equal(model.emb(IDS), nn.functional.embedding(IDS, model.emb.weight))


class NoEmbedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(SEQ, 2)

    def forward(self, input_ids, labels=None):
        logits = self.lin(input_ids.float())
        return {"loss": nn.functional.cross_entropy(logits, labels)}


class EmbeddingWithoutAccessor(nn.Module):
    """One nn.Embedding, but no get_input_embeddings()."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, DIM)
        self.head = nn.Linear(DIM, 2)

    def forward(self, input_ids, labels=None):
        logits = self.head(self.emb(input_ids).mean(dim=1))
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


@pytest.mark.parametrize("model_cls", [NoEmbedding, EmbeddingWithoutAccessor])
def test_neftune_without_input_embeddings_is_refused_before_training(tmp_path, model_cls):
    model = model_cls()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = Trainer(model=model, train_dataset=data(),
                      args=TrainingArguments(output_dir=str(tmp_path), num_workers=0, max_steps=2,
                                             save_strategy="no", neftune_noise_alpha=ALPHA))
    with pytest.raises(ValueError, match="neftune_noise_alpha needs the model's input embeddings"):
        trainer.train()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())  # refused before a step
    assert not (tmp_path / "checkpoint-1").exists()
