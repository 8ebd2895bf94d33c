"""Lightning's checkpoints of a ``DistributedPipe``: ``fastpipe.checkpoint`` directories.

Each rank holds its stages' share of the model and of the optimizer, so a checkpoint is the
directory ``fastpipe.checkpoint.save`` writes from every rank (the model and the optimizer under
the plain model's names, each rank's random number generators), with the rest of Lightning's
checkpoint (epoch, loops, callbacks, schedulers, hyper-parameters) as its ``extra``. It loads
at any layout, into the plain model too (``fastpipe.checkpoint.load(path, module.model)``).
A path that holds a complete checkpoint is replaced (``ModelCheckpoint``'s ``last.ckpt``): the
old one is removed first, so a save cut short leaves none there. A ``Pipe``'s checkpoints are
Lightning's own files (its module holds the plain model, every parameter under its name).
"""
from __future__ import annotations

import os
import shutil
from typing import Any, Dict, Optional

from lightning.pytorch.trainer.states import TrainerFn

from ... import checkpoint

MODEL, OPTIMIZERS = "state_dict", "optimizer_states"


def save(path: str, pipe: Any, optimizer: Optional[Any], contents: Dict[str, Any],
         rank: int, barrier: Any) -> None:
    """Every rank's part of Lightning's checkpoint ``contents`` into the directory ``path``."""
    extra = {k: v for k, v in contents.items() if k not in (MODEL, OPTIMIZERS)}
    keeps_optimizer = OPTIMIZERS in contents  # not with ModelCheckpoint(save_weights_only=True)
    if os.path.isfile(path):  # every rank sees it (checkpoints need a shared file system)
        raise FileExistsError(f"{path!r} is a file (a single-process checkpoint); a "
                              f"DistributedPipe saves a directory there: choose another path")
    if rank == 0 and checkpoint.is_complete(path):
        shutil.rmtree(path)
    barrier("fastpipe checkpoint replaced")
    checkpoint.save(path, pipe, optimizer if keeps_optimizer else None, extra=extra)


def load(path: str, pipe: Any, optimizer: Optional[Any]) -> Dict[str, Any]:
    """Load the model (and ``optimizer``) in place; Lightning's other contents, returned."""
    extra = checkpoint.load(os.fspath(path), pipe, optimizer)
    return dict(extra)


class Checkpointing:
    """``PipelineStrategy``'s checkpoints (mixed into the strategy): Lightning's own file for a
    ``Pipe``, a ``fastpipe.checkpoint`` directory for a ``DistributedPipe``; restored after
    setup, once the pipe and its optimizer exist."""

    _options: Any

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """After setup: the pipe (and its optimizer) must exist to load into."""
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        """A ``Pipe``'s optimizer state is Lightning's own; a ``DistributedPipe``'s is loaded
        with the model, from every rank's share."""
        return self._options.in_process

    def lightning_module_state_dict(self) -> Dict[str, Any]:
        return super().lightning_module_state_dict() if self._options.in_process else {}

    def optimizer_state(self, optimizer: Any) -> Dict[str, Any]:
        return super().optimizer_state(optimizer) if self._options.in_process else {}

    def save_checkpoint(self, checkpoint: Dict[str, Any], filepath: Any,
                        storage_options: Optional[Any] = None) -> None:
        if self._options.in_process:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if storage_options is not None:
            raise TypeError("PipelineStrategy.save_checkpoint(storage_options=...) is not "
                            "supported on several ranks: fastpipe.checkpoint writes them")
        save(os.fspath(filepath), self.pipe, self._optimizer(), checkpoint, self.global_rank,
             self.barrier)
        return None

    def load_checkpoint(self, checkpoint_path: Any,
                        weights_only: Optional[bool] = None) -> Dict[str, Any]:
        if self._options.in_process:
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        module = self.lightning_module
        fitting = module is not None and module.trainer.state.fn == TrainerFn.FITTING
        return load(os.fspath(checkpoint_path), self.pipe, self._optimizer() if fitting else None)

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        if self._options.in_process:  # else loaded by load_checkpoint
            super().load_model_state_dict(checkpoint, strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Each state goes to its parameter's device (torch's ``load_state_dict``); the stages
        stay where the pipe placed them."""
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            optimizer.load_state_dict(state)

    def _optimizer(self) -> Optional[Any]:
        return self.optimizers[0] if self.optimizers else None

