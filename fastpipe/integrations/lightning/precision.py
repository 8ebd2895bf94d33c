"""``PipelinePrecision``: Lightning's fp32 precision plugin, clipping by the whole model's norm.

Lightning clips ``gradient_clip_val`` by norm through its precision plugin, with
``torch.nn.utils.clip_grad_norm_`` on the optimizer's parameters: on a rank of a
``DistributedPipe`` those are one stage's, so each rank would clip by its own stage's norm. This
plugin clips through the pipe (``pipe.clip_grad_norm_``: the norm over every stage, rank and
replica, each weight counted once), which equals torch's clipping of the plain model. Clipping
by value is element-wise, the same on any split, and stays Lightning's.
"""
from __future__ import annotations

from typing import Any, Callable, Union

from lightning.pytorch.plugins.precision import Precision
from torch.optim import Optimizer


class PipelinePrecision(Precision):
    """fp32 (``precision='32-true'``) for ``PipelineStrategy``; ``pipe`` gives the strategy's
    pipe when clipping."""

    def __init__(self, pipe: Callable[[], Any]) -> None:
        super().__init__()
        self._pipe = pipe

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        """Clip every gradient by the whole model's 2-norm, as torch clips the plain model's."""
        pipe = self._pipe()
        _check_covers(pipe, optimizer)
        pipe.clip_grad_norm_(float(clip_val))


def _check_covers(pipe: Any, optimizer: Optimizer) -> None:
    """The pipe clips all its gradients: the plain run clips the optimizer's parameters, the
    same set when the optimizer holds every parameter that has a gradient."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    outside = [name for name, p in pipe.named_parameters()
               if p.grad is not None and id(p) not in held]
    if outside:
        raise ValueError(f"gradient_clip_val clips by the norm of the optimizer's parameters, "
                         f"but {outside[:3]} have gradients and are not in the optimizer: give "
                         f"the optimizer every trained parameter of the model")
