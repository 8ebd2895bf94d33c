"""What the ranks of a ``DistributedPipe`` agree on under Lightning: an evaluation's value and
logged values reduced over the data-parallel replicas.

An evaluation's output exists on the rank of the pipeline's last stage only; the value computed
from it (a loss, a metric, a dict of them) reaches every rank of the pipeline, so every rank
logs the same value and takes the same decisions (``ModelCheckpoint``, early stopping). It
travels as data (the pytree's structure as JSON, each leaf's dtype and shape, the bytes), never
as pickled code, and every wait is bounded by the pipe's timeout. The ranks of one pipeline
hold the same logged values, so ``sync_dist`` reduces over the replicas, not over the world.
"""
from __future__ import annotations

import json
from typing import Any, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from ...runtime.failure.waits import wait_work
from ...runtime.transport import data_codec as codec

OK, FAILED = 0, 1


def last_stage_rank(pipe: Any, group: Any) -> int:
    """The global rank that holds the pipeline's last (virtual) stage (a collective over the
    pipeline's ``group``)."""
    last = len(pipe.balance) - 1
    mine = torch.tensor([dist.get_rank() if last in pipe.stages else -1], device=pipe.device)
    _wait(pipe, dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=group, async_op=True),
          "the rank of the last stage")
    return int(mine.item())


def share(pipe: Any, group: Any, src: int, compute: Any) -> Any:
    """``compute()`` run on ``src``, its value on every rank of ``group``. When it raises on
    ``src``, every rank raises (``src`` its own error, the others one naming ``src``)."""
    error: Optional[BaseException] = None
    meta, payload = b"", torch.empty(0, dtype=torch.uint8)
    if dist.get_rank() == src:
        try:
            meta, payload = encode(compute())
        except Exception as raised:  # noqa: BLE001 - handed to every rank, then re-raised
            error = raised
    header = torch.tensor([FAILED if error is not None else OK, len(meta), payload.numel()],
                          dtype=torch.int64, device=pipe.device)
    what = f"the evaluation's value from rank {src} (the last stage)"
    _wait(pipe, dist.broadcast(header, src=src, group=group, async_op=True), what)
    status, meta_size, payload_size = header.tolist()
    if status != OK:
        if error is not None:
            raise error
        raise RuntimeError(f"rank {src}, which holds the last stage, failed to compute the "
                           f"evaluation's value (see its error)")
    data = torch.empty(meta_size + payload_size, dtype=torch.uint8)
    if dist.get_rank() == src:
        data[:meta_size] = torch.frombuffer(bytearray(meta), dtype=torch.uint8)
        data[meta_size:] = payload
    data = data.to(pipe.device)
    _wait(pipe, dist.broadcast(data, src=src, group=group, async_op=True), what)
    data = data.cpu()
    return decode(bytes(data[:meta_size].tolist()), data[meta_size:], pipe.device)


def encode(value: Any) -> Tuple[bytes, torch.Tensor]:
    """A pytree of tensors and numbers as (JSON metadata, the leaves' bytes)."""
    leaves, spec = pytree.tree_flatten(value)
    described: List[List[Any]] = []
    parts: List[torch.Tensor] = []
    for leaf in leaves:
        kind = _kind(leaf)
        tensor = torch.as_tensor(leaf).detach().cpu().contiguous()
        described.append([kind, str(tensor.dtype).split(".")[-1], list(tensor.shape)])
        parts.append(tensor.reshape(-1).view(torch.uint8))
    meta = json.dumps({"spec": codec.encode_spec(spec), "leaves": described})
    payload = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    return meta.encode("utf-8"), payload


def decode(meta: bytes, payload: torch.Tensor, device: torch.device) -> Any:
    """What :func:`encode` wrote, its tensors on ``device``."""
    described = json.loads(meta.decode("utf-8"))
    leaves: List[Any] = []
    offset = 0
    for kind, dtype_name, shape in described["leaves"]:
        dtype = codec.dtype_of(dtype_name)  # from a fixed table: no lookup by a sent name
        size = int(torch.Size(shape).numel()) * torch.empty(0, dtype=dtype).element_size()
        tensor = payload[offset:offset + size].clone().view(dtype).reshape(shape)
        offset += size
        leaves.append(tensor.item() if kind != "tensor" else tensor.to(device))
    return pytree.tree_unflatten(leaves, codec.decode_spec(described["spec"]))


