"""Scatter a nested batch into micro-batches and gather micro-batch outputs back.

Pure tensor bookkeeping with ``torch.utils._pytree``: tensors (with a batch dimension) are split
along dim 0 with ``torch.chunk`` semantics; every other leaf is passed to every micro-batch.
Outputs come back by ``fastpipe.outputs``' rules (per-sample leaves concatenated, a loss
weighted by what each micro-batch's mean is over).
"""
from __future__ import annotations

import logging
from typing import Any, Callable, List, Optional, Sequence, Set, Tuple

import torch
from torch.utils import _pytree as pytree

from .outputs import OutputRules, combine

_log = logging.getLogger("fastpipe")
_told: Set[Tuple[int, int, int]] = set()


def _is_batched(leaf: Any) -> bool:
    return isinstance(leaf, torch.Tensor) and leaf.dim() >= 1


def batch_size(inputs: Any, *, argument: str = "inputs") -> int:
    """The common size of dim 0 of every batched tensor in ``inputs``.

    Raises ``ValueError`` naming ``argument`` when there is no batched tensor or when the
    tensors disagree on their batch size.
    """
    if isinstance(inputs, torch.Tensor) and inputs.dim() >= 1:
        return inputs.shape[0]  # the common case, without the pytree walk
    leaves, _ = pytree.tree_flatten_with_path(inputs)
    sizes = {pytree.keystr(path): leaf.shape[0] for path, leaf in leaves if _is_batched(leaf)}
    if not sizes:
        raise ValueError(
            f"{argument} holds no tensor with a batch dimension; pass a tensor (or a nested "
            f"tuple/list/dict of tensors) whose dim 0 is the batch")
    if len(set(sizes.values())) > 1:
        listing = ", ".join(f"{argument}{path or ''}: {size}" for path, size in sizes.items())
        raise ValueError(
            f"the tensors in {argument} have different batch sizes ({listing}); every tensor "
            f"must have the same size in dim 0")
    return next(iter(sizes.values()))


def split_sizes(total: int, chunks: int, *, argument: str = "inputs") -> List[int]:
    """Micro-batch sizes for ``total`` samples in ``chunks`` pieces, as ``torch.chunk`` makes them.

    Every piece but the last has ``ceil(total / chunks)`` samples, so there may be fewer pieces
    than ``chunks`` (5 samples in 4 chunks give 2, 2, 1; 3 samples in 4 chunks give 1, 1, 1).
    """
    if chunks < 1:
        raise ValueError(f"chunks must be at least 1, got {chunks}")
    if total < 1:
        raise ValueError(f"the batch in {argument} is empty; pass at least one sample")
    step = -(-total // min(chunks, total))
    sizes = [step] * (total // step)
    if total % step:
        sizes.append(total % step)
    return sizes


def fitted_sizes(total: int, chunks: int, accepts: Callable[[int], bool], *,
                 argument: str = "inputs") -> List[int]:
    """:func:`split_sizes`, unless the schedule cannot run that many micro-batches (an
    interleaved schedule given a short last batch): then the split of the largest smaller
    ``chunks`` whose micro-batch count it accepts, logged once per case. ``ValueError`` when
    none fits."""
    sizes = split_sizes(total, chunks, argument=argument)
    if accepts(len(sizes)):
        return sizes
    for fewer in range(min(chunks, total) - 1, 0, -1):
        fitted = split_sizes(total, fewer, argument=argument)
        if accepts(len(fitted)):
            if (total, chunks, len(fitted)) not in _told:
                _told.add((total, chunks, len(fitted)))
                _log.info("a batch of %d samples in chunks=%d gives %d micro-batches, which the "
                          "schedule cannot run; running %d micro-batches instead", total, chunks,
                          len(sizes), len(fitted))
            return fitted
    raise ValueError(f"the schedule cannot run any micro-batch count for the batch of {total} "
                     f"samples in {argument}; use another schedule or a larger batch")


def scatter(inputs: Any, sizes: Sequence[int]) -> List[Any]:
    """Split ``inputs`` into micro-batches of the given sizes (along dim 0 of each tensor)."""
    leaves, spec = pytree.tree_flatten(inputs)
    columns = [list(torch.split(leaf, list(sizes))) if _is_batched(leaf) else [leaf] * len(sizes)
               for leaf in leaves]
    return [pytree.tree_unflatten([column[i] for column in columns], spec)
            for i in range(len(sizes))]


def gather(outputs: Sequence[Any], sizes: Optional[Sequence[int]] = None,
           rules: Optional[OutputRules] = None,
           inputs: Optional[Callable[[], List[Any]]] = None) -> Any:
    """The batch's output from its micro-batches' (same structure each): per-sample tensors
    concatenated along dim 0, other leaves (a loss inside the output) combined by their rule
    (``fastpipe.outputs``: ``sizes`` are the micro-batches' sample counts, ``inputs()`` their
    named inputs); a leaf without a rule is an ``OutputReductionError`` naming it and the
    ``output_reduction`` option."""
    return combine(outputs, sizes, rules, inputs)
