"""One layout of a training run: pipeline x data x shard x tensor, chunks per stage, schedule,
micro-batch size, checkpoint mode and the order ranks take on the nodes. Pure Python.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Tuple

__all__ = ["CHECKPOINT_MODES", "DIMENSIONS", "Layout", "ORDERS"]

DIMENSIONS = ("tensor", "shard", "data", "pipeline")
"""The grid's dimensions."""

ORDERS = ("tensor,shard,data,pipeline", "tensor,pipeline,shard,data")
"""Rank orders, innermost first: consecutive ranks differ in the first dimension. The first is
``fastpipe.init_mesh``'s (pipeline, data, shard, tensor) grid; the second keeps a pipeline's
stages side by side (inside a node when it fits) and spreads the replicas over nodes."""

CHECKPOINT_MODES = ("never", "selective", "always")
"""Activation checkpoint modes the planner weighs (``Pipe(checkpoint=...)``'s names)."""


@dataclass(frozen=True)
class Layout:
    """``tensor`` x ``shard`` x ``data`` x ``pipeline`` GPUs; ``virtual`` chunks per pipeline
    stage; ``schedule`` (a registered name); ``micro_batch`` sequences per micro-batch;
    ``checkpoint`` mode; ``order`` (one of :data:`ORDERS`); ``balance``: transformer layers
    per virtual stage (``None``: the planner's split)."""

    tensor: int = 1
    pipeline: int = 1
    data: int = 1
    shard: int = 1
    virtual: int = 1
    schedule: str = "1f1b"
    micro_batch: int = 1
    checkpoint: str = "never"
    order: str = ORDERS[0]
    balance: Optional[Tuple[int, ...]] = None

    @property
    def gpus(self) -> int:
        return self.tensor * self.pipeline * self.data * self.shard

    @property
    def replicas(self) -> int:
        """Data-parallel replicas of the pipeline (``data x shard``)."""
        return self.data * self.shard

    @property
    def virtual_stages(self) -> int:
        return self.pipeline * self.virtual

    def microbatches(self, global_batch: int) -> int:
        """Micro-batches each pipeline runs per step for ``global_batch`` sequences."""
        return global_batch // (self.replicas * self.micro_batch)

    def stride(self, dimension: str) -> int:
        """Rank distance between neighbours along ``dimension`` under :attr:`order`."""
        stride = 1
        for name in self.order.split(","):
            if name == dimension:
                return stride
            stride *= getattr(self, name)
        raise ValueError(f"order={self.order!r} lacks {dimension!r}")

    def inside_node(self, dimension: str, gpus_per_node: int) -> bool:
        """Whether every group along ``dimension`` lies inside one node."""
        size = getattr(self, dimension)
        return size == 1 or self.stride(dimension) * size <= gpus_per_node

    def with_changes(self, **changes: object) -> Layout:
        return replace(self, **changes)  # type: ignore[arg-type]

    def describe(self) -> str:
        """``'pp4 x dp2 x tp8, interleaved v2, mb1, checkpoint never'`` (and ``', stages side
        by side'`` for the second of :data:`ORDERS`, which ``init_mesh`` does not build: ranks
        ordered so by the launcher)."""
        parts = [f"pp{self.pipeline}"]
        parts += [f"{key}{getattr(self, name)}" for key, name in
                  (("dp", "data"), ("fsdp", "shard"), ("tp", "tensor")) if getattr(self, name) > 1]
        chunks = f" v{self.virtual}" if self.virtual > 1 else ""
        order = "" if self.order == ORDERS[0] else ", stages side by side"
        return (f"{' x '.join(parts)}, {self.schedule}{chunks}, mb{self.micro_batch}, "
                f"checkpoint {self.checkpoint}{order}")
