"""Argument checks and placement for a pipeline: which layers go to which device.

Everything here runs before any tensor moves, so a bad argument leaves the user's module as it
was. Each error names the argument and says how to fix it.
"""
from __future__ import annotations

import os
from typing import Any, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from .balance import solve
from .errors import TooFewDevices
from .schedule.ir import ScheduleData

Device = Union[str, int, torch.device]

# The most micro-batches per batch: a schedule is built (and validated) for its count ahead of a
# step, and past a few times the stage count more micro-batches only add per-action overhead.
MAX_CHUNKS = 4096


def check_module(module: object) -> nn.Sequential:
    """The module must be a non-empty ``nn.Sequential`` (the pipeline splits it by layers)."""
    if not isinstance(module, nn.Sequential):
        raise TypeError(
            f"module must be an nn.Sequential, got {type(module).__name__}; wrap the layers in "
            f"order, e.g. nn.Sequential(embedding, *blocks, head)")
    if len(module) == 0:
        raise ValueError("module is an empty nn.Sequential; give it at least one layer")
    return module


def check_chunks(chunks: object) -> int:
    """``chunks`` is the number of micro-batches: an int of at least 1 (a whole float such as
    ``42.0`` counts as that int, as torchgpipe takes it)."""
    if isinstance(chunks, float) and chunks.is_integer():
        chunks = int(chunks)
    if isinstance(chunks, bool) or not isinstance(chunks, int):
        raise TypeError(f"chunks must be an int (the number of micro-batches) or 'auto', got "
                        f"{chunks!r}; a float is taken only when it is whole, e.g. 4.0")
    if chunks < 1:
        raise ValueError(f"chunks must be at least 1 (the number of micro-batches), got {chunks}")
    if chunks > MAX_CHUNKS:
        raise ValueError(f"chunks={chunks} is more than {MAX_CHUNKS} micro-batches per batch; "
                         f"a pipeline gains nothing from micro-batches beyond a few times its "
                         f"stage count (each one costs per-action overhead): use at most "
                         f"{MAX_CHUNKS}, or 'auto' to let the pipe choose")
    return chunks


def check_materialised(module: nn.Module) -> None:
    """Every parameter and buffer holds real memory (``Pipe`` moves them to the stages)."""
    meta = [name for name, t in [*module.named_parameters(), *module.named_buffers()]
            if t.is_meta]
    if meta:
        raise ValueError(f"module has {len(meta)} parameters or buffers on the meta device (e.g. "
                         f"{meta[0]!r}), which hold no values to place on the stages; build the "
                         f"model on a real device, or materialise it first with "
                         f"module.to_empty(device='cpu') and initialise it (DistributedPipe "
                         f"materialises each rank's layers itself)")


def check_flag(value: object, argument: str) -> bool:
    """A switch argument must be a bool (not a truthy string such as ``'false'``)."""
    if not isinstance(value, bool):
        raise TypeError(f"{argument} must be True or False, got {value!r}")
    return value


def check_timeout(timeout: object) -> float:
    """``timeout`` bounds every blocking wait of a step, in seconds."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return float(timeout)


def parse_device(device: Device, *, argument: str = "devices") -> torch.device:
    """Parse one device and check that it exists on this machine."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"{argument} holds {device!r}, which is not a device: {error}; use "
                         f"'cpu' or 'cuda:N'") from None
    if parsed.type == "cpu":
        return torch.device("cpu")
    if parsed.type != "cuda":
        raise ValueError(f"{argument} holds {device!r}; fastpipe places stages on 'cpu' or "
                         f"'cuda:N' devices only")
    if not torch.cuda.is_available():
        raise ValueError(f"{argument} holds {device!r} but CUDA is not available here; use 'cpu' "
                         f"or install a CUDA build of torch on a machine with a GPU")
    index = parsed.index if parsed.index is not None else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise ValueError(f"{argument} holds {device!r} but this machine has "
                         f"{torch.cuda.device_count()} CUDA device(s); use cuda:0 to "
                         f"cuda:{torch.cuda.device_count() - 1}")
    return torch.device("cuda", index)


def default_partitions(module: nn.Sequential, devices: Optional[Sequence[Device]]) -> int:
    """How many stages to make when no balance is given: one per device (listed, or present)."""
    if devices is not None:
        count = len(devices)
    elif torch.cuda.is_available():
        count = torch.cuda.device_count()
    else:
        count = os.cpu_count() or 1
    return max(1, min(count, len(module)))


def check_balance(balance: Sequence[int], module: nn.Sequential) -> List[int]:
    """A balance lists each stage's layer count: positive ints summing to ``len(module)``."""
    try:
        values = list(balance)
    except TypeError:
        raise TypeError(f"balance must be a list of layer counts, got {balance!r}") from None
    if not values or any(isinstance(b, bool) or not isinstance(b, int) for b in values):
        raise TypeError(f"balance must be a non-empty list of ints (layers per stage), "
                        f"got {balance!r}")
    if any(b < 1 for b in values):
        raise ValueError(f"balance={values} has a stage with no layers; every stage needs at "
                         f"least one layer: drop the zero or merge stages")
    if sum(values) != len(module):
        raise ValueError(f"balance={values} sums to {sum(values)} but the module has "
                         f"{len(module)} layers; make the counts add up to {len(module)}")
    return values


