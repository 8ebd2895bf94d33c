"""``pipe.generate(...)``: the steps, every check before the first forward.

1. The arguments (every rank alike), with the model's own settings where not given (a
   ``transformers`` model's ``generation_config``: end-of-sequence and padding tokens, and for
   sampling its temperature, top-k (``generate``'s default 50) and top-p).
2. The model's protocol (:mod:`.protocol`): a typed error for a model without a language-model
   head, or that cannot take a cache when one is asked for.
3. The prompt: read where the first stage runs (on a ``DistributedPipe``, sent to every rank),
   checked against the model's positions, prepared as ``generate`` prepares it.
4. The forwards: traced and cut into the pipe's stages on first use (:mod:`.traced`), pointed at
   this process's stage tensors.
5. The decode schedule on the pipe's executors (:mod:`.engine`), then the sequences: the prompt
   and the new tokens, on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import nn

from .. import tracing
from . import hf, ranks
from .arguments import Request, check_positions, check_prompt, check_request, sizes_of
from .bind import bind
from .engine import Run, SequentialStep, run_schedule, schedule_for
from .inputs import Feeder, Prompt, prepare
from .protocol import Protocol, protocol_of
from .sampling import Picker
from .traced import traced_model


@dataclass
class Source:
    """What a front door hands ``generate``: its model, how it is cut and placed, how it runs."""

    owner: Any  # the pipe: its traced forwards are kept with it
    module: Optional[nn.Module]  # the traced module (or its skeleton); None: a Sequential
    split_points: Any  # as the front door was given them (None or 'auto': the automatic ones)
    tensors: nn.Module  # this process's tensors under the model's names (the pipe's module)
    stages: Sequence[Any]  # per model stage: this process's Stage, or another's stand-in
    placement: Sequence[Sequence[int]]  # placement[physical stage] = its model stages
    driver: Any
    timeout: float


def generate(source: Source, input_ids: Any, max_new_tokens: Any, *,
             attention_mask: Any = None, **options: Any) -> torch.Tensor:
    """The prompt and its new tokens, (batch, length + new), as ``transformers``' ``generate``
    returns them (see ``FrontDoor.generate`` for the ``options``)."""
    module = source.module
    model = module if module is not None else nn.Module()
    _check_layout(source.owner)
    request = _request(model, max_new_tokens, **options)
    protocol = protocol_of(model, module is not None, request.use_cache)
    prompt = _prompt(source, protocol, request, input_ids, attention_mask)
    sizes = list(sizes_of(prompt.ids.shape[0], request.chunks or len(source.placement)))
    run = _run(source, protocol, prompt, request, sizes)
    schedule = schedule_for(len(source.placement), len(sizes), request.max_new_tokens,
                            tuple(tuple(row) for row in source.placement))
    driver = source.driver
    with driver.guarded():
        run_schedule(driver, schedule, source.stages, run, source.timeout)
        generated = run.picker.generated() if run.picker is not None else None
        if driver.distributed:
            last = driver.topology.owner[len(source.stages) - 1]
            generated = ranks.share_tokens(driver, last, generated, prompt.ids.shape[0])
    device = input_ids.device if isinstance(input_ids, torch.Tensor) else prompt.ids.device
    return torch.cat([prompt.ids.to(device), generated.to(device)], dim=-1)


def _request(model: nn.Module, max_new_tokens: Any, *, do_sample: Any = False,
             temperature: Any = None, top_k: Any = None, top_p: Any = None, seed: Any = None,
             eos_token_id: Any = None, pad_token_id: Any = None, chunks: Any = None,
             use_cache: Any = True) -> Request:
    """The checked request, the model's own settings filling what is not given."""
    return check_request(
        max_new_tokens, do_sample=do_sample,
        temperature=_setting(model, temperature, "temperature", 1.0, do_sample),
        top_k=_setting(model, top_k, "top_k", 50 if hf.is_hf(model) else None, do_sample),
        top_p=_setting(model, top_p, "top_p", 1.0, do_sample), seed=seed,
        eos_token_id=_own(model, eos_token_id, "eos_token_id"),
        pad_token_id=_own(model, pad_token_id, "pad_token_id"),
        chunks=chunks, use_cache=use_cache)


