"""``FrontDoor``: what ``Pipe`` and ``DistributedPipe`` share once their stages are built.

A front door plans its pipeline (``fastpipe.frontdoor.plan``), takes the plan (``_begin``),
realises it on its devices and plugs in its driver (``fastpipe.runtime.drivers.base``): where
the stages run, how the micro-batch sizes are agreed, how gradients are synchronised. The rest
is here: the layout's read-only properties, ``forward`` / ``evaluate`` / ``generate`` /
``trace``, the steps (``StepLifecycle``, ``Training``), and the plain module's names.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, List, Optional, Tuple

import torch
from torch import nn

from .. import generation, outputs, tracing
from ..runtime.observe.step_stats import StepShape, StepStats
from ..runtime.observe.trace import Trace
from ..schedule import Schedule
from .layout import validated_schedule
from .plan import Blueprint
from .training import Training


class FrontDoor(Training, nn.Module):
    """The step lifecycle, the layout's read-only properties, and plain-module names."""

    def _begin(self, blueprint: Blueprint, **kept: Any) -> None:
        """Take the plan: its layout, the first step's micro-batch count and schedule, the
        output rules; no step traced or measured yet. ``kept``: the front door's own plain
        attributes."""
        layout = blueprint.layout
        self._keep(layout=layout, _chunks=blueprint.chunks, _schedule_name=layout.first_schedule,
                   _auto=layout.auto_schedule, _output_rules=blueprint.output_rules,
                   chunk_search=None,  # chunks='auto': a chunk_count.ChunkSearch
                   auto_ranking=None,  # schedule='auto': the ranking
                   _trace=None, _last_step=None, **kept)

    def _keep(self, **values: Any) -> None:
        """Set plain attributes outside ``nn.Module``'s registries: a module kept this way (a
        ``Pipe``'s partitions) is no submodule of the pipe, so not in its state dict."""
        for name, value in values.items():
            object.__setattr__(self, name, value)

    # ---------------------------------------------------------------- read-only properties
    @property
    def num_stages(self) -> int:
        """Physical pipeline stages (devices of a ``Pipe``, ranks of a ``DistributedPipe``)."""
        raise NotImplementedError  # pragma: no cover - each front door says

    @property
    def balance(self) -> Tuple[int, ...]:
        """Number of layers in each (virtual) stage, in model order."""
        return self.layout.balance

    @property
    def chunks(self) -> int:
        """Number of micro-batches per batch: the one requested, or with ``chunks='auto'`` the
        one the next step runs (the chosen one once ``chunk_search.chosen`` is set)."""
        return self._chunks

    @property
    def checkpoint(self) -> str:
        """The checkpoint mode."""
        return self.layout.checkpoint

    @property
    def schedule(self) -> str:
        """The name of the schedule the next step runs; ``plan(m)`` gives the schedule itself."""
        return self._schedule_name

    @property
    def virtual_stages(self) -> int:
        """Model chunks per physical stage."""
        return self.layout.virtual_stages

    @property
    def last_step(self) -> Optional[StepStats]:
        """The last training step's samples/s, wall time and measured bubble share
        (``fastpipe.runtime.observe.step_stats.StepStats``), kept without tracing; ``None``
        before the first."""
        return self.__dict__.get("_last_step")

    def plan(self, num_microbatches: Optional[int] = None) -> Schedule:
        """The validated schedule this pipe runs for ``num_microbatches`` (default ``chunks``)."""
        return validated_schedule(self.layout.fixed or self._schedule_name, self.num_stages,
                                  num_microbatches or self._chunks, self.layout.virtual_stages)

    @property
    def output_rules(self) -> outputs.OutputRules:
        """How the outputs' leaves that are not per-sample combine over micro-batches."""
        return self.__dict__.get("_output_rules") or outputs.OutputRules({}, {})

    def _step_shape(self) -> StepShape:
        """What a traced step's context says of the pipe (``fastpipe.doctor`` reads it)."""
        return StepShape(schedule=self.schedule, virtual_stages=self.virtual_stages,
                         balance=tuple(self.balance), checkpoint=self.checkpoint,
                         devices=self._local_devices())

    def _local_devices(self) -> Optional[Tuple[torch.device, ...]]:
        """The devices of the stages this process runs, one per physical stage, when it runs
        them all (a ``Pipe``); ``None`` elsewhere."""
        return None

    # ---------------------------------------------------------------- running
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the batch through the stages (the forward actions of the pipe's schedule); the
        output is on the last stage's device. A traced module takes its own positional and
        keyword inputs (``pipe(input_ids=..., attention_mask=...)``).

        When grad is enabled the output of a ``Pipe`` is connected to every stage's parameters,
        so ``loss_fn(pipe(x), y).backward()`` works as with the plain module (the backward then
        runs in autograd's order, as in GPipe). A ``DistributedPipe`` evaluates forward only
        (no graph, no recompute, nothing kept for backward): the output on the last stage's
        rank, ``None`` on the others.
        """
        inputs = args[0] if len(args) == 1 and not kwargs else tracing.Call(args, kwargs)
        with self._driver.guarded(), self._driver.forward_grad_mode():
            found, sizes = self._forward_microbatches(inputs)
        # outside guarded(): every stage has finished, so a leaf that cannot be combined is an
        # error of this call alone, not one that stops the pipe
        return None if found is None else self._gather(found, sizes, inputs)

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        """Inference: the forward pass in eval mode (dropout off, batch norms use their running
        statistics) without autograd, so nothing is checkpointed, recomputed or kept for a
        backward. The modules' train/eval modes are restored afterwards."""
        with self._evaluating():
            return self(*args, **kwargs)

    def generate(self, input_ids: Any, max_new_tokens: int, *, attention_mask: Any = None,
                 do_sample: bool = False, temperature: Optional[float] = None,
                 top_k: Optional[int] = None, top_p: Optional[float] = None,
                 seed: Optional[int] = None, eos_token_id: Any = None,
                 pad_token_id: Optional[int] = None, chunks: Optional[int] = None,
                 use_cache: bool = True) -> torch.Tensor:
        """Generate ``max_new_tokens`` tokens after each prompt of ``input_ids`` (batch,
        length), with ``attention_mask`` for left-padded prompts, as ``transformers``'
        ``model.generate`` does: the prompts and their new tokens, (batch, length + new).

        Each stage keeps the KV cache of its own layers; ``chunks`` groups of sequences
        (default: one per physical stage) are in flight at once, so the stages decode
        concurrently, and each next token goes back to the first stage inside the pipeline
        (``fastpipe.generation``). Greedy by default; ``do_sample=True`` samples with
        ``temperature``, ``top_k`` and ``top_p`` (a ``transformers`` model's own settings
        when not given) from ``seed`` (else the global generator). Generation stops at
        ``eos_token_id`` (default: the model's) and pads finished sequences with
        ``pad_token_id``. ``use_cache=False`` recomputes the whole sequence for every token
        (any causal LM, an ``nn.Sequential`` of layers included). Eval mode, no autograd.
        On a ``DistributedPipe`` every rank calls it with the same arguments; ``input_ids``
        are read on the first stage's rank, and every rank returns the sequences.
        """
        traced, split_points = self.__dict__.get("_traced", (None, None))
        source = generation.Source(self, traced, split_points, self.module, self._stages,
                                   self.plan().placement, self._driver, self.layout.timeout)
        with self._evaluating():
            return generation.generate(
                source, input_ids, max_new_tokens, attention_mask=attention_mask,
                do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
                seed=seed, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                chunks=chunks, use_cache=use_cache)

    @contextlib.contextmanager
    def _evaluating(self) -> Iterator[None]:
        """Eval mode without autograd inside the block; every module's mode restored after."""
        modes = [(m, m.training) for m in self._moded_modules()]
        self.eval()
        try:
            with torch.no_grad():
                yield
        finally:
            for m, training in modes:
                m.training = training

    def train(self, mode: bool = True) -> "FrontDoor":
        """Train or eval mode for the plain module's layers and for every stage this process
        runs: the stages of a traced module are graphs (train and eval ones, each the module
        traced in that mode), and on a ``DistributedPipe`` they are not submodules of the pipe,
        so ``nn.Module.train`` alone would not reach them."""
        super().train(mode)
        for stage in self.__dict__.get("_stages", ()):
            module = getattr(stage, "module", None)  # None: another rank's stage
            if module is not None:
                module.train(mode)
        return self

    def _moded_modules(self) -> List[nn.Module]:
        """Every module whose ``training`` flag a step reads: the pipe's and its stages'."""
        seen: dict = {}
        for m in self.modules():
            seen.setdefault(id(m), m)
        for stage in self.__dict__.get("_stages", ()):
            module = getattr(stage, "module", None)
            for m in module.modules() if module is not None else ():
                seen.setdefault(id(m), m)
        return list(seen.values())

    @contextlib.contextmanager
    def trace(self) -> Iterator[Trace]:
        """Record the real start and end of every action of the steps run inside the block.

        ``with pipe.trace() as t: pipe.train_step(...)``; then ``t.timeline`` (the same format
        the simulator returns), ``t.bubble_fraction`` and ``t.busy`` describe the last step.
        On a ``DistributedPipe`` every rank enters the block and holds the whole pipeline's
        timeline (ranks on one machine share a clock; across machines the lanes are aligned
        only as well as the machines' clocks are).
        """
        trace = Trace()
        self._trace = trace
        try:
            yield trace
        finally:
            self._trace = None

    # ---------------------------------------------------------------- plain-module names
    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[Tuple[str, nn.Parameter]]:
        """Parameters under the plain module's names (``'4.weight'``), whatever the split."""
        return self.module.named_parameters(prefix, recurse, remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[Tuple[str, torch.Tensor]]:
        """Buffers under the plain module's names."""
        return self.module.named_buffers(prefix, recurse, remove_duplicate)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The state under the plain module's names (its keys, or this rank's share of them)."""
        return self.module.state_dict(*args, **kwargs)

    def _fqn_modifiers(self) -> dict:
        """The plain module's names are the pipe's: ``torch.distributed.checkpoint.state_dict``
        (``get_state_dict(pipe, optimizer)``) reads this hook to skip the ``module`` level when
        it walks the pipe, so its keys are the plain model's FQNs."""
        return {name: "module" for name in self.module._modules}

    def _checkpoint_names(self) -> dict:
        """Each parameter's name as ``named_parameters()`` lists it, to its name in the plain
        model's ``named_parameters()``: the key of its optimizer state in checkpoints."""
        return {name: name for name, _ in self.named_parameters()}