def auto_balance(module: nn.Sequential, partitions: int) -> List[int]:
    """Split by parameter count (no sample needed); ``balance.by_time`` profiles instead."""
    costs = [1.0 + sum(p.numel() for p in layer.parameters()) for layer in module]
    return solve(costs, partitions)


def resolve_devices(devices: Optional[Sequence[Device]], partitions: int) -> List[torch.device]:
    """One device per stage; a device may be listed several times to hold several stages."""
    if devices is None:
        if torch.cuda.is_available():
            devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
        else:
            devices = ["cpu"] * partitions
    elif isinstance(devices, (str, int, torch.device)):
        raise TypeError(f"devices must be a list of devices, one per stage, got {devices!r}; "
                        f"e.g. ['cpu', 'cpu'] or ['cuda:0', 'cuda:1']")
    else:
        devices = list(devices)
        if partitions < len(devices):
            raise ValueError(
                f"devices lists {len(devices)} devices but the pipeline has {partitions} "
                f"stages, so {len(devices) - partitions} would be left unused; list one device "
                f"per stage (devices={devices[:partitions]!r}), or give balance= one layer "
                f"count per device (the module needs at least as many layers as devices)")
    devices = list(devices)
    if partitions > len(devices):
        raise TooFewDevices(
            f"the pipeline has {partitions} stages but devices lists only {len(devices)}; list "
            f"a device for each stage (a device may repeat, e.g. ['cpu'] * {partitions}) or use "
            f"fewer stages in balance")
    return [parse_device(d) for d in devices[:partitions]]


def layer_names(module: object, count: int) -> List[str]:
    """The plain module's names of its ``count`` layers: an ``nn.Sequential``'s own (``'0'``,
    or ``'embed'`` when built from an ``OrderedDict``), else their indices."""
    if isinstance(module, nn.Sequential):
        return list(module._modules)
    return [str(i) for i in range(count)]


def split(module: nn.Sequential, balance: Sequence[int]) -> List[nn.Sequential]:
    """Cut the module into consecutive ``nn.Sequential`` stages sharing its layers."""
    layers = list(module)
    parts, start = [], 0
    for count in balance:
        parts.append(nn.Sequential(*layers[start:start + count]))
        start += count
    return parts


def check_workers(workers: object) -> Optional[int]:
    """``cpu_workers``: threads for the CPU stages, ``None`` (one per core) or an int >= 1."""
    if workers is None:
        return None
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"cpu_workers must be None or a positive int (threads running the CPU "
                         f"stages), got {workers!r}")
    return workers


def worker_groups(devices: Sequence[torch.device], cpu_workers: Optional[int]) -> List[List[int]]:
    """Which stages each worker thread runs: every GPU stage its own; CPU stages in consecutive
    groups, one group per CPU worker (default: one per core, at most one per stage)."""
    cpu = [i for i, d in enumerate(devices) if d.type == "cpu"]
    groups = [[i] for i, d in enumerate(devices) if d.type != "cpu"]
    if cpu:
        count = min(len(cpu), cpu_workers or os.cpu_count() or 1)
        size, extra = divmod(len(cpu), count)
        start = 0
        for w in range(count):
            end = start + size + (1 if w < extra else 0)
            groups.append(cpu[start:end])
            start = end
    return sorted(groups)


def check_virtual_stages(virtual_stages: object) -> int:
    """``virtual_stages``: model chunks per device, an int >= 1."""
    if isinstance(virtual_stages, bool) or not isinstance(virtual_stages, int) \
            or virtual_stages < 1:
        raise ValueError(f"virtual_stages must be a positive int (model chunks per device), "
                         f"got {virtual_stages!r}")
    return virtual_stages


V_SHAPED = ("zbv", "dualpipev")
"""Schedules that hold exactly two model chunks per device."""


def resolve_virtual_stages(virtual_stages: object, schedule: object) -> int:
    """``virtual_stages``, checked; ``None`` (not given) means what ``schedule`` needs: 2 for
    the V-shaped schedules, else 1."""
    if virtual_stages is None:
        if isinstance(schedule, ScheduleData):  # a Schedule object places its own chunks
            return schedule.num_chunks
        return 2 if isinstance(schedule, str) and schedule.lower() in V_SHAPED else 1
    return check_virtual_stages(virtual_stages)