def _prompt(source: Source, protocol: Protocol, request: Request, input_ids: Any,
            attention_mask: Any) -> Prompt:
    """The checked prompt (on a ``DistributedPipe``: the first stage's rank's, on every rank),
    prepared for the forwards."""
    driver = source.driver
    if driver.distributed:
        ids, mask = ranks.agree_prompt(driver, request, input_ids, attention_mask)
    else:
        ids, mask = check_prompt(input_ids, attention_mask)
    check_positions(ids.shape[1], request.max_new_tokens, protocol.max_positions)
    if protocol.family == "sequential" and mask is not None and not bool((mask == 1).all()):
        raise ValueError("this pipe holds an nn.Sequential, whose layers take input_ids only: "
                         "give prompts of one length (no padding in attention_mask), or build "
                         "the pipe from a module that takes an attention_mask")
    return prepare(ids, mask, protocol, request.eos, request.pad)


def _check_layout(pipe: Any) -> None:
    """Tensor-parallel and FSDP stages hold shards, which the traced forwards do not read."""
    parallel = getattr(pipe, "parallel", None)
    if parallel is not None and getattr(parallel, "active", False):
        raise NotImplementedError(
            "generate with tensor_parallel or data_parallel='fsdp' stages: their parameters "
            "are shards; build a DistributedPipe without them (a stage per rank, whole "
            "weights) to generate")


def _own(model: nn.Module, given: Any, name: str) -> Any:
    """A token setting: as given, else the model's own (``generation_config``)."""
    return given if given is not None else hf.setting(model, name)


def _setting(model: nn.Module, given: Any, name: str, default: Any, sampling: bool) -> Any:
    """A sampling setting: as given, else the model's own (a ``transformers`` model's
    ``generation_config``), else ``generate``'s default; unused without sampling."""
    if given is not None or not sampling:
        return given if given is not None else default
    own = hf.setting(model, name)
    return own if own is not None else default


def _run(source: Source, protocol: Protocol, prompt: Prompt, request: Request,
         sizes: List[int]) -> Run:
    """This process's share of the generation: the steps of its stages, the feeders of the
    groups (where the first stage runs) and the picker (where the last one runs)."""
    stages = source.stages
    count = len(stages)
    local = [k for k, stage in enumerate(stages) if getattr(stage, "module", None) is not None]
    first, later = _steps(source, protocol, prompt, local)
    feeders: Dict[int, Feeder] = {}
    if 0 in local:
        names = prompt.names(protocol)
        for group, size in enumerate(sizes):
            start = sum(sizes[:group])
            feeders[group] = Feeder(prompt, slice(start, start + size), names, protocol.cached,
                                    stages[0].device)
    picker = (Picker(request, sizes, stages[count - 1].device) if count - 1 in local else None)
    return Run(count, first, later, feeders, picker)


def _steps(source: Source, protocol: Protocol, prompt: Prompt, local: Sequence[int]):
    """Per model stage, the prompt's step and the later steps (``None`` for another process's
    stages), bound to this process's tensors."""
    count = len(source.stages)
    if source.module is None:
        if any(getattr(stage, "skips", None) is not None for stage in source.stages):
            raise NotImplementedError("generate through skip connections (fastpipe.skip): "
                                      "build the pipe from a module, traced, instead")
        steps = [SequentialStep(source.stages[k].call, k == 0, k == count - 1)
                 if k in local else None for k in range(count)]
        return steps, steps
    points = _split_points(source, count)
    model = traced_model(source.owner, source.module, points)
    mask_dtype = prompt.mask.dtype if prompt.passes_mask else None
    first, decode = model.cuts(protocol, prompt.names(protocol), mask_dtype,
                               prompt.shared_positions)
    later = decode if decode is not None else first
    for cut in {id(first): first, id(later): later}.values():
        for k in local:
            bind(cut.stages[k], model.names, source.tensors, source.stages[k].device)
    return ([first.stages[k] if k in local else None for k in range(count)],
            [later.stages[k] if k in local else None for k in range(count)])


def _split_points(source: Source, count: int) -> List[str]:
    """The pipe's split points (the automatic ones, as the front door chose them)."""
    given = source.split_points
    if given is None or given == "auto":
        return tracing.auto_split_points(source.module, count)
    return tracing.check_split_points(source.module, given)
