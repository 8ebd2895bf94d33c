"""Process groups as users make them: which backend carries a device's tensors, which device a
rank's stages use, and which point-to-point transport runs on it.

``init_process_group()`` with no backend registers gloo for CPU tensors and NCCL for CUDA
tensors (and reports ``'undefined'``); ``backend='cpu:gloo,cuda:nccl'`` says the same
explicitly; ``'nccl'`` and ``'gloo'`` carry one device type each (gloo's point-to-point ops take
CPU tensors only). A ``DeviceMesh`` dimension stands for its process group.
:func:`init_process_group` builds the default group so that a job ``torchrun`` restarts finds
no key of an earlier attempt in its store.
"""
from __future__ import annotations

import datetime
import json
import os
import socket
from typing import Any, Dict, Optional, Union

import torch
import torch.distributed as dist

from ...errors import ProcessGroupError

P2P_MODES = ("auto", "tagged", "grouped")
"""``DistributedPipe(p2p=...)``: ``'tagged'`` sends each message when it is produced and takes it
when needed, matched by tags (gloo only: it relies on tags and buffered sends); ``'grouped'``
runs the NCCL program (``fastpipe.schedule.lower_nccl``: one group per round, exact sizes),
on NCCL or gloo; ``'auto'``: ``'grouped'`` on CUDA devices, ``'tagged'`` on the CPU."""


