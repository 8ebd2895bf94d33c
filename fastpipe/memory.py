"""Peak activation memory per stage: measured on any device, and estimated before running.

On GPUs ``torch.cuda.max_memory_allocated`` answers per device, but stages sharing a device (and
every CPU stage) share one number, and on the CPU torch's allocations are invisible to
``tracemalloc``. ``SavedActivationMeter`` instead counts, per stage, the bytes of the tensors
autograd saves for backward while they are alive (each storage once; parameters excluded), and
keeps the peak. It measures what pipelining trades: activations held for in-flight
micro-batches. Inputs kept by checkpointed micro-batches for their recomputation are outside
autograd and not counted (they are one boundary tensor per micro-batch).

:func:`estimate_activation_peaks` predicts that peak before a step runs: it runs the layers
once, with grad, on the first micro-batch and records the storages saved for backward (each
storage once per stage however many ops or views save it; the caller's batch once per stage,
as every micro-batch's view of it shares its storage); the schedule's memory model
(:func:`fastpipe.schedule.simulator.activation_peaks`) then walks each stage's actions in order:
a forward keeps its micro-batch's bytes until its backward (its ``W`` under zero-bubble
schedules, whose ``B`` retains the graph for it), a checkpointed micro-batch keeps nothing until
its backward recomputes it. Micro-batches of other sizes scale with their rows.

Neither counts the loss's own saved tensors, boundary tensors and gradients in transit,
parameters, gradients, optimizer state, nor what the allocator adds: CUDA's caching allocator
rounds blocks up (512 bytes; 2 MB segments), keeps freed blocks cached and fragments, so
``max_memory_allocated`` and ``memory_reserved`` sit above both.
"""
from __future__ import annotations

import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.utils import _pytree as pytree

from .layer_costs import check_positive, saved_storages
from .microbatch import batch_size, scatter, split_sizes
from .schedule.recommend import make_schedule
from .schedule.simulator import CHECKPOINTED, activation_peaks, checkpointed_count

__all__ = ["SavedActivationMeter", "cuda_peaks", "estimate_activation_peaks", "format_bytes",
           "stage_saved_bytes"]


class _Saved:
    """A saved tensor, counted while autograd holds it."""

    __slots__ = ("tensor", "release")

    def __init__(self, tensor: torch.Tensor, release: Any) -> None:
        self.tensor, self.release = tensor, release

    def __del__(self) -> None:
        self.release()


class SavedActivationMeter:
    """Counts live saved-for-backward bytes per stage of ``partitions`` (one module per stage).

    ``with SavedActivationMeter(pipe.partitions) as meter: ...`` then ``meter.peak_bytes``.
    ``groups``: for each partition, the index of the stage it counts into (e.g. the physical
    stage of each virtual stage, ``[pipe.plan().stage_of(k)[0] for k in ...]``); a storage counts
    once per group. Default: each partition its own.
    """

    def __init__(self, partitions: Sequence[nn.Module],
                 groups: Optional[Sequence[int]] = None) -> None:
        self.partitions = list(partitions)
        self.groups = _checked_groups(groups, len(self.partitions))
        count = max(self.groups, default=-1) + 1
        self.peak_bytes: List[int] = [0] * count
        self.live_bytes: List[int] = [0] * count
        self._storages: List[Dict[int, List[int]]] = [{} for _ in range(count)]
        self._lock = threading.Lock()
        self._local = threading.local()
        self._handles: List[Any] = []
        self._params = {p.untyped_storage().data_ptr() for m in self.partitions
                        for p in m.parameters()}

    @classmethod
    def of_stages(cls, pipe: Any) -> "SavedActivationMeter":
        """A meter of ``pipe``'s partitions counted per physical stage (a device, or a rank):
        what :func:`estimate_activation_peaks` estimates."""
        plan = pipe.plan()
        return cls(pipe.partitions, [plan.stage_of(k)[0] for k in range(len(pipe.partitions))])

    def __enter__(self) -> "SavedActivationMeter":
        for stage, module in enumerate(self.partitions):
            self._handles.append(module.register_forward_pre_hook(
                lambda _m, _args, stage=self.groups[stage]: self._enter(stage)))
            self._handles.append(module.register_forward_hook(
                lambda _m, _args, _out: self._exit(), always_call=True))
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _enter(self, stage: int) -> None:
        hooks = torch.autograd.graph.saved_tensors_hooks(
            lambda t: self._pack(stage, t), lambda packed: _unpack(packed))
        hooks.__enter__()
        self._stack().append(hooks)

    def _exit(self) -> None:
        stack = self._stack()
        if stack:
            stack.pop().__exit__(None, None, None)

    def _stack(self) -> List[Any]:
        if not hasattr(self._local, "stack"):
            self._local.stack = []
        return self._local.stack

    def _pack(self, stage: int, tensor: torch.Tensor) -> Any:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self._params or storage.nbytes() == 0:
            return tensor
        nbytes = storage.nbytes()
        self._count(stage, key, nbytes, +1)
        return _Saved(tensor, lambda: self._count(stage, key, nbytes, -1))

    def _count(self, stage: int, key: int, nbytes: int, delta: int) -> None:
        with self._lock:
            entry = self._storages[stage].setdefault(key, [nbytes, 0])
            entry[1] += delta
            if entry[1] == 1 and delta > 0:
                self.live_bytes[stage] += nbytes
            elif entry[1] == 0:
                self.live_bytes[stage] -= entry[0]
                del self._storages[stage][key]
            self.peak_bytes[stage] = max(self.peak_bytes[stage], self.live_bytes[stage])

    def reset_peak(self) -> None:
        """Start a new peak from what is alive now."""
        with self._lock:
            self.peak_bytes = list(self.live_bytes)


