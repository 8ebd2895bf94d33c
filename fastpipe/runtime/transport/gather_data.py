"""JSON data from every rank of a process group, gathered as bytes and decoded as data.

What ranks exchange outside the pipeline's messages (a traced step's intervals, ...) travels
as strict JSON in two all-gathers (each rank's byte count, then the bytes padded to the
longest), never pickled: a peer's bytes decode to lists, numbers and strings, or raise
``ProtocolError`` naming the rank that sent them.
"""
from __future__ import annotations

from typing import Any, Callable, List

import torch
import torch.distributed as dist

from ...errors import ProtocolError
from . import data_codec as codec

Wait = Callable[[Any, str], None]  # waits (bounded) for an async collective's work


def gather_json(value: Any, group: Any, device: torch.device, wait: Wait, what: str
                ) -> List[Any]:
    """``value`` (JSON data: lists, dicts with string keys, finite numbers, strings) from
    every rank of ``group``, in group rank order (a collective: every rank calls it)."""
    mine = codec.dumps(value)
    ranks = dist.get_process_group_ranks(group) if group is not None else \
        list(range(dist.get_world_size()))
    size = torch.tensor([len(mine)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in ranks]
    wait(dist.all_gather(sizes, size, group=group, async_op=True), f"{what} (sizes)")
    counts = [int(s.item()) for s in sizes]
    padded = torch.zeros(max(counts), dtype=torch.uint8, device=device)
    if mine:
        padded[:len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8).to(device)
    parts = [torch.empty_like(padded) for _ in ranks]
    wait(dist.all_gather(parts, padded, group=group, async_op=True), what)
    return [_decoded(p[:n].cpu().numpy().tobytes(), rank, what)
            for p, n, rank in zip(parts, counts, ranks)]


def _decoded(raw: bytes, rank: int, what: str) -> Any:
    try:
        return codec.loads(raw)
    except codec.Undecodable as error:
        raise ProtocolError(f"rank {rank} sent {what} that does not decode as JSON data "
                            f"({error}); nothing in it was run", rank=rank) from None
