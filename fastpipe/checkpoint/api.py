"""``save`` and ``load``: the steps of each, every check before the first change."""
from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any, Dict, Iterator, Optional, Tuple

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from .. import version
from ..parallel import optimizer_loads
from . import contents, data_only, directory as folder, restore, target as targets
from .errors import CheckpointError, CheckpointMismatchError, RngNotRestoredWarning
from .ranks import Ranks

PathLike = Any  # str or os.PathLike


def save(directory: PathLike, pipe: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
         scheduler: Optional[Any] = None, extra: Optional[Dict[str, Any]] = None, *,
         timeout: Optional[float] = None) -> str:
    """Save ``pipe``'s model state, ``optimizer``, ``scheduler``, ``extra`` (a dict of data:
    numbers, strings, bools, None, lists, tuples, dicts, tensors) and every rank's RNG states
    as a checkpoint in ``directory``; returns its absolute path.

    The entries are keyed by the plain model's names, so the checkpoint loads at any other
    layout and into the plain model. Atomic: the checkpoint counts (``load`` accepts it,
    ``latest`` finds it) only once every rank has written it. With a ``DistributedPipe``, every
    rank of the default process group calls ``save`` with the same ``directory``; with a
    ``Pipe`` or a plain module, one process does. ``directory`` must not hold a complete
    checkpoint (``FileExistsError``); what an interrupted save left there is replaced.
    """
    ranks = Ranks(pipe, timeout)
    problem = ranks.problem
    try:
        path = os.path.abspath(os.fspath(directory))
        t = targets.target(pipe, optimizer, scheduler)
        _check_extra(extra)
        if ranks.distributed and optimizer is not None:  # its groups must be this rank's
            optimizer_loads.watch(optimizer)
            optimizer_loads.check_groups(optimizer)
        refused = folder.refuse_existing(path)
        if refused is not None:
            raise FileExistsError(refused)
    except (TypeError, ValueError, FileExistsError) as error:
        problem = problem or error
    ranks.agree(problem, "the checks of a save", same=f"directory={directory!s}")
    _on_rank_0(ranks, lambda: folder.prepare(path), f"cannot write {path!r}",
               "the staging directory of a save")
    with _single(ranks):
        dcp.save(contents.to_save(t, extra, ranks.rank), checkpoint_id=folder.staging(path),
                 no_dist=not ranks.distributed)
    ranks.agree(None, "the end of every rank's writes")
    info = {"layout": targets.layout(pipe), "ranks": ranks.world,
            "optimizer": optimizer is not None, "scheduler": scheduler is not None,
            "extra": extra is not None, "fastpipe": version.__version__,
            "torch": torch.__version__}
    _on_rank_0(ranks, lambda: folder.commit(path, info),
               f"cannot complete the checkpoint {path!r}", "the completion of a save")
    return path


def load(directory: PathLike, pipe: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
         scheduler: Optional[Any] = None, *, timeout: Optional[float] = None,
         trust_pickled: bool = False) -> Dict[str, Any]:
    """Load a checkpoint of ``save`` into ``pipe`` (and ``optimizer``, ``scheduler``), at this
    layout whatever the saving one was; returns the saved ``extra`` (``{}`` if none).

    Everything is checked first, on every rank, and the ranks agree before anything changes:
    ``IncompleteCheckpointError`` for a save that did not finish, ``CheckpointMismatchError``
    for a checkpoint of another model (names it lacks or has in excess, other shapes, no
    optimizer or scheduler state, other optimizer groups), ``TypeError`` / ``ValueError`` for
    bad arguments. The RNG states are restored when the layout is the saving one, so dropout
    continues as if never stopped; at another layout they are left alone, with a
    ``RngNotRestoredWarning`` (on rank 0).

    The checkpoint is read as data (``data_only``): its metadata builds only
    ``torch.distributed.checkpoint``'s records, its entries only numbers, strings, containers
    and tensors; one that needs more (a scheduler whose state holds other objects, a forged
    file) raises ``UnsafeCheckpointError`` before anything changes. ``trust_pickled=True``
    unpickles such entries as ``torch.load(..., weights_only=False)`` does: only for a
    checkpoint you trust as you trust code.
    """
    ranks = Ranks(pipe, timeout)
    trust = _check_trust(trust_pickled, ranks)
    path = os.fspath(directory) if isinstance(directory, (str, os.PathLike)) else directory
    t, saved, marker = _checked_load(ranks, path, pipe, optimizer, scheduler, trust)
    same = marker["layout"] == targets.layout(pipe)
    extras = tuple(k for k, wanted in (("extra", marker.get("extra")),
                                       ("scheduler", scheduler is not None),
                                       (f"rng.{ranks.rank}", same)) if wanted)
    small = _read(ranks, path, restore.small_template(t, saved, extras), trust)
    hyper, problem = restore.hyperparameters(t, small)
    entries: Dict[str, Any] = {}
    try:
        entries = {k: contents.unpack(small[k], repr(k), trust) for k in extras}
    except CheckpointError as error:
        problem = problem or error
    ranks.agree(problem, "the optimizer groups and entries of a load")
    tensors = _read(ranks, path, restore.tensor_template(t, saved), trust)
    pipe.load_state_dict(tensors["model"])
    if optimizer is not None:
        restore.apply_optimizer(t, tensors, hyper)
    if scheduler is not None:
        scheduler.load_state_dict(entries["scheduler"])
    if same:
        contents.set_rng_state(entries[f"rng.{ranks.rank}"])
    elif ranks.rank == 0:
        warnings.warn(f"the checkpoint {path!r} was saved at another layout "
                      f"({marker['layout']}): the random number generators keep their state, "
                      f"so dropout will not draw what the saving run would have; the model, "
                      f"optimizer and scheduler are restored exactly", RngNotRestoredWarning,
                      stacklevel=2)
    return entries["extra"] if marker.get("extra") else {}


