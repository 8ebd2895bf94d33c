"""Distributed cases: the blocking reads of device buffers a training step makes on the host.

``pipe.last_step.host_reads`` counts every read a rank made on its host of a buffer that lives
on its device (on a GPU, each one makes the host wait for the device): its transport's and the
close of the step's. The grouped transport reads none, on any step (the first, a repeated one,
a new batch size, a new sequence length), and keeps losses and token counts on the device; the
close reads once when the host must decide (the non-finite check of ``nonfinite='raise'``,
clipping, and on the last stage's rank the check of count tensors), and never otherwise. The
tagged transport reads every header it receives. Every step is exact against the plain model.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from dist_common import TOL, WIDTH, DistributedPipe, check_grads
from dist_pipeline_cases import seq_loss, seq_model
from host_read_probe import raw_reads, unexplained
from torch import nn

# (batch, sequence length) per step: repeats, then a new batch size, then a new length
STEPS: Tuple[Tuple[int, int], ...] = ((8, 5), (8, 5), (8, 5), (12, 5), (12, 5), (12, 7), (12, 7))
CLIP = 0.05  # below every step's gradient norm here: the gradients are clipped

# train_step's settings per case: the default, (loss_sum, count) losses, clipping, no check
SETTINGS: Dict[str, Dict[str, Any]] = {
    "default": {},
    "tokens": {"tokens": True},
    "ignore": {"nonfinite": "ignore"},
    "ignore tokens": {"tokens": True, "nonfinite": "ignore"},
    "clip": {"max_grad_norm": CLIP, "nonfinite": "ignore"},
    "clip tokens": {"tokens": True, "max_grad_norm": CLIP},
}


def host_reads(schedule: str = "1f1b", steps: Sequence[Sequence[int]] = STEPS) -> Dict:
    """Every rank's ``last_step.host_reads`` per step, for each setting on the grouped
    transport and the default on the tagged one (exact steps); and whether this rank holds
    the last stage."""
    out: Dict[str, Any] = {"unexplained": {}}
    for name, settings in SETTINGS.items():
        with raw_reads() as found:
            out[f"grouped {name}"], out["last"] = _reads("grouped", schedule, steps, **settings)
        out["unexplained"][name] = unexplained(found)  # conversions the counter did not see
    out["tagged default"], _ = _reads("tagged", schedule, steps)
    return out


def _reads(p2p: str, schedule: str, steps: Sequence[Sequence[int]], tokens: bool = False,
           **settings: Any) -> Tuple[List[int], bool]:
    """The reads per step, and whether this rank holds the last stage."""
    plain = seq_model()
    pipe = DistributedPipe(seq_model(), chunks=4, schedule=schedule, balance=[3, 3], timeout=30,
                           p2p=p2p)
    reads = []
    for step, (batch, length) in enumerate(steps):
        _step_matches(plain, pipe, step, batch, length, tokens, f"{p2p} {settings} ",
                      settings.get("max_grad_norm"), settings.get("nonfinite", "raise"))
        reads.append(pipe.last_step.host_reads)
    return reads, len(pipe.balance) - 1 in pipe.stages


def token_loss(out: torch.Tensor, targets: Tuple[torch.Tensor, torch.Tensor]) -> tuple:
    """``(loss_sum, count)``: the squared errors of the counted positions, and their count (a
    tensor, as ``mask.sum()`` gives)."""
    y, mask = targets
    return ((out.mean(1) - y) ** 2 * mask).sum(), mask.sum()


def _step_matches(plain: nn.Module, pipe: DistributedPipe, step: int, batch: int, length: int,
                  tokens: bool, label: str, max_norm: Optional[float], nonfinite: str) -> None:
    """One training step of ``pipe`` gives the loss, gradients (clipped by ``max_norm``) and
    gradient norm of ``plain`` looping over the same 4 micro-batches (sequences of
    ``length``; a mean loss weighted by size, or ``(loss_sum, count)`` token means)."""
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(batch, length, WIDTH, generator=g), torch.randn(batch, 4, generator=g)
    mask = (torch.rand(batch, 4, generator=g) < 0.6).float()
    mask[0, 0] = 1.0  # at least one counted position
    sizes = [len(c) for c in torch.chunk(torch.arange(batch), 4)]
    plain.zero_grad(set_to_none=True)
    parts = zip(x.split(sizes), y.split(sizes), mask.split(sizes))
    if tokens:
        ref_loss = sum(token_loss(plain(xi), (yi, mi))[0] for xi, yi, mi in parts) / mask.sum()
    else:
        ref_loss = sum(seq_loss(plain(xi), yi) * (len(xi) / batch) for xi, yi, _ in parts)
    ref_loss.backward()
    norm = (torch.nn.utils.clip_grad_norm_(plain.parameters(), max_norm)
            if max_norm is not None else None)
    ref = {n: p.grad.clone() for n, p in plain.named_parameters()}
    pipe.zero_grad(set_to_none=True)
    loss = pipe.train_step(x, (y, mask) if tokens else y, token_loss if tokens else seq_loss,
                           max_grad_norm=max_norm, nonfinite=nonfinite)
    torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
    check_grads(pipe, ref, f"{label}step {step} (batch {batch}, length {length})")
    if norm is not None:
        assert norm > max_norm, f"{label}step {step}: the norm {norm} does not clip"
        torch.testing.assert_close(pipe.last_step.grad_norm, norm.item(), **TOL)


def refused_count(p2p: str = "grouped") -> Dict:
    """A count tensor that is not a count (micro-batch 2's mask weighs its positions 0.3, so
    its sum is no whole number) stays on the device until the close: the last stage's rank
    refuses the step there with ``LossFunctionError``, its gradients put back; every other
    rank stops in the same call, naming it."""
    pipe = DistributedPipe(seq_model(), chunks=4, balance=[3, 3], timeout=30, p2p=p2p)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 5, WIDTH, generator=g), torch.randn(8, 4, generator=g)
    mask = torch.ones(8, 4)
    mask[4:6] = 0.3  # micro-batch 2 of 4
    try:
        pipe.train_step(x, (y, mask), token_loss)
    except Exception as error:  # noqa: BLE001 - reported to the test
        return {"error": type(error).__name__, "message": str(error),
                "untouched": all(p.grad is None for p in pipe.parameters())}
    return {"error": None}
