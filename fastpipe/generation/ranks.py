"""A ``DistributedPipe``'s ranks agree on a generation: the prompt, read where the first stage
runs, reaches every rank, every rank checks that all asked for the same generation, and the new
tokens, picked where the last stage runs, reach every rank at the end. Collectives over the
pipeline's group, every wait bounded by the pipe's timeout and watching the failure board."""
from __future__ import annotations

import zlib
from typing import Any, Optional, Tuple

import torch
import torch.distributed as dist

from ..runtime.failure.waits import wait_work
from .arguments import Request, check_prompt

HEADER = 4  # status, batch, length, the mask's dtype (0: no mask)
MASK_DTYPES = (torch.int64, torch.int32, torch.bool, torch.uint8, torch.int8, torch.int16,
               torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _broadcast(tensor: torch.Tensor, src: int, driver: Any, what: str) -> None:
    work = dist.broadcast(tensor, src=src, group=driver.topology.group, async_op=True)
    wait_work(work, driver.timeout, what, driver.board)


def _checksum(request: Request) -> int:
    return zlib.crc32(repr(request).encode())


def _check_same(driver: Any, request: Request) -> None:
    """Every rank asked for the same generation (else every rank raises, naming the ranks)."""
    topology = driver.topology
    mine = torch.tensor([_checksum(request)], dtype=torch.int64, device=topology.device)
    ranks = dist.get_process_group_ranks(topology.group)
    every = [torch.empty_like(mine) for _ in ranks]
    work = dist.all_gather(every, mine, group=topology.group, async_op=True)
    wait_work(work, driver.timeout, "every rank's generate arguments", driver.board)
    other = [rank for rank, value in zip(ranks, every) if int(value) != int(mine)]
    if other:
        raise ValueError(f"rank {topology.rank} called generate with other arguments than "
                         f"rank(s) {other} (its own: {request}); call it with the same arguments "
                         f"on every rank")


def agree_prompt(driver: Any, request: Request, input_ids: Any, attention_mask: Any
                 ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The prompt on every rank, from the first stage's rank (which checks it: a refused prompt
    raises on every rank, and the pipe stays usable)."""
    topology = driver.topology
    src, device = topology.owner[0], topology.device
    first = topology.rank == src
    header = torch.zeros(HEADER, dtype=torch.int64)
    error: Optional[Exception] = None
    ids = mask = None
    if first:
        try:
            ids, mask = check_prompt(input_ids, attention_mask)
            if mask is not None and mask.dtype not in MASK_DTYPES:
                mask = mask.long()
            code = 0 if mask is None else MASK_DTYPES.index(mask.dtype) + 1
            header[:] = torch.tensor([0, *ids.shape, code])
        except (TypeError, ValueError) as refused:
            error, header[0] = refused, 1
    header = header.to(device)
    _broadcast(header, src, driver, "the prompt's size from the first stage's rank")
    status, batch, length, code = header.tolist()
    if status:
        if error is not None:
            raise error
        raise ValueError(f"generate: rank {src}, which holds the first stage, refused the prompt "
                         f"(see its error); pass valid input_ids there")
    _check_same(driver, request)
    ids = (ids.to(device) if ids is not None
           else torch.empty(batch, length, dtype=torch.int64, device=device))
    _broadcast(ids, src, driver, "the prompt from the first stage's rank")
    if code:
        mask_wire = (mask.long().to(device) if mask is not None
                     else torch.empty(batch, length, dtype=torch.int64, device=device))
        _broadcast(mask_wire, src, driver, "the attention mask from the first stage's rank")
        mask = mask if mask is not None else mask_wire.to(MASK_DTYPES[code - 1])
    return ids, mask


def share_tokens(driver: Any, src: int, generated: Optional[torch.Tensor],
                 batch: int) -> torch.Tensor:
    """The new tokens (batch, steps) on every rank, from rank ``src`` (the last stage's)."""
    device = driver.topology.device
    count = torch.tensor([generated.shape[1] if generated is not None else 0],
                         dtype=torch.int64, device=device)
    _broadcast(count, src, driver, "the number of new tokens from the last stage's rank")
    tokens = (generated.to(device) if generated is not None
              else torch.empty(batch, int(count.item()), dtype=torch.int64, device=device))
    _broadcast(tokens, src, driver, "the new tokens from the last stage's rank")
    return tokens