def _checked_groups(groups: Optional[Sequence[int]], count: int) -> List[int]:
    if groups is None:
        return list(range(count))
    found = list(groups)
    if len(found) != count or any(isinstance(g, bool) or not isinstance(g, int) or g < 0
                                  for g in found):
        raise ValueError(f"groups must give one stage index >= 0 per partition ({count}), "
                         f"got {found}")
    return found


def _unpack(packed: Any) -> torch.Tensor:
    return packed.tensor if isinstance(packed, _Saved) else packed


def format_bytes(count: float) -> str:
    """``1.5 MB``-style sizes (powers of 1024)."""
    for unit in ("B", "KB", "MB", "GB"):
        if count < 1024 or unit == "GB":
            return f"{count:.1f} {unit}" if unit != "B" else f"{int(count)} B"
        count /= 1024
    return f"{count:.1f} GB"


def cuda_peaks(devices: Sequence[torch.device]) -> Tuple[int, ...]:
    """Peak allocated bytes of each stage's CUDA device since the last reset (0 for the CPU)."""
    return tuple(torch.cuda.max_memory_allocated(d) if d.type == "cuda" else 0 for d in devices)


# -- the estimate, before running ------------------------------------------------------------

_V_SHAPED = ("zbv", "dualpipev")  # two chunks per stage by default, as Pipe has it
_UNMODELLED = {"offload": "saved tensors wait in host memory", "selective": "matrix-product "
               "outputs are kept in the policy's cache, outside autograd's saved tensors"}


def estimate_activation_peaks(
    model: Any, inputs: Any, *, balance: Sequence[int] | None = None,
    schedule: str | None = None, chunks: int | None = None, checkpoint: str | None = None,
    virtual_stages: int | None = None, device: torch.device | str | None = None,
) -> tuple[int, ...]:
    """Per physical stage, the peak bytes of saved activations one training step on ``inputs``
    (the whole batch) will hold, before running it.

    ``model``: a ``Pipe`` (its partitions, schedule, ``chunks`` and ``checkpoint`` unless given),
    or an ``nn.Sequential`` with ``balance`` (layers per virtual stage, in model order; then
    ``schedule`` defaults to ``'gpipe'``, ``chunks`` to 1, ``checkpoint`` to
    ``'except_last'``, ``virtual_stages`` to 1, or 2 for ``'zbv'`` and ``'dualpipev'``).
    ``device``: where to profile (default: where each layer lives). The model is left as it was.
    """
    stages, plan = _stages(model, balance, schedule, chunks, checkpoint, virtual_stages)
    sizes = split_sizes(batch_size(inputs), plan["chunks"])
    held, shared = stage_saved_bytes(stages, scatter(inputs, sizes)[0], inputs, device=device)
    table = [[h * rows / sizes[0] for rows in sizes] for h in held]
    built = plan["build"](len(sizes))
    peaks = activation_peaks(built, table, shared=shared,
                             checkpointed=checkpointed_count(plan["checkpoint"], len(sizes)))
    return tuple(int(round(p)) for p in peaks)


