"""One pipe's model as generation runs it, traced per kind of forward on first use.

A kind of forward is the prefill (with a cache) or every forward (without one), and the decode
forward, for one set of inputs (an attention mask or not, its dtype, one row of positions or one
per sequence). Each is traced with ``torch.export`` once, on small example inputs (batch 2,
prompt 3: no size is 0 or 1, so none is fixed by the trace), cut into the pipe's stages
(:mod:`.split`) and kept with the pipe; later calls take any batch and length. A model whose
tensors all live on one device is traced as it is (in eval mode), as the pipe's own forward
was; one spread over devices, or partly on the ``meta`` device (a ``DistributedPipe`` rank
holds only its stages' tensors), is traced as a copy on the ``meta`` device, tensors it
creates without a device included.
"""
from __future__ import annotations

import contextlib
import copy
import logging
import weakref
from typing import Any, Dict, Iterator, Optional, Sequence, Tuple

import torch
from torch import fx, nn

from .. import tracing
from . import split
from .protocol import Protocol, StepModule
from .split import Cut

BATCH, LENGTH = 2, 3  # the example inputs' sizes (neither 0 nor 1)
Kind = Tuple[bool, Tuple[str, ...], Optional[torch.dtype], bool]


class TracedModel:
    """The traced forwards of one model, cut at ``split_points`` (built on first use).
    ``names`` gives each traced tensor's name in the model (by ``id``)."""

    def __init__(self, module: nn.Module, split_points: Sequence[str]) -> None:
        self.device = _one_device(module)
        if self.device is not None:
            self.model, self.names = module, _names_of(module)
        else:
            self.model, self.names = _meta_copy(module)
        self.split_points = list(split_points)
        self._cuts: Dict[Kind, Tuple[Cut, Optional[Cut]]] = {}

    def cuts(self, protocol: Protocol, names: Sequence[str], mask_dtype: Optional[torch.dtype],
             shared_positions: bool) -> Tuple[Cut, Optional[Cut]]:
        """The first forward's cut and, with a cache, the decode forward's, for inputs
        ``names`` (an attention mask of ``mask_dtype``; one row of positions for every sequence
        when ``shared_positions``)."""
        kind = (protocol.cached, tuple(names), mask_dtype, shared_positions)
        if kind not in self._cuts:
            self._cuts[kind] = self._build(protocol, tuple(names), mask_dtype, shared_positions)
        return self._cuts[kind]

    def _build(self, protocol: Protocol, names: Tuple[str, ...],
               mask_dtype: Optional[torch.dtype], shared: bool) -> Tuple[Cut, Optional[Cut]]:
        step = StepModule(self.model, protocol, names)
        device = self.device or torch.device("meta")
        training = self.model.training
        self.model.eval()
        try:
            with contextlib.nullcontext() if self.device is not None else device:
                inputs = _examples(names, LENGTH, LENGTH, mask_dtype, shared, device)
                first_gm = _trace(step, inputs, None)
                if not protocol.cached:
                    return split.cut(first_gm, self.split_points, len(inputs)), None
                with torch.no_grad():
                    _, cache = first_gm(inputs)  # the cache's shapes after the prompt
                decode_inputs = _examples(names, 1, LENGTH + 1, mask_dtype, shared, device)
                decode_gm = _trace(step, decode_inputs, cache)
        finally:
            self.model.train(training)
        first = split.cut(first_gm, self.split_points, len(inputs))
        decode = split.cut(decode_gm, self.split_points, len(decode_inputs))
        if decode.owners != first.owners:
            raise split.StepError(
                f"the prompt's forward leaves the cached tensors on stages {first.owners} but "
                f"the next forward reads them on stages {decode.owners}; cut the model between "
                f"its layers (split_points naming its blocks)")
        return first, decode


def skeleton(module: nn.Module) -> nn.Module:
    """``module`` with its tensors on the ``meta`` device (no memory): what a front door keeps
    to trace generation's forwards later without keeping the model's other tensors alive."""
    return _meta_copy(module)[0]


def _one_device(module: nn.Module) -> Optional[torch.device]:
    """The device of all of ``module``'s tensors, if they are on one and none is meta."""
    devices = {t.device for t in [*module.parameters(), *module.buffers()]}
    if len(devices) != 1:
        return None
    device = devices.pop()
    return None if device.type == "meta" else device


def _names_of(module: nn.Module) -> Dict[int, str]:
    """Each of ``module``'s tensors' (first) name in it, by ``id``."""
    names: Dict[int, str] = {}
    for name, tensor in [*module.named_parameters(remove_duplicate=False),
                         *module.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(tensor), name)
    return names


def _meta_copy(module: nn.Module) -> Tuple[nn.Module, Dict[int, str]]:
    """A copy of ``module`` whose parameters and buffers are on the ``meta`` device (ties
    kept, no memory), and each meta tensor's name in ``module`` (by ``id``)."""
    memo: Dict[int, Any] = {}
    names: Dict[int, str] = {}
    for name, tensor in [*module.named_parameters(remove_duplicate=False),
                         *module.named_buffers(remove_duplicate=False)]:
        if id(tensor) in memo:
            continue
        meta = torch.empty_like(tensor, device="meta")
        if isinstance(tensor, nn.Parameter):
            meta = nn.Parameter(meta, requires_grad=tensor.requires_grad)
        memo[id(tensor)] = meta
        names[id(meta)] = name
    return copy.deepcopy(module, memo), names


def _examples(names: Sequence[str], length: int, mask_length: int,
              mask_dtype: Optional[torch.dtype], shared_positions: bool,
              device: torch.device) -> Tuple[torch.Tensor, ...]:
    shapes: Dict[str, Any] = {
        "input_ids": ((BATCH, length), torch.long),
        "position_ids": ((1 if shared_positions else BATCH, length), torch.long),
        "attention_mask": ((BATCH, mask_length), mask_dtype or torch.long)}
    return tuple(torch.zeros(*shapes[name][0], dtype=shapes[name][1], device=device)
                 for name in names)


def _trace(step: StepModule, inputs: Tuple[torch.Tensor, ...], cache: Any) -> fx.GraphModule:
    """``step`` traced on ``(inputs, cache)``, every dimension dynamic but those of size 1."""
    args = (inputs,) if cache is None else (inputs, cache)
    try:
        with _quiet_export():  # sizes of 1 (one new token, one row of positions) are meant
            return tracing.trace(step, tracing.Call(args, {}))
    except tracing.TraceError as error:
        raise tracing.TraceError(
            f"generate could not trace {type(step.model).__name__} with "
            f"{'its cache' if cache is not None else 'its inputs'}: "
            f"{str(error.__cause__ or error).splitlines()[0]}. Pass use_cache=False (each new "
            f"token recomputes the whole sequence), or give a module whose forward(input_ids, "
            f"past_key_values=None) returns (logits, past_key_values) as tensors") from error


@contextlib.contextmanager
def _quiet_export() -> Iterator[None]:
    """``torch.export`` logs a warning for every dimension of size 1 it fixes."""
    logger = logging.getLogger("torch._export.non_strict_utils")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


_models: "weakref.WeakKeyDictionary[Any, TracedModel]" = weakref.WeakKeyDictionary()


def traced_model(pipe: Any, module: nn.Module, split_points: Sequence[str]) -> TracedModel:
    """``pipe``'s traced model (made on first use, kept as long as the pipe)."""
    found = _models.get(pipe)
    if found is None:
        found = _models[pipe] = TracedModel(module, split_points)
    return found