def _kind(leaf: Any) -> str:
    if isinstance(leaf, torch.Tensor):
        return "tensor"
    if isinstance(leaf, (bool, int, float)):
        return "number"
    raise TypeError(f"an evaluation's value is tensors and numbers (in dicts, lists, tuples), "
                    f"which every rank can log; metric_fn returned a {type(leaf).__name__}")


REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
              "product": dist.ReduceOp.PRODUCT}


def reduce_over(pipe: Any, group: Any, tensor: torch.Tensor,
           reduce_op: Union[str, Any, None]) -> torch.Tensor:
    """``tensor`` reduced over ``group`` (``'mean'`` / ``'avg'``, ``'sum'``, ``'max'``,
    ``'min'`` or a ``ReduceOp``), a new tensor; bounded by the pipe's timeout (``pipe`` may
    be ``None`` before it is built)."""
    name = str(reduce_op).lower() if isinstance(reduce_op, str) or reduce_op is None else None
    mean = name in (None, "mean", "avg") or reduce_op == dist.ReduceOp.AVG
    if name is not None and not mean and name not in REDUCE_OPS:
        raise ValueError(f"reduce_op={reduce_op!r}: use 'mean', 'sum', 'max', 'min' or a "
                         f"torch.distributed.ReduceOp")
    op = dist.ReduceOp.SUM if mean else (REDUCE_OPS[name] if name is not None else reduce_op)
    result = tensor.detach().clone()
    if not result.is_floating_point() and mean:
        result = result.double()
    _wait(pipe, dist.all_reduce(result, op=op, group=group, async_op=True),
          "a logged value's reduction over the data-parallel replicas")
    return result / dist.get_world_size(group) if mean else result


def gather(pipe: Any, group: Any, tensor: torch.Tensor) -> torch.Tensor:
    """Every rank of ``group``'s ``tensor``, stacked along a new first dimension."""
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    _wait(pipe, dist.all_gather(parts, tensor.detach().contiguous(), group=group,
                                async_op=True), "a tensor of every data-parallel replica")
    return torch.stack(parts)


def _wait(pipe: Any, work: Any, what: str) -> None:
    """A collective's wait, bounded by the pipe's timeout and watching its failure board (as
    the checkpoints' agreements do); before the pipe exists, by the process group's timeout."""
    if pipe is None:
        work.wait()
        return
    wait_work(work, pipe.layout.timeout, what, pipe._driver.board)


class Collectives:
    """``PipelineStrategy``'s collectives for Lightning (mixed into the strategy): logged values
    reduced and gathered over the replicas, decisions over every rank, Lightning's own barrier
    and object broadcast (bounded by the process group's timeout)."""

    _options: Any
    _pipe: Any
    _data_group: Any

    def reduce(self, tensor: Union[torch.Tensor, Any], group: Optional[Any] = None,
               reduce_op: Optional[Union[str, Any]] = "mean") -> Union[torch.Tensor, Any]:
        """Over the data-parallel replicas: the ranks of one pipeline hold the same values."""
        group = group if group is not None else self._data_group
        if not isinstance(tensor, torch.Tensor) or group is None:
            return tensor
        return reduce_over(self._pipe, group, tensor, reduce_op)

    def all_gather(self, tensor: torch.Tensor, group: Optional[Any] = None,
                   sync_grads: bool = False) -> torch.Tensor:
        """Each data-parallel replica's ``tensor``, stacked (one replica: the tensor itself, as
        Lightning's single process returns it). The world, ``LightningModule.all_gather``'s
        default group, means the replicas, as under DDP: the ranks of one pipeline hold the
        same values; another group is taken as given."""
        if group is None or group is dist.group.WORLD:
            group = self._data_group
        if group is None:
            return tensor
        if sync_grads:
            raise NotImplementedError("all_gather(sync_grads=True) under PipelineStrategy: the "
                                      "pipeline's backward does not run through the module")
        return gather(self._pipe, group, tensor)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Over every rank (``all``: every rank decided so; else any)."""
        if self._options.in_process or not dist.is_initialized():
            return decision
        votes = torch.tensor(int(decision), device=self.root_device)
        votes = reduce_over(self._pipe, dist.group.WORLD, votes, "sum")
        return bool(votes == dist.get_world_size()) if all else bool(votes > 0)

    def barrier(self, name: Optional[str] = None) -> None:
        if not self._options.in_process and dist.is_initialized():
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if self._options.in_process or not dist.is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

