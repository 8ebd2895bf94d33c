"""``GPipe``: torchgpipe's front door, so a torchgpipe program runs after changing its imports.

A thin front over :class:`fastpipe.Pipe` (the same pipeline, GPipe schedule): torchgpipe's
constructor (``balance`` second, the rest keyword-only), its list-typed ``balance`` and
``devices``, and the ``nn.Sequential`` behaviour of a torchgpipe ``GPipe`` (``len``, indexing,
iteration over the layers). Parameter and state-dict names are the plain module's, as in
``Pipe``. torchgpipe's argument rules come along: ``str(checkpoint)``, a whole float as
``chunks``, its error texts (with fastpipe's advice after them), and an empty ``nn.Sequential``
with ``balance=[]``, which runs as the identity.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Union

import torch
from torch import nn
from torch.utils import _pytree as pytree

from .frontdoor import Blueprint, parse_layout
from .outputs import OutputRules
from .pipe import Pipe
from .placement import Device, check_balance
from .policies.checkpoint import MODES

__all__ = ["GPipe"]


class GPipe(Pipe):
    """torchgpipe's ``GPipe(module, balance, *, devices, chunks, checkpoint,
    deferred_batch_norm)`` on fastpipe's pipeline.

    Args:
        module: an ``nn.Sequential`` to split; an empty one with ``balance=[]`` runs as the
            identity (no partition, no device), as in torchgpipe.
        balance: layers per partition (torchgpipe requires it; here ``None`` balances by
            parameter count, one partition per device). A wrong one is a ``ValueError``
            pointing to ``fastpipe.balance``.
        devices: one device per partition (default: the CUDA devices, or the CPU); devices
            beyond ``len(balance)`` are left unused, as in torchgpipe.
        chunks: micro-batches per mini-batch.
        checkpoint: ``'always'``, ``'except_last'`` or ``'never'`` (and fastpipe's other modes),
            read as ``str(checkpoint)``.
        deferred_batch_norm: batch-norm running statistics updated once per mini-batch.
        options: further keyword arguments of :class:`fastpipe.Pipe` (``schedule``,
            ``timeout``, ...), for programs that outgrow torchgpipe.
    """

    def __init__(self, module: nn.Sequential, balance: Optional[Iterable[int]] = None, *,
                 devices: Optional[Sequence[Device]] = None, chunks: int = 1,
                 checkpoint: str = "except_last", deferred_batch_norm: bool = False,
                 **options: Any) -> None:
        checkpoint = _checkpoint_mode(checkpoint)
        if isinstance(module, nn.Sequential) and len(module) == 0:
            self._begin_identity(module, balance, chunks, checkpoint, deferred_batch_norm,
                                 options)
            return
        if balance is not None and not isinstance(balance, (str, bytes)):
            balance = list(balance)
            if isinstance(module, nn.Sequential) and not options.keys() & TRACING_OPTIONS:
                _check_balance(balance, module)
            devices = _devices_for(devices, len(balance))
        super().__init__(module, chunks=chunks, devices=devices, balance=balance,
                         checkpoint=checkpoint, deferred_batch_norm=deferred_batch_norm,
                         **options)

    def _begin_identity(self, module: nn.Sequential, balance: Optional[Iterable[int]],
                        chunks: Any, checkpoint: str, deferred_batch_norm: bool,
                        options: Dict[str, Any]) -> None:
        """An empty ``nn.Sequential`` with ``balance=[]``: no stage, no device; ``forward``
        returns its input as it is (torchgpipe's rule)."""
        if balance is None:
            raise ValueError(recommend_auto_balance(
                "balance is required: an empty nn.Sequential has no layers to balance; pass "
                "balance=[] to run it as the identity"))
        if list(balance):
            raise ValueError(recommend_auto_balance(
                f"module and sum of balance have different length (module: 0, balance: "
                f"{list(balance)}); an empty nn.Sequential takes balance=[]"))
        if options:
            raise TypeError(f"an empty nn.Sequential runs as the identity, without stages, so "
                            f"{sorted(options)} do not apply to it; leave them out")
        layout = parse_layout(chunks, checkpoint, "gpipe", None, 300.0, deferred_batch_norm)
        super(Pipe, self).__init__()  # nn.Module's set-up, without Pipe's plan
        self._begin(Blueprint(layout=layout, module=module, traced=None, stages=(), skips={},
                              ties=(), physical=(), placement=(), chunks=layout.chunks,
                              schedule=None, output_rules=OutputRules({}, {})),  # type: ignore
                    _devices=(), _traced=(None, None))
        self._keep(_partitions=nn.ModuleList(), _stages=[], _workers=None, _pipedream=None,
                   _driver=None)
        self.module = module

    @property
    def balance(self) -> List[int]:  # type: ignore[override]
        """Layers per partition, as a list."""
        return list(self.layout.balance)

    @property
    def devices(self) -> List[torch.device]:  # type: ignore[override]
        """Device of each partition, as a list."""
        return list(self._devices)

    # ---------------------------------------------------------------- nn.Sequential behaviour
    def __len__(self) -> int:
        """The number of layers (over all partitions)."""
        return len(self.module)

    def __getitem__(self, index: int) -> nn.Module:
        """The layer at ``index`` of the original ``nn.Sequential`` (negative counts back)."""
        if isinstance(index, slice) or isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"GPipe indices are ints (a layer), got {index!r}")
        return self.module[index]

    def __iter__(self) -> Iterator[nn.Module]:
        """The layers, in order."""
        return iter(self.module)

    def __repr__(self) -> str:
        return (f"GPipe(balance={self.balance}, devices={[str(d) for d in self._devices]}, "
                f"chunks={self._chunks}, checkpoint={self.checkpoint!r})")

    # ---------------------------------------------------------------- an empty GPipe
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The pipeline's forward (see ``Pipe``); an empty ``GPipe`` returns its input as it
        is, which must hold a tensor, as torchgpipe requires."""
        if self._stages:
            return super().forward(*args, **kwargs)
        if kwargs or len(args) != 1:
            raise TypeError(f"an empty GPipe takes one input (a tensor or tensors), got "
                            f"{len(args)} positional and {len(kwargs)} keyword inputs")
        if not any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(args[0])):
            raise TypeError(f"GPipe's input must be a tensor or tensors (a tuple, list or dict "
                            f"of them), got {type(args[0]).__name__}")
        return args[0]

    def train_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """``Pipe.train_step``; not on an empty ``GPipe``, which has no layers to train."""
        if not self._stages:
            raise NotImplementedError("train_step on an empty GPipe: it has no layers, so no "
                                      "parameter to train; call the loss on the inputs "
                                      "directly, or give the pipe layers")
        return super().train_step(*args, **kwargs)


TRACING_OPTIONS = frozenset({"split_points", "layout"})
"""``Pipe`` options that cut the module themselves (a given ``balance`` is then theirs to
check)."""


def recommend_auto_balance(message: str) -> str:
    """``message`` followed by torchgpipe's advice on balancing, with fastpipe's names."""
    return (f"{message}\n\nA measured balance follows the model as it changes: fastpipe.balance "
            f"has torchgpipe.balance's balancers, with the same signatures:\n\n"
            f"  from fastpipe.balance import balance_by_time\n"
            f"  balance = balance_by_time(partitions, model, sample)\n"
            f"  model = GPipe(model, balance, ...)\n\n"
            f"or leave balance out to split the layers by parameter count.")


def _check_balance(balance: List[Any], module: nn.Sequential) -> None:
    """The balance against the module's layers, before any work; a wrong one is a
    ``ValueError`` with the advice on balancing."""
    try:
        check_balance(balance, module)
    except ValueError as error:
        raise ValueError(recommend_auto_balance(str(error))) from None


def _checkpoint_mode(checkpoint: Any) -> str:
    """torchgpipe's ``str(checkpoint)``, checked against fastpipe's modes."""
    mode = str(checkpoint)
    if mode not in MODES:
        more = ", ".join(repr(m) for m in MODES if m not in ("always", "except_last", "never"))
        raise ValueError(f"checkpoint={checkpoint!r} is not a checkpoint mode: checkpoint is "
                         f"not one of 'always', 'except_last', or 'never' (torchgpipe's modes), "
                         f"nor fastpipe's {more}")
    return mode


def _devices_for(devices: Optional[Sequence[Device]], partitions: int
                 ) -> Union[Sequence[Device], None]:
    """torchgpipe's device rule: one device per partition, extra devices unused."""
    if devices is None:
        if not torch.cuda.is_available():
            return None
        devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if isinstance(devices, (str, int, torch.device)):
        return devices  # Pipe raises its typed error for a single device
    devices = list(devices)
    return devices[:partitions] if len(devices) > partitions else devices