def _check_trust(trust_pickled: Any, ranks: Ranks) -> bool:
    if not isinstance(trust_pickled, bool):
        ranks.problem = ranks.problem or TypeError(
            f"trust_pickled must be True or False, got {type(trust_pickled).__name__}")
        return False
    return trust_pickled


def _checked_load(ranks: Ranks, path: Any, pipe: nn.Module, optimizer: Any, scheduler: Any,
                  trust: bool) -> Tuple[targets.Target, restore.Saved, Dict[str, Any]]:
    """The arguments, the checkpoint's completeness and its entries against the model, the
    optimizer and the scheduler, on every rank; raises on all ranks if any rank found a
    problem."""
    problem = ranks.problem
    try:
        if not isinstance(path, str):
            raise TypeError(f"directory must be a path, got {type(path).__name__}")
        t = targets.target(pipe, optimizer, scheduler)
        if ranks.distributed and optimizer is not None:  # later loads into it checked too
            optimizer_loads.watch(optimizer)
        marker = folder.read_marker(path)
        saved = restore.Saved(data_only.reader(path, trust).read_metadata(), t.names)
        problem = (problem or restore.model_problem(t, saved)
                   or restore.optimizer_problem(t, saved, marker)
                   or _scheduler_problem(scheduler, marker))
    except (TypeError, ValueError, OSError) as error:
        problem = problem or error
    ranks.agree(problem, "the checks of a load", same=f"directory={path!s}")
    held = ranks.union(restore.holds(t, saved), "the model entries every rank holds")
    problem = restore.excess(saved, held)  # the same on every rank
    if problem is not None:
        raise problem
    return t, saved, marker


def _read(ranks: Ranks, path: str, template: Dict[str, Any], trust: bool) -> Dict[str, Any]:
    """``template`` filled from the checkpoint, as data unless ``trust`` (a collective on a
    ``DistributedPipe``: every rank raises what any rank's read refused)."""
    try:
        with _single(ranks):
            dcp.load(template, storage_reader=data_only.reader(path, trust),
                     planner=data_only.planner(trust), no_dist=not ranks.distributed)
    except CheckpointException as error:
        refused = [(r, e) for r, (e, _) in sorted(error.failures.items())
                   if isinstance(e, data_only.UnsafeCheckpointError)]
        if refused:
            raise data_only.UnsafeCheckpointError(f"rank {refused[0][0]}: {refused[0][1]}") \
                from None
        raise
    return template


def _on_rank_0(ranks: Ranks, action: Any, failure: str, what: str) -> None:
    """Run a file-system step on rank 0; every rank raises if it failed."""
    problem = None
    if ranks.rank == 0:
        try:
            action()
        except OSError as error:
            problem = CheckpointError(f"{failure}: {error}")
    ranks.agree(problem, what)


@contextlib.contextmanager
def _single(ranks: Ranks) -> Iterator[None]:
    """One process: torch.distributed.checkpoint's notice that it runs without a process
    group says what is meant here."""
    with warnings.catch_warnings():
        if not ranks.distributed:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _check_extra(extra: Any) -> None:
    if extra is None:
        return
    if not isinstance(extra, dict):
        raise TypeError(f"extra must be a dict (e.g. {{'step': 300}}) or None, got "
                        f"{type(extra).__name__}")
    contents.check_extra(extra)


def _scheduler_problem(scheduler: Any, marker: Dict[str, Any]) -> Optional[CheckpointError]:
    if scheduler is not None and not marker.get("scheduler"):
        return CheckpointMismatchError("scheduler given, but the checkpoint was saved without "
                                       "one; load with scheduler=None")
    return None
