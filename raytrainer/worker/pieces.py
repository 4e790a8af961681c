"""What a checkpoint holds, piece by piece.

Each piece is a file of ``checkpoint-<step>/`` and an object with ``state_dict()`` / ``load_state_dict()``
(torch's and Composer's ``Stateful``): the optimizer (through the strategy, which may consolidate it with a
collective), the LR scheduler, the gradient scaler, the trainer state and each rank's RNG state. The
checkpoint writer snapshots every piece the same way and the resume loads every piece the same way; a new
kind of state is one more entry in ``training_pieces``, not a change to the writer.

The model's weights (``save_model_files``: safetensors, config, sharding index) and a sharded strategy's own
folder (``Strategy.save_sharded``) are written by their owners: their files are not one state dict each.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from raytrainer.checkpoint import restore_rng_state, rng_state_bytes
from raytrainer.saving import TRAINER_STATE_NAME


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


@dataclass
class Piece:
    file: str  #: its name in checkpoint-<step>/; the suffix says how it is stored (.pt, .json, .safetensors)
    obj: Stateful
    every_rank: bool = False  #: each rank writes its own (else the ranks that write the model's files)
    collective: bool = False  #: ``state_dict()`` is a collective: every rank calls it, in the same order

    def write(self, state: Any, folder: str) -> bool:
        """Store ``state`` (what ``state_dict()`` returned) in ``folder``; False for an empty state (nothing
        written, as a scaler-less run writes no scaler.pt)."""
        if state is None or (isinstance(state, dict) and not state):
            return False
        path = os.path.join(folder, self.file)
        if self.file.endswith(".pt"):
            torch.save(state, path)
        elif isinstance(state, bytes):
            with open(path, "wb") as f:
                f.write(state)
        else:
            with open(path, "w") as f:
                f.write(state if isinstance(state, str) else json.dumps(state))
        return True

    def read(self, reader) -> Any:
        """The stored state, read (and verified against the manifest) from a CheckpointReader."""
        if self.file.endswith(".pt"):
            return reader.torch_state(self.file)
        if self.file.endswith(".json"):
            return reader.json(self.file)
        return reader.read(self.file)

    def load(self, reader) -> bool:
        """Load the stored state into ``obj``; False when the checkpoint has no such file."""
        if not reader.has(self.file):
            return False
        self.obj.load_state_dict(self.read(reader))
        return True


class OptimizerState:
    """The optimizer's state as the strategy consolidates it into one file (a collective for FSDP)."""

    def __init__(self, strategy, model, optimizer):
        self.strategy, self.model, self.optimizer = strategy, model, optimizer

    def state_dict(self) -> dict:
        return self.strategy.optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state: dict) -> None:
        self.strategy.load_optimizer_state_dict(self.model, self.optimizer, state)


class TrainerStateFile:
    """``trainer_state.json``: the run's progress and its callbacks' exported state. Loaded first, on its
    own (``Resume.state``): the loop needs the step before it builds the rest."""

    def __init__(self, state):
        self.state = state

    def state_dict(self) -> str:
        from raytrainer.callbacks import state_to_json

        return state_to_json(self.state)

    def load_state_dict(self, state) -> None:
        raise TypeError("trainer_state.json is read by Resume, before the pieces that depend on its step")


class RngState:
    """This rank's random generators (Python, numpy, torch CPU and device), as safetensors bytes."""

    def state_dict(self) -> bytes:
        return rng_state_bytes()

    def load_state_dict(self, state: bytes) -> None:
        restore_rng_state(state)


def rng_file(rank: int) -> str:
    return f"rng_state_{rank}.safetensors"


def optimizer_pieces(strategy, model, optimizer, scheduler, consolidated: bool) -> list[Piece]:
    """The optimizer-side pieces, in the order a resume loads them (the scheduler after its optimizer).
    ``consolidated``: with optimizer.pt (a strategy that keeps its optimizer state in a folder of its own,
    ``sharded_state_dir``, saves none)."""
    pieces = ([Piece("optimizer.pt", OptimizerState(strategy, model, optimizer), collective=True)]
              if consolidated else [])
    return [*pieces, Piece("scheduler.pt", scheduler), Piece("scaler.pt", strategy.precision)]


def training_pieces(strategy, model, optimizer, scheduler, state, rank: int,
                    model_only: bool = False) -> list[Piece]:
    """Everything a checkpoint holds besides the model's files and the strategy's own folder;
    ``model_only`` (``save_only_model``): the trainer state alone, as transformers saves then."""
    progress = Piece(TRAINER_STATE_NAME, TrainerStateFile(state))
    if model_only:
        return [progress]
    consolidated = strategy.sharded_state_dir is None
    return [*optimizer_pieces(strategy, model, optimizer, scheduler, consolidated), progress,
            Piece(rng_file(rank), RngState(), every_rank=True)]