def attempt_scope() -> str:
    """The prefix that sets this attempt of a ``torchrun`` job apart in the job's key-value
    store: ``'attempt<N>/'`` (N: ``TORCHELASTIC_RESTART_COUNT``) when the ranks use the elastic
    agent's store, which outlives the ranks and so holds every earlier attempt's keys; ``''``
    elsewhere (a store that lives as long as its ranks, as with
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, holds no earlier attempt's keys)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return ""
    return f"attempt{int(os.environ.get('TORCHELASTIC_RESTART_COUNT', '0'))}/"


def init_process_group(backend: Optional[str] = None, *,
                       timeout: Optional[datetime.timedelta] = None, **kwargs: Any) -> None:
    """``torch.distributed.init_process_group`` from torchrun's environment, safe to restart:
    under the elastic agent's store every key the process groups write goes under
    :func:`attempt_scope`. torch's own ``init_process_group()`` writes fixed keys (the gloo
    and NCCL addresses of each rank) into that store, which every attempt of the job shares,
    so the ranks of a restarted attempt may read the addresses of the previous attempt's dead
    processes and fail (gloo: ``connectFullMesh failed ... Connection refused``) or hang.
    ``kwargs`` go to ``init_process_group`` (``device_id``, ``pg_options``, ...)."""
    scope = attempt_scope()
    if not scope or "store" in kwargs or kwargs.get("init_method") not in (None, "env://"):
        dist.init_process_group(backend, timeout=timeout, **kwargs)
        return
    kwargs.pop("init_method", None)
    wait = timeout or dist.constants.default_pg_timeout
    store, rank, world_size = next(dist.rendezvous(
        "env://", kwargs.pop("rank", -1), kwargs.pop("world_size", -1), timeout=wait))
    store.set_timeout(wait)
    dist.init_process_group(backend, store=dist.PrefixStore(scope, store), rank=rank,
                            world_size=world_size, timeout=timeout, **kwargs)


def as_group(group: Any, argument: str) -> Any:
    """A process group from a process group or a one-dimensional ``DeviceMesh``."""
    if group is None or not hasattr(group, "get_group") or not hasattr(group, "mesh"):
        return group
    if group.ndim != 1:
        names = getattr(group, "mesh_dim_names", None) or ()
        raise ProcessGroupError(f"{argument} is a {group.ndim}-dimensional DeviceMesh; pass one "
                                f"dimension of it, e.g. mesh[{names[0] if names else 'name'!r}]")
    return group.get_group()


def backend_of(group: Any, device_type: str) -> Optional[str]:
    """The backend that carries ``device_type`` tensors in ``group`` ('gloo', 'nccl', ...), or
    ``None`` when the group has none for that device type."""
    name = str(dist.get_backend(group)).lower()
    if ":" in name or "," in name:  # 'cpu:gloo,cuda:nccl'
        pairs = dict(part.split(":", 1) for part in name.split(",") if ":" in part)
        return pairs.get(device_type)
    if name == "undefined":  # init_process_group() without a backend: torch's defaults
        try:
            group._get_backend(torch.device(device_type))
        except RuntimeError:
            return None
        return dist.Backend.default_device_backend_map.get(device_type)
    if name == "gloo":
        return "gloo" if device_type == "cpu" else None
    if name == "nccl":
        return "nccl" if device_type == "cuda" else None
    return name  # another backend: trusted with any device


def resolve_device(device: Optional[Union[str, torch.device]], group: Any) -> torch.device:
    """This rank's device: ``device``, or ``cuda:LOCAL_RANK`` when the group carries CUDA
    tensors over NCCL and a GPU exists, else the CPU. Refuses a device the group cannot carry."""
    if device is None:
        if backend_of(group, "cuda") == "nccl" and torch.cuda.is_available():
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        else:
            device = torch.device("cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and resolved.index is None:
        resolved = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    backend = backend_of(group, resolved.type)
    rank = dist.get_rank()
    if backend is None:
        fix = ("init_process_group(backend='nccl') or backend='cpu:gloo,cuda:nccl'"
               if resolved.type == "cuda" else
               "init_process_group(backend='gloo') or backend='cpu:gloo,cuda:nccl'")
        raise ProcessGroupError(
            f"rank {rank}: device={str(resolved)!r} but the pipeline's process group "
            f"({dist.get_backend(group)!r}) has no backend for {resolved.type} tensors: "
            f"build it with {fix}, or pass a device it carries")
    if resolved.type == "cuda":
        if not torch.cuda.is_available() or resolved.index >= torch.cuda.device_count():
            raise ProcessGroupError(f"rank {rank}: device={str(resolved)!r} does not exist on "
                                    f"this machine ({torch.cuda.device_count()} GPUs visible)")
        torch.cuda.set_device(resolved)  # NCCL's communicators use the current device
    return resolved


def resolve_p2p(p2p: str, device: torch.device, group: Any) -> str:
    """The transport this rank runs: ``'tagged'`` or ``'grouped'`` (see :data:`P2P_MODES`)."""
    if p2p not in P2P_MODES:
        raise ValueError(f"p2p={p2p!r} is not a transport; valid: "
                         f"{', '.join(repr(m) for m in P2P_MODES)}")
    backend = backend_of(group, device.type)
    if p2p == "auto":
        return "tagged" if backend == "gloo" else "grouped"
    if p2p == "tagged" and backend != "gloo":
        raise ValueError(f"p2p='tagged' needs gloo (it matches messages by tags and relies on "
                         f"buffered sends) but {device.type} tensors go over {backend!r}; use "
                         f"p2p='grouped' (the NCCL program) or 'auto'")
    return p2p


def agreement(device: torch.device, p2p: str) -> str:
    """What ranks post on their board and compare: device type and transport (equal on every
    rank), and for a GPU the host and device (different on every rank)."""
    facts: Dict[str, Any] = {"device type": device.type, "p2p": p2p}
    if device.type == "cuda":
        facts["gpu"] = f"{socket.gethostname()}/{device}"
    return json.dumps(facts, sort_keys=True)


def check_agreement(mine: str, posted: Dict[int, str], me: int) -> None:
    """Refuse a pipeline whose ranks posted different facts (rank ``me`` checks the ranks that
    built their pipes before its first step, so the last one to build sees every other), or
    two ranks on one GPU (``'gpu'``: host and device, which NCCL cannot share)."""
    ours = json.loads(mine)
    for rank, text in sorted(posted.items()):
        if rank == me:
            continue
        theirs = json.loads(text)
        if ours.get("gpu") and theirs.get("gpu") == ours["gpu"]:
            raise ProcessGroupError(
                f"this rank and rank {rank} both run on {ours['gpu']}: NCCL cannot put two ranks "
                f"on one GPU; start as many ranks per machine as it has GPUs "
                f"(torchrun --nproc_per_node), or pass each rank its own device=")
        for name, value in ours.items():
            if name == "gpu":
                continue
            if theirs.get(name) != value:
                raise ProcessGroupError(
                    f"the pipeline's ranks disagree on {name}: this rank has {value!r}, rank "
                    f"{rank} has {theirs.get(name)!r}; build every rank's DistributedPipe with "
                    f"the same arguments (and devices of one type)")


_SIDE_CHANNELS: Dict[Any, Any] = {}  # pipeline group -> its gloo twin, made once per process


def side_channel(group: Any) -> Any:
    """The group that carries the transport's host-side messages (headers, metadata, failure
    notices) as CPU tensors over gloo, so that reading them never waits for a GPU: ``group``
    itself when it has gloo for CPU tensors (gloo, or ``'cpu:gloo,cuda:nccl'``), else a gloo
    group of the same ranks, created once (every rank of ``group`` builds its pipe, and so
    calls this, together; the other ranks of the job take no part)."""
    if backend_of(group, "cpu") == "gloo":
        return group
    if group not in _SIDE_CHANNELS:
        ranks = dist.get_process_group_ranks(group)
        _SIDE_CHANNELS[group] = dist.new_group(ranks, backend="gloo",
                                               use_local_synchronization=True)
    return _SIDE_CHANNELS[group]


def warm_up(group: Any, device: torch.device) -> None:
    """NCCL: create the pipeline group's communicator now, with every rank taking part (its
    first ``batch_isend_irecv`` may involve only some ranks, which NCCL does not allow for the
    first call on a communicator)."""
    if device.type == "cuda":
        dist.barrier(group=group, device_ids=[device.index])
