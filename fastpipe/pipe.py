"""``Pipe``: split an ``nn.Sequential`` into stages, place them, and run micro-batches through them.

The front door of the local executor. ``Pipe`` takes torchgpipe's ``GPipe`` arguments plus a
``schedule``; ``pipe(x)`` runs a forward pass whose output can be backpropagated as usual, and
``pipe.train_step(inputs, targets, loss_fn)`` runs forward and backward on any schedule of the IR,
accumulating exactly the gradients that the unsplit module gives on the whole batch.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from .policies import amp, batchnorm, tied as tied_weights
from . import microbatch, tracing
from .policies.checkpoint import checkpoint_stop, draw_step_seed
from .frontdoor import FrontDoor, check_checkpoint, check_step_arguments, step_loss
from .placement import (Device, auto_balance, check_balance, check_chunk_count, check_chunks,
                        check_flag, check_materialised, check_module, check_timeout,
                        check_workers, default_partitions, resolve_devices,
                        resolve_virtual_stages, split)
from .runtime import weight_versions
from .runtime.stage import Stage
from .skip import exchange as skip_exchange, layout as skip_layout
from .runtime import adaptive, auto, graphs
from .runtime.step import StepState
from .runtime.token_mean import TokenMean
from .runtime import vitals
from .runtime.trace import StepRecorder, Trace
from .runtime.workers import WorkerPolicy
from .schedule import Schedule

class Pipe(FrontDoor):
    """A pipeline-parallel wrapper of an ``nn.Sequential``.

    Args:
        module: the model, an ``nn.Sequential``; its layers are moved to the stages' devices.
        chunks: number of micro-batches each batch is split into (``torch.chunk`` semantics: a
            batch of 5 in 4 chunks gives micro-batches of 2, 2 and 1). ``'auto'``: the first
            training steps measure the throughput of candidate counts and the pipe keeps the
            best (``fastpipe.runtime.adaptive``; logged, measurements in ``chunk_search``).
        devices: one device per stage (``'cpu'``, ``'cuda:N'``; a device may repeat). Default: the
            CUDA devices, or the CPU.
        balance: layers per stage. ``None`` splits by parameter count into one stage per device;
            ``fastpipe.balance.by_time`` / ``by_size`` give profiled balances.
        checkpoint: ``'never'``, ``'except_last'`` (all micro-batches but the last recompute their
            forward in backward), ``'always'``, or ``'offload'`` (nothing recomputed: the tensors
            saved for backward wait in host memory, see ``fastpipe.policies.offload``), or
            ``'selective'`` (matrix-product outputs kept, everything else recomputed in backward,
            see ``fastpipe.policies.selective``).
        schedule: a schedule name of ``fastpipe.schedule`` (``'gpipe'``, ``'1f1b'``,
            ``'interleaved'``, ``'looped-bfs'``, ``'zb-h1'``, ``'zbv'``, ``'dualpipev'``), or
            ``'auto'``: the first ``train_step`` runs 1F1B (looped BFS with virtual stages),
            measures each action, and the pipe keeps the schedule the simulator predicts fastest
            for those costs (see ``fastpipe.runtime.auto``; the choice is logged and kept in
            ``auto_ranking``).
        virtual_stages: model chunks per device, for interleaved and V-shaped schedules; then
            ``balance`` lists ``len(devices) * virtual_stages`` chunk sizes in model order and
            the schedule's placement decides which device holds which chunk. Default: 2 for
            ``'zbv'`` and ``'dualpipev'`` (they need two), else 1.
        timeout: seconds any stage may wait for an input (and any action may run) before the
            step fails with an error naming the stage, the action and the micro-batch.
        cpu_workers: threads that run the CPU stages (consecutive stages share a thread when
            there are more stages than threads). Default ``None``: one per core (at most one per
            stage) while actions are long, one in all when the measured time per action is so
            short that hand-offs between threads would cost more than the overlap gains.
            Each GPU stage always has its own thread.
        deferred_batch_norm: normalise each micro-batch with its own statistics but update
            batch-norm running statistics once per mini-batch, from all its micro-batches, so
            they match the plain model's (torchgpipe's semantics; see ``fastpipe.batchnorm``).
        tied: groups of parameters to tie, by plain-module name or as Parameters, e.g.
            ``[('0.weight', '5.weight')]``: each group becomes the first one's Parameter. Layers
            of several stages sharing a Parameter (tied in the module or here) keep sharing it,
            across devices too (see ``fastpipe.tied``). Skip connections between layers are
            declared on the layers (see ``fastpipe.skip``).
        cuda_graphs: capture each CUDA stage's forward and backward as CUDA graphs, per input
            shape and dtype, and replay them in training steps (fewer kernel launches; see
            ``fastpipe.runtime.graphs``). CPU stages, unusual inputs and failed captures run
            eagerly, with one warning each.
        vertical_sync: with ``schedule='pipedream'``, run each micro-batch on every stage with
            the weight version stage 0 gave it (see ``fastpipe.runtime.weight_versions``).
        split_points: for any ``nn.Module`` (or to cut an ``nn.Sequential`` by submodule
            names): submodule names, each beginning a stage, or ``'auto'`` (the largest list of
            repeated blocks, cut into ``len(devices) * virtual_stages`` stages). The module is
            traced with ``torch.export`` (``fastpipe.tracing``); names, ties, inputs and outputs
            stay the module's own.
        example_inputs: the batch the module is traced on (a tensor, a tuple of positional
            inputs, a dict of keyword inputs); required for a module other than a Sequential.
    """

    def __init__(self, module: nn.Sequential, chunks: Union[int, str] = 1,
                 devices: Optional[Sequence[Device]] = None,
                 balance: Optional[Sequence[int]] = None, checkpoint: str = "except_last",
                 schedule: str = "gpipe", *, virtual_stages: Optional[int] = None,
                 timeout: float = 300.0, cpu_workers: Optional[int] = None,
                 deferred_batch_norm: bool = False, tied: Sequence[Sequence[Any]] = (),
                 vertical_sync: bool = False, cuda_graphs: bool = False,
                 split_points: Optional[Any] = None, example_inputs: Optional[Any] = None) -> None:
        super().__init__()
        traced = module if tracing.wanted(module, split_points) else None
        if traced is not None:  # any module: traced, cut at split_points (fastpipe.tracing)
            check_materialised(traced)
            module, balance = tracing.stages_of(
                traced, split_points, example_inputs,
                tracing.stage_count(devices, resolve_virtual_stages(virtual_stages,
                                                                    schedule))), None
        module = check_module(module)
        check_materialised(module)
        self._auto_chunks = isinstance(chunks, str) and chunks == "auto"
        self._chunks = 1 if self._auto_chunks else check_chunks(chunks)
        object.__setattr__(self, "chunk_search", None)  # chunks='auto': an adaptive.ChunkSearch
        self._checkpoint = check_checkpoint(checkpoint)
        self._timeout = check_timeout(timeout)
        self._virtual = resolve_virtual_stages(virtual_stages, schedule)
        workers = check_workers(cpu_workers)
        deferred = check_flag(deferred_batch_norm, "deferred_batch_norm")
        use_graphs = check_flag(cuda_graphs, "cuda_graphs")
        v = self._virtual
        self._schedule_name = auto.check_name(schedule)
        self._auto = self._schedule_name == "auto"
        if self._auto:
            self._schedule_name = auto.first_schedule(v)
        object.__setattr__(self, "auto_ranking", None)
        if len(module) < v:
            raise ValueError(f"virtual_stages={v} needs at least {v} layers per device but the "
                             f"module has {len(module)}; lower virtual_stages")
        if balance is None:
            stages = max(1, min(default_partitions(module, devices), len(module) // v))
            balance = auto_balance(module, stages * v)
        self._balance = tuple(check_balance(balance, module))
        skips = skip_layout.plan(module, self._balance)  # raises for inconsistent skip names
        tie_groups = tied_weights.check(module, tied)
        asynchronous = self._schedule_name == "pipedream"
        if check_flag(vertical_sync, "vertical_sync") and not asynchronous:
            raise ValueError(f"vertical_sync=True applies to schedule='pipedream' only, got "
                             f"schedule={schedule!r}")
        num_stages = check_chunk_count(len(self._balance), v)
        self._devices = tuple(resolve_devices(devices, num_stages))
        if self._auto_chunks:
            self._chunks = adaptive.first_count(num_stages, self._accepts)
        plan = self.plan(self._chunks)  # raises for a schedule that cannot run this layout
        tied_weights.tie(module, tie_groups)
        self.module = module
        parts = split(module, self._balance)
        where = [self._devices[plan.stage_of(k)[0]] for k in range(len(parts))]
        for part, device in zip(parts, where):
            part.to(device)
        object.__setattr__(self, "_partitions", nn.ModuleList(parts))
        object.__setattr__(self, "_stages", [Stage(k, part, device, deferred_batch_norm=deferred)
                                             for k, (part, device) in enumerate(zip(parts, where))])
        object.__setattr__(self, "_tied_grads", tied_weights.bind(
            self._stages, tied_weights.find(module, self._balance)))
        skip_exchange.wire(self._stages, skips)
        if use_graphs:
            graphs.enable(self._stages)
        self._pipedream = (weight_versions.PipeDream(self._stages, vertical_sync) if asynchronous
                           else None)
        if traced is not None:
            self.module = traced  # names, state dicts and modes are the traced module's
        object.__setattr__(self, "_workers", WorkerPolicy(self._devices, workers))
        object.__setattr__(self, "_trace", None)

    # ---------------------------------------------------------------- read-only properties
    @property
    def partitions(self) -> nn.ModuleList:
        """The stages' modules, in order (each an ``nn.Sequential`` of the original layers)."""
        return self._partitions

    @property
    def devices(self) -> Tuple[torch.device, ...]:
        """Device of each stage."""
        return self._devices

    @property
    def cpu_workers(self) -> int:
        """Threads that run the CPU stages in the next step."""
        return self._workers.current

    @property
    def num_stages(self) -> int:
        """Physical stages (``len(devices)``)."""
        return len(self._devices)

    @contextlib.contextmanager
    def trace(self) -> Iterator[Trace]:
        """Record the real start and end of every action of the steps run inside the block.

        ``with pipe.trace() as t: pipe.train_step(...)``; then ``t.timeline`` (the same format
        the simulator returns), ``t.bubble_fraction`` and ``t.busy`` describe the last step.
        """
        trace = Trace()
        object.__setattr__(self, "_trace", trace)
        try:
            yield trace
        finally:
            object.__setattr__(self, "_trace", None)

    # ---------------------------------------------------------------- running
    def train_step(self, inputs: Any, targets: Any, loss_fn: Callable[[Any, Any], torch.Tensor],
                   *, loss_reduction: str = "mean", scaler: Optional[Any] = None,
                   optimizer: Optional[torch.optim.Optimizer] = None) -> torch.Tensor:
        """Forward and backward of one batch on the pipe's schedule; returns the (detached) loss.

        Adds to every parameter's ``.grad`` what ``loss_fn(module(inputs), targets).backward()``
        adds. ``loss_reduction='mean'`` weights each micro-batch's loss by its share of the batch
        (exact for losses that average over the batch); ``'sum'`` adds them (for summed losses).
        ``scaler``: a ``torch.amp.GradScaler``; each micro-batch's backward starts from its
        scaled loss (the returned loss is unscaled); then ``scaler.step(optimizer)`` with one
        optimizer over ``pipe.parameters()`` and ``scaler.update()``, or pass ``optimizer``
        (see ``fastpipe.amp``).
        ``optimizer``: stepped once after the backward (through ``scaler`` when given); it does
        not zero the gradients: call ``optimizer.zero_grad()`` before each step as usual. Under
        ``schedule='pipedream'`` it is required, and each stage steps it on its own parameters
        after every micro-batch's backward, with that micro-batch's gradient (``.grad`` then
        holds the last one); see ``fastpipe.runtime.weight_versions`` for the exact semantics.
        """
        scaler = amp.check_scaler(scaler)
        check_step_arguments(loss_fn, loss_reduction, optimizer, self._pipedream is not None,
                             scaler)
        total = microbatch.batch_size(inputs, argument="inputs")
        target_total = microbatch.batch_size(targets, argument="targets")
        if target_total != total:
            raise ValueError(f"targets has batch size {target_total} but inputs has {total}; "
                             f"give one target per input sample")
        sizes = self._split(total, self._step_chunks(total))
        start = time.perf_counter()
        schedule = self.plan(len(sizes))
        weights = [s / total for s in sizes] if loss_reduction == "mean" else [1.0] * len(sizes)
        step = self._new_step(microbatch.scatter(inputs, sizes), train=True, grad_enabled=True,
                              stop=checkpoint_stop(self._checkpoint, len(sizes)),
                              targets=microbatch.scatter(targets, sizes), loss_fn=loss_fn,
                              loss_weights=weights, scaler=scaler)
        step.split = schedule.split_backwards
        if self._pipedream is not None:
            step.handlers = self._pipedream.handlers(optimizer)
        else:
            step.token_mean = TokenMean(self.parameters)
        self._run(schedule.actions, step, schedule)
        loss = step_loss(step, len(sizes), sizes, loss_reduction)
        if optimizer is not None and self._pipedream is None:
            weight_versions.step_optimizer(optimizer, scaler)
        self._measured(total, start)
        vitals.finish_step(self, step, total, start)
        return loss

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the batch through the stages (the forward actions of the pipe's schedule); the
        output is on the last stage's device. A traced module takes its own positional and
        keyword inputs (``pipe(input_ids=..., attention_mask=...)``).

        When grad is enabled the output is connected to every stage's parameters, so
        ``loss_fn(pipe(x), y).backward()`` works as with the plain module (the backward then runs
        in autograd's order, as in GPipe).
        """
        inputs = args[0] if len(args) == 1 and not kwargs else tracing.Call(args, kwargs)
        total = microbatch.batch_size(inputs, argument="inputs")
        sizes = self._split(total, self._chunks)
        schedule = self.plan(len(sizes))
        grad = torch.is_grad_enabled()
        stop = checkpoint_stop(self._checkpoint, len(sizes)) if grad and self.training else 0
        step = self._new_step(microbatch.scatter(inputs, sizes), train=False, grad_enabled=grad,
                              stop=stop)
        self._run(schedule.forward_actions, step, schedule)
        return microbatch.gather([step.outputs[i] for i in range(len(sizes))])

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        """Inference: the forward pass in eval mode (dropout off, batch norms use their running
        statistics) without autograd, so nothing is checkpointed, recomputed or kept for a
        backward. The modules' train/eval modes are restored afterwards."""
        modes = [(m, m.training) for m in self.modules()]
        self.eval()
        try:
            with torch.no_grad():
                return self(*args, **kwargs)
        finally:
            for m, training in modes:
                m.training = training

    def _step_chunks(self, total: int) -> int:
        """The micro-batch count of the next training step; ``chunks='auto'`` searches it."""
        if self._auto_chunks and self.chunk_search is None:
            search = self._new_chunk_search(total)
            object.__setattr__(self, "chunk_search", search)
            self._chunks = search.next()
        return min(self._chunks, total) if self._auto_chunks else self._chunks

    def _measured(self, total: int, start: float) -> None:
        """``chunks='auto'``: report the step's time to the search, take its next count."""
        search = self.chunk_search
        if search is None or search.chosen is not None:
            return
        adaptive.wait_for(self._devices, self._timeout)
        search.record(self._chunks, total, time.perf_counter() - start)
        self._chunks = search.next()

    def _run(self, programs: Sequence[Sequence[Any]], step: StepState, schedule: Schedule) -> None:
        trace = self._trace
        if trace is not None or (self._auto and step.train):
            step.recorder = StepRecorder(len(self._devices))
        _order_streams(self._stages, before=True)
        batchnorm.discard(self._stages)
        graphs.before_step(self._stages, step.train)
        self._tied_grads.begin(step.train and step.handlers is None)  # not under PipeDream
        try:
            self._workers.executor().run(programs, step, schedule)
        finally:
            _order_streams(self._stages, before=False)
        self._tied_grads.flush()  # tied weights' gradients, summed in stage order
        graphs.after_step(self._stages)
        batchnorm.commit(self._stages)
        self._workers.observe(step)
        if step.recorder is not None:
            timeline = step.recorder.timeline(dict(enumerate(self._devices)), self._timeout)
            if trace is not None:
                trace.timelines.append(timeline)
            if self._auto and step.train:
                self._choose_schedule(timeline, schedule)

    def _choose_schedule(self, timeline: Any, schedule: Schedule) -> None:
        """``schedule='auto'``: rank the candidate schedules by simulated step time with the
        costs measured in the first step, and run the fastest from now on."""
        ranking = auto.rank(timeline, schedule)
        object.__setattr__(self, "auto_ranking", ranking)
        self._schedule_name, self._auto = ranking[0].name, False
        auto.log_choice(ranking)

    def _new_step(self, inputs: List[Any], *, train: bool, grad_enabled: bool, stop: int,
                  **kwargs: Any) -> StepState:
        for stage in self._stages:
            stage.rng.reset()
        return StepState(stages=self._stages, inputs=inputs, train=train, seed=draw_step_seed(),
                         checkpoint_stop=stop, timeout=self._timeout, grad_enabled=grad_enabled,
                         checkpoint_mode=self._checkpoint, **kwargs)

    # ---------------------------------------------------------------- plain-module names
    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load a plain module's state dict; tensors are copied onto each stage's device."""
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def _deny_move(self, *args: Any, **kwargs: Any) -> "Pipe":
        raise TypeError("a Pipe's stages live on their own devices and cannot be moved as one; "
                        "choose the placement with Pipe(devices=...)")

    to = cuda = cpu = _deny_move  # type: ignore[assignment]

    def __repr__(self) -> str:
        layout = ", ".join(f"{b}@{d}" for b, d in zip(self._balance, self._devices))
        return (f"Pipe(stages=[{layout}], chunks={self._chunks}, schedule={self._schedule_name!r}, "
                f"checkpoint={self._checkpoint!r})")

    def __del__(self) -> None:
        workers = self.__dict__.get("_workers")
        if workers is not None:
            workers.shutdown()


def _order_streams(stages: Sequence[Stage], *, before: bool) -> None:
    """Order the stages' CUDA streams after the caller's work (parameters just updated by an
    optimizer, inputs just made) before a step, and the caller's streams after the stages' work
    (gradients, outputs) once it ends. A no-op for CPU stages."""
    for stage in stages:
        if stage.stream is not None:
            caller = torch.cuda.current_stream(stage.device)
            if before:
                stage.stream.wait_stream(caller)
            else:
                caller.wait_stream(stage.stream)

