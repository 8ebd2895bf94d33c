"""``GPipe``: torchgpipe's front door, so a torchgpipe program runs after changing its imports.

A thin front over :class:`fastpipe.Pipe` (the same pipeline, GPipe schedule): torchgpipe's
constructor (``balance`` second, the rest keyword-only), its list-typed ``balance`` and
``devices``, and the ``nn.Sequential`` behaviour of a torchgpipe ``GPipe`` (``len``, indexing,
iteration over the layers). Parameter and state-dict names are the plain module's, as in
``Pipe``.
"""
from __future__ import annotations

from typing import Any, Iterable, Iterator, List, Optional, Sequence, Union

import torch
from torch import nn

from .pipe import Pipe
from .placement import Device

__all__ = ["GPipe"]


class GPipe(Pipe):
    """torchgpipe's ``GPipe(module, balance, *, devices, chunks, checkpoint,
    deferred_batch_norm)`` on fastpipe's pipeline.

    Args:
        module: an ``nn.Sequential`` to split.
        balance: layers per partition (torchgpipe requires it; here ``None`` balances by
            parameter count, one partition per device).
        devices: one device per partition (default: the CUDA devices, or the CPU); devices
            beyond ``len(balance)`` are left unused, as in torchgpipe.
        chunks: micro-batches per mini-batch.
        checkpoint: ``'always'``, ``'except_last'`` or ``'never'`` (and fastpipe's other modes).
        deferred_batch_norm: batch-norm running statistics updated once per mini-batch.
        options: further keyword arguments of :class:`fastpipe.Pipe` (``schedule``,
            ``timeout``, ...), for programs that outgrow torchgpipe.
    """

    def __init__(self, module: nn.Sequential, balance: Optional[Iterable[int]] = None, *,
                 devices: Optional[Sequence[Device]] = None, chunks: int = 1,
                 checkpoint: str = "except_last", deferred_batch_norm: bool = False,
                 **options: Any) -> None:
        if balance is not None and not isinstance(balance, (str, bytes)):
            balance = list(balance)
            devices = _devices_for(devices, len(balance))
        super().__init__(module, chunks=chunks, devices=devices, balance=balance,
                         checkpoint=checkpoint, deferred_batch_norm=deferred_batch_norm,
                         **options)

    @property
    def balance(self) -> List[int]:  # type: ignore[override]
        """Layers per partition, as a list."""
        return list(self._balance)

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
                f"chunks={self._chunks}, checkpoint={self._checkpoint!r})")


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
