"""``Seq2SeqTrainer`` and ``Seq2SeqTrainingArguments``: transformers' names, defaults and semantics, on Ray.

With ``predict_with_generate``, ``evaluate()`` and ``predict()`` generate on every rank for its own shard of
the data (the evaluation loop's sharding); each rank pads its sequences to the generation's ``max_length``
with the pad token, as transformers does, and the loop gathers them to rank 0 in dataset order, padding any
remaining difference in length with -100 (transformers' padding index across processes). So
``compute_metrics`` receives the generated ids and the labels exactly as transformers gives them, and the
examples' ``tokenizer.batch_decode`` + BLEU / ROUGE code runs unchanged.

Strategies whose forward gathers sharded parameters (FSDP, DeepSpeed ZeRO-3: ``Strategy.gathers_in_forward``)
generate with ``synced_gpus=True``: every rank keeps calling the model until the longest sequence of any rank
ends, so the collectives inside each forward line up. ``generate`` runs in ``Strategy.generation_context``:
under FSDP the root unit's parameters (the shared embedding) are gathered for the call, since ``generate``
calls the encoder and decoder directly and never the root's forward.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

import torch
import transformers

from raytrainer.args import RayArgumentsMixin
from raytrainer.trainer import Trainer


@dataclasses.dataclass(repr=False)
class Seq2SeqTrainingArguments(RayArgumentsMixin, transformers.Seq2SeqTrainingArguments):
    """transformers' ``Seq2SeqTrainingArguments`` with raytrainer's Ray fields (``RayArgumentsMixin``)."""

    def __post_init__(self) -> None:
        for name in ("generation_max_length", "generation_num_beams"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}={value!r}: must be a positive integer or None; pass e.g. "
                                 f"--{name} 64")
        if isinstance(self.generation_config, os.PathLike):
            self.generation_config = os.fspath(self.generation_config)
        super().__post_init__()


class Seq2SeqTrainer(Trainer):
    """transformers' ``Seq2SeqTrainer``: ``evaluate`` / ``predict`` take ``max_length``, ``num_beams`` and any
    other ``generate`` argument, and generate when ``args.predict_with_generate`` is set."""

    _args_class = Seq2SeqTrainingArguments
    loss_per_batch = True  # eval_loss: its batches' mean, as transformers' (worker/evaluation.py)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if getattr(self.args, "generation_config", None) is not None and self.model is not None:
            self.model.generation_config = self.load_generation_config(self.args.generation_config)

    @staticmethod
    def load_generation_config(gen_config_arg):
        """transformers' own: a ``GenerationConfig`` (copied), a folder or file of one, or a model id,
        validated strictly (imported when called: transformers' trainer module is slow to import)."""
        from transformers.trainer_seq2seq import Seq2SeqTrainer as HFSeq2SeqTrainer

        return HFSeq2SeqTrainer.load_generation_config(gen_config_arg)

    def _begin_generation(self, gen_kwargs: dict) -> None:
        """On a rank, before evaluate() / predict() runs its batches: the call's generation arguments, and the
        model's generation config settled once (``_settled_generation_config``)."""
        self._gen_kwargs = self._generation_kwargs(gen_kwargs)
        if getattr(self.args, "predict_with_generate", False) and self.model is not None:
            _settled_generation_config(self.model)

    def _generation_kwargs(self, gen_kwargs: dict) -> dict:
        gen_kwargs = dict(gen_kwargs)
        max_length = getattr(self.args, "generation_max_length", None)
        num_beams = getattr(self.args, "generation_num_beams", None)
        if gen_kwargs.get("max_length") is None and gen_kwargs.get("max_new_tokens") is None and max_length:
            gen_kwargs["max_length"] = max_length
        if gen_kwargs.get("num_beams") is None and num_beams is not None:
            gen_kwargs["num_beams"] = num_beams
        return gen_kwargs

    def evaluate(self, eval_dataset=None, ignore_keys: list[str] | None = None,
                 metric_key_prefix: str = "eval", **gen_kwargs) -> dict[str, float]:
        if not self._on_rank:
            return self._dispatch("evaluate", eval_dataset=eval_dataset, ignore_keys=ignore_keys,
                                  metric_key_prefix=metric_key_prefix, **gen_kwargs)
        self._begin_generation(gen_kwargs)
        return super().evaluate(eval_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)

    def predict(self, test_dataset, ignore_keys: list[str] | None = None, metric_key_prefix: str = "test",
                **gen_kwargs):
        if not self._on_rank:
            return self._dispatch("predict", test_dataset=test_dataset, ignore_keys=ignore_keys,
                                  metric_key_prefix=metric_key_prefix, **gen_kwargs)
        self._begin_generation(gen_kwargs)
        return super().predict(test_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)

    def prediction_step(self, model, inputs, prediction_loss_only: bool, ignore_keys: list[str] | None = None,
                        **gen_kwargs):
        if not getattr(self.args, "predict_with_generate", False) or prediction_loss_only:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        has_labels = "labels" in inputs
        inputs = self._prepare_inputs(inputs)
        if not gen_kwargs:
            gen_kwargs = dict(getattr(self, "_gen_kwargs", {}))
        for name in ("num_beams", "max_length"):
            if name in gen_kwargs and gen_kwargs[name] is None:
                gen_kwargs.pop(name)
        strategy = self._strategy
        gen_kwargs.setdefault("synced_gpus", bool(strategy is not None and strategy.gathers_in_forward
                                                  and self.args.world_size > 1))
        generation_inputs = inputs
        decoder_ids = inputs.get("decoder_input_ids")
        if has_labels and decoder_ids is not None and inputs["labels"].shape == decoder_ids.shape:
            # decoder_input_ids made from the labels: generation must not be fed the answer
            generation_inputs = {k: v for k, v in inputs.items()
                                 if k not in ("decoder_input_ids", "decoder_attention_mask")}
        generator = self.model
        with torch.no_grad(), self._generating(generator):
            generated = generator.generate(**generation_inputs, **gen_kwargs)
        gen_config = _settled_generation_config(generator)
        target = _padded_length(generated.shape[-1], gen_config)
        if target is not None:
            generated = self._pad_tensors_to_max_len(generated, target)
        loss = None
        if has_labels:
            with torch.no_grad(), self.compute_loss_context_manager():
                outputs = model(**inputs)
            if self.label_smoother is not None:
                loss = self.label_smoother(outputs, inputs["labels"]).detach().mean()
            else:
                loss = (outputs["loss"] if isinstance(outputs, dict) else outputs[0]).detach().mean()
        if self.args.prediction_loss_only:
            return loss, None, None
        labels = None
        if has_labels:
            labels = inputs["labels"]
            label_target = _padded_length(labels.shape[-1], gen_config)
            if label_target is not None:
                labels = self._pad_tensors_to_max_len(labels, label_target)
        return loss, generated, labels

    @contextlib.contextmanager
    def _generating(self, model):
        """``generate()`` as transformers' Trainer runs it, on this rank's strategy. With bf16 / fp16 the
        model's own forward runs in autocast with fp32 outputs (accelerate wraps the prepared model's
        forward so): the decoder steps, which call that forward, autocast; the encoder, which ``generate``
        calls directly, does not -- the same ids as transformers'. The strategy's ``generation_context``
        (FSDP: gather the root unit's parameters) around the call."""
        strategy = self._strategy
        if strategy is None:
            yield
            return
        own = model.__dict__.get("forward")  # a forward set on the instance already (rare): put back after
        wrapped = strategy.precision.forward_in_autocast(model.forward)
        if wrapped is not None:
            model.forward = wrapped  # an instance attribute: the module's hooks still run around it
        try:
            with strategy.generation_context(model):
                yield
        finally:
            if wrapped is not None:
                model.__dict__.pop("forward", None)
                if own is not None:
                    model.forward = own

    # transformers' own: the processing class's pad (else eos) token, else the model config's pad token
    _pad_tensors_to_max_len = transformers.Seq2SeqTrainer._pad_tensors_to_max_len


def _settled_generation_config(model):
    """The model's generation config with its unset values filled with transformers' defaults, before the
    first ``generate``. transformers' Seq2SeqTrainer fills them after its first batch, so that batch alone
    (with ``max_length`` unset: ``20 + 1`` for an encoder-decoder) may run one token longer than every later
    one; on several ranks each rank's first batch would, and the ids would depend on the number of workers.
    Filled first, every batch of every rank generates as transformers' later batches do."""
    gen_config = model.generation_config
    if getattr(gen_config, "_from_model_config", False):
        gen_config._from_model_config = False
    if hasattr(gen_config, "_get_default_generation_params"):  # transformers 5: fill unset defaults
        gen_config.update(**gen_config._get_default_generation_params(), defaults_only=True)
    return gen_config


def _padded_length(length: int, gen_config) -> int | None:
    """The length transformers pads a batch of ``length`` generated ids (or labels) to, from the model's
    generation config: its ``max_length`` when shorter than that, else ``max_new_tokens + 1`` when shorter
    than that; None: left as it is."""
    max_length, max_new = getattr(gen_config, "max_length", None), getattr(gen_config, "max_new_tokens", None)
    if max_length is not None and length < max_length:
        return max_length
    if max_new is not None and length < max_new + 1:
        return max_new + 1
    return None