def check_chunk_count(chunks: int, virtual_stages: int) -> int:
    """The number of devices (physical stages) for ``chunks`` model chunks."""
    if chunks % virtual_stages:
        raise ValueError(f"balance has {chunks} entries, which is not a multiple of "
                         f"virtual_stages={virtual_stages}; give one layer count per model chunk "
                         f"(devices x virtual_stages entries)")
    return chunks // virtual_stages


# -------------------------------------------------------------------- casts, not moves
class StagesStayPut:
    """``to`` and the device moves of ``nn.Module`` (``cuda``, ``cpu``, ...) for a front door
    whose stages were placed at construction.

    A cast (``.to(torch.bfloat16)``, ``.to(dtype=...)``, ``.to(memory_format=...)``, ``.half()``)
    applies to every stage's tensors in place: each parameter and buffer stays the same tensor
    object, so the stages (traced ones hold buffers of their own), tied weights and an
    optimizer built over the parameters keep holding them. A move is refused (``TypeError``),
    as torchgpipe refuses it: ``.cuda()``, ``.cpu()``, ``.to(device)``, ``.to(tensor)``. A
    cast that names the device every stage of this process already lives on,
    ``.to(device, dtype)``, is a cast. The front door says where its stages are and which
    argument placed them (``_placement``).
    """

    def _placement(self) -> Tuple[Sequence[torch.device], str]:
        """The devices of this process's stages, and the argument that chooses them."""
        raise NotImplementedError  # pragma: no cover - each front door says

    def to(self, *args: Any, **kwargs: Any) -> Any:
        """Cast every stage's parameters and buffers (``dtype``, ``memory_format``); a device
        is accepted only where every stage already is (see the class)."""
        try:
            device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        except RuntimeError as error:  # a device this machine does not have
            raise self._move_refused(", ".join([*map(repr, args), *(
                f"{k}={v!r}" for k, v in kwargs.items())]), f" ({error})") from None
        cast = {name: value for name, value in (("dtype", dtype), ("memory_format", memory_format))
                if value is not None}
        if device is not None:
            with_tensor = "tensor" in kwargs or any(isinstance(a, torch.Tensor) for a in args)
            if with_tensor or not cast:  # a move (torchgpipe refuses it even when it is none)
                raise self._move_refused(str(device))
            self._stay(device)
        if not cast:
            return self
        return super().to(non_blocking=non_blocking, **cast)  # type: ignore[misc]

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        """``nn.Module._apply`` (what every cast runs), keeping each buffer the same tensor:
        ``nn.Module`` replaces buffers, which stages holding them elsewhere would not see."""
        if torch.__future__.get_overwrite_module_params_on_conversion():
            raise RuntimeError("torch.__future__.set_overwrite_module_params_on_conversion(True) "
                               "makes a cast replace every Parameter, which the stages (and "
                               "tied weights) share; cast the model before building the "
                               "pipeline, or leave that setting off")
        held = [(module, name, tensor) for module in self.modules()  # type: ignore[attr-defined]
                for name, tensor in module._buffers.items() if tensor is not None]
        result = super()._apply(fn, recurse)  # type: ignore[misc]
        for module, name, old in held:
            new = module._buffers.get(name)
            if new is not None and new is not old:
                old.data = new
                module._buffers[name] = old
        return result

    def cuda(self, device: Optional[Union[int, torch.device]] = None) -> Any:
        """Refused: a move (see the class)."""
        raise self._move_refused("cuda" if device is None else f"cuda:{device}")

    def cpu(self) -> Any:
        """Refused: a move (see the class)."""
        raise self._move_refused("cpu")

    def to_empty(self, *, device: Optional[Device], recurse: bool = True) -> Any:
        """Fresh (uninitialised) memory for every tensor, on the stages' own device only."""
        if device is not None:
            self._stay(torch.device(device))
        return super().to_empty(device=device, recurse=recurse)  # type: ignore[misc]

    def _move_elsewhere(self, *args: Any, **kwargs: Any) -> Any:
        raise self._move_refused("another device type")

    xpu = ipu = mtia = _move_elsewhere  # fastpipe places stages on 'cpu' and 'cuda' only

    def _stay(self, target: torch.device) -> None:
        devices, _ = self._placement()
        if not all(_same_device(target, d) for d in devices):
            raise self._move_refused(str(target))

    def _move_refused(self, target: str, detail: str = "") -> TypeError:
        devices, argument = self._placement()
        where = ", ".join(str(d) for d in devices) or "none"
        return TypeError(f"a {type(self).__name__}'s stages live on their own devices ({where}) "
                         f"and cannot be moved as one (to {target}){detail}; choose the "
                         f"placement with {argument}; casts such as .to(torch.bfloat16) are "
                         f"fine")


def _same_device(target: torch.device, device: torch.device) -> bool:
    """Whether ``target`` (its index may be left out) names ``device``."""
    if target.type != device.type:
        return False
    if target.type == "cpu" or target.index == device.index:
        return True
    return (target.index is None and torch.cuda.is_available()
            and torch.cuda.current_device() == device.index)
