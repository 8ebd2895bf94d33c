"""Stage boundaries under tensor parallelism: a replicated activation crosses once per group.

Without this, each of the ``T`` ranks of a tensor-parallel group sends its whole copy of a
stage's output to its peer in the next stage: ``T`` identical messages. As in Megatron-LM's
scatter/gather, when a stage's output is replicated across its tensor-parallel group, each
rank sends only its ``1/T`` slice (of the flattened, padded tensor), and the receiving group
all-gathers the slices back into the whole tensor; the gradient goes back the same way (each
receiving rank sends the slice of the input gradient, which is replicated too, and the senders
all-gather it). The pipeline's transport is unchanged: the slice travels as an ordinary
message, a :class:`Scattered` value that says so and carries the whole shape, so the receiver
needs no configuration.

Whether a stage's output is replicated is measured, not assumed: on the stage's first call the
group compares a fingerprint of the output (its size, its sum and a weighted sum, in float64)
with one all-reduce; only if every rank holds the same value does the stage scatter, from then
on. A sharded output (after a ``ColwiseParallel`` layer) is sent as each rank's local shard,
per rank, as before; so is any output that is not a single floating-point tensor. A
``DTensor`` output (a style with ``use_local_output=False``) is sent as its local tensor: the
next stage's plan must say how to read it (``input_layouts``).
"""
from __future__ import annotations

import datetime
from typing import Any, Dict, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from ..policies.checkpoint import is_recomputing


class Scattered(NamedTuple):
    """This rank's slice of a replicated activation, and the activation's whole shape."""

    chunk: torch.Tensor
    shape: Tuple[int, ...]


# It crosses ranks in messages, whose structure decodes only through torch's pytree registry.
pytree._register_namedtuple(Scattered, serialized_type_name="fastpipe.parallel.boundary.Scattered")


class Boundary:
    """Wraps a stage's ``call``: gathers a :class:`Scattered` input, scatters a replicated
    output when ``sends`` (the next stage is on another rank)."""

    def __init__(self, inner: Any, group: Any, sends: bool, timeout: float) -> None:
        self.inner = inner
        self.group = group
        self.size = dist.get_world_size(group)
        self.index = dist.get_group_rank(group, dist.get_rank())
        self.sends = sends
        self.timeout = datetime.timedelta(seconds=timeout)
        self.replicated: Optional[bool] = None  # decided on the first call
        self.elements_sent = 0  # floats this rank sent in forward messages (slices or whole)
        self.elements_whole = 0  # floats those messages would have held without slicing

    def __call__(self, inputs: Any) -> Any:
        if isinstance(inputs, Scattered):
            inputs = _Gather.apply(inputs.chunk, tuple(inputs.shape), self)
        output = self.inner(inputs)
        if not self.sends:
            return output
        if hasattr(output, "to_local") and hasattr(output, "placements"):  # a DTensor
            output = output.to_local()  # the next stage's plan says how to read it
        if not isinstance(output, torch.Tensor) or not output.is_floating_point():
            return output
        if self.replicated is None:
            self.replicated = self._is_replicated(output)
        counted = not is_recomputing()  # a recomputed forward sends nothing
        self.elements_whole += output.numel() if counted else 0
        if not self.replicated:
            self.elements_sent += output.numel() if counted else 0
            return output
        chunk = _Scatter.apply(output, self)
        self.elements_sent += chunk.numel() if counted else 0
        return Scattered(chunk, tuple(output.shape))

    def report(self) -> Dict[str, Any]:
        return {"replicated": self.replicated, "elements_sent": self.elements_sent,
                "elements_whole": self.elements_whole}

    # ---------------------------------------------------------------- collectives
    def _wait(self, work: Any, what: str) -> None:
        try:
            work.wait(timeout=self.timeout)
        except RuntimeError as error:
            raise RuntimeError(f"rank {dist.get_rank()}: the tensor-parallel group did not "
                               f"complete {what} within {self.timeout.total_seconds():g}s: "
                               f"{error}") from error

    def _is_replicated(self, output: torch.Tensor) -> bool:
        flat = output.detach().reshape(-1).to(torch.float64)
        ramp = torch.linspace(1.0, 2.0, flat.numel(), dtype=torch.float64, device=flat.device)
        fingerprint = torch.stack([flat.new_tensor(float(flat.numel())), flat.sum(),
                              (flat * ramp).sum()])
        both = torch.cat([fingerprint, -fingerprint])
        self._wait(dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group,
                                   async_op=True), "the check of a stage output's replication")
        return bool(torch.equal(both[:3], -both[3:]))

    def slice_of(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the flattened tensor, padded to a multiple of the group size."""
        flat = whole.reshape(-1)
        length = -(-flat.numel() // self.size)
        padded = torch.nn.functional.pad(flat, (0, length * self.size - flat.numel()))
        return padded[self.index * length:(self.index + 1) * length].clone()

    def gather(self, chunk: torch.Tensor, shape: Tuple[int, ...]) -> torch.Tensor:
        """The whole tensor from every rank's slice."""
        parts = [torch.empty_like(chunk) for _ in range(self.size)]
        self._wait(dist.all_gather(parts, chunk.contiguous(), group=self.group, async_op=True),
                   "the all-gather of a stage boundary")
        numel = 1
        for d in shape:
            numel *= d
        return torch.cat(parts)[:numel].reshape(shape)


class _Scatter(torch.autograd.Function):
    """Forward: this rank's slice of a replicated tensor. Backward: the slices' gradients
    all-gathered into the whole (replicated) gradient."""

    @staticmethod
    def forward(ctx: Any, whole: torch.Tensor, boundary: Boundary) -> torch.Tensor:
        ctx.boundary, ctx.shape = boundary, tuple(whole.shape)
        return boundary.slice_of(whole)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[torch.Tensor, None]:
        return ctx.boundary.gather(grad, ctx.shape), None


class _Gather(torch.autograd.Function):
    """Forward: the whole tensor from the group's slices. Backward: this rank's slice of the
    (replicated) gradient."""

    @staticmethod
    def forward(ctx: Any, chunk: torch.Tensor, shape: Tuple[int, ...],
                boundary: Boundary) -> torch.Tensor:
        ctx.boundary = boundary
        return boundary.gather(chunk, shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[torch.Tensor, None, None]:
        return ctx.boundary.slice_of(grad), None, None