def stage_saved_bytes(
    stages: Sequence[Sequence[nn.Module]], microbatch: Any, batch: Any = None, *,
    device: torch.device | str | None = None,
) -> tuple[list[int], list[int]]:
    """Per virtual stage (a list of layers each), the bytes its layers save for backward on
    ``microbatch``: those of its own storages, and those of storages of ``batch`` (held once
    whatever the number of micro-batches viewing it)."""
    layers = [layer for stage in stages for layer in stage]
    saved = saved_storages(layers, microbatch, device=device)
    ours = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves(batch)
            if isinstance(t, torch.Tensor)}
    held, shared, start = [], [], 0
    for stage in stages:
        union: dict[int, int] = {}
        for layer_saved in saved[start:start + len(stage)]:
            union.update(layer_saved)
        start += len(stage)
        held.append(sum(b for key, b in union.items() if key not in ours))
        shared.append(sum(b for key, b in union.items() if key in ours))
    return held, shared


def _stages(model: Any, balance: Sequence[int] | None, schedule: str | None,
            chunks: int | None, checkpoint: str | None,
            virtual_stages: int | None) -> tuple[list[list[nn.Module]], dict[str, Any]]:
    """The layers of each virtual stage, and how to build the step's schedule."""
    if hasattr(model, "partitions") and hasattr(model, "plan"):  # a Pipe (any front door)
        if balance is not None:
            raise ValueError("balance is a Pipe's own; pass balance only with an nn.Sequential")
        stages = [list(part) for part in model.partitions]
        name = model.schedule if schedule is None else schedule
        vs = model.virtual_stages if virtual_stages is None else virtual_stages
        mode = _mode(model.checkpoint if checkpoint is None else checkpoint)
        default = (model.plan if schedule is None and virtual_stages is None else
                   lambda m: make_schedule(name, len(stages) // vs, m, vs))
        return stages, {"chunks": _chunks(model.chunks if chunks is None else chunks),
                        "checkpoint": mode,
                        "build": default}
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"model must be a Pipe or an nn.Sequential with balance=..., got "
                        f"{type(model).__name__}; for another model build its Pipe first")
    name = "gpipe" if schedule is None else schedule
    vs = (2 if name in _V_SHAPED else 1) if virtual_stages is None else virtual_stages
    check_positive("virtual_stages", vs, integer=True)
    stages = _split(model, balance, vs)
    return stages, {"chunks": _chunks(1 if chunks is None else chunks),
                    "checkpoint": _mode("except_last" if checkpoint is None else checkpoint),
                    "build": lambda m: make_schedule(name, len(stages) // vs, m, vs)}


def _split(model: nn.Sequential, balance: Sequence[int] | None, vs: int) -> list[list[nn.Module]]:
    """``model``'s layers in consecutive groups of ``balance``, checked."""
    if balance is None:
        raise TypeError("balance is required with an nn.Sequential: give the layers of each "
                        "virtual stage, e.g. balance=[2, 2]")
    counts = list(balance)
    if any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in counts):
        raise ValueError(f"balance must list positive layer counts, got {counts}")
    if sum(counts) != len(model):
        raise ValueError(f"balance={counts} covers {sum(counts)} layers but the model has "
                         f"{len(model)}; make the counts add up to {len(model)}")
    if len(counts) % vs:
        raise ValueError(f"balance has {len(counts)} virtual stages, not a multiple of "
                         f"virtual_stages={vs}; give virtual_stages entries per device")
    layers, stages = list(model), []
    for count in counts:
        stages.append(layers[:count])
        layers = layers[count:]
    return stages


def _mode(checkpoint: str) -> str:
    if checkpoint in _UNMODELLED:
        raise NotImplementedError(f"checkpoint={checkpoint!r} is not estimated yet "
                                  f"({_UNMODELLED[checkpoint]}); estimate with 'never' for an "
                                  f"upper bound")
    if checkpoint not in CHECKPOINTED:
        raise ValueError(f"checkpoint={checkpoint!r} is not a checkpoint mode; use one of "
                         f"{', '.join(CHECKPOINTED)}")
    return checkpoint


def _chunks(chunks: Any) -> int:
    check_positive("chunks", chunks, integer=True)
    return chunks
