"""The loss scaler's agreement flag: one value per rank, made on the rank's pipeline device and
reduced there, so that every rank of a process group takes part in the same collective.

A rank's gradients may sit on no device at all (a stage without trainable parameters), yet its
all-reduce must use the group's device backend like every other rank's: on NCCL a CPU flag would
go to gloo (or be refused) while the others' go to NCCL, and the ranks would hang or fail. So
the flag is allocated on the pipeline device under its device guard, each per-device
``found_inf`` the scaler reported is gathered onto it (issued on that device's current
stream, which the reduction then follows), and the reduction runs on it.
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch

from .backend import StreamBackend, backend_for

__all__ = ["agreed_flag"]


def agreed_flag(found: Iterable[torch.Tensor], device: torch.device,
                reduce: Callable[[torch.Tensor], None],
                backend: Optional[StreamBackend] = None) -> torch.Tensor:
    """A float32 flag on ``device``: the largest of ``found`` (0 when empty), then reduced in
    place by ``reduce`` (an all-reduce with ``MAX`` over the ranks); returned on ``device``."""
    device = torch.device(device)
    backend = backend or backend_for(device)
    with backend.on_device(device):
        flag = backend.empty((), torch.float32, device).zero_()
        for value in found:
            torch.maximum(flag, value.to(flag.device, torch.float32).reshape(()), out=flag)
        reduce(flag)
    return flag
