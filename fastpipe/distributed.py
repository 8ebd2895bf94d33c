"""``DistributedPipe``: one process per pipeline rank, messages over ``torch.distributed``.

Launch with ``torchrun --nproc_per_node=N script.py``; in the script, after
``torch.distributed.init_process_group()``, every rank builds the same ``DistributedPipe`` and
calls ``train_step`` with the same arguments (inputs are read on the first stage's rank, targets
on the last stage's rank; other ranks may pass ``None``). Each rank keeps only its own stages'
layers. The schedule, the stage runtime and the exactness guarantees are those of ``Pipe``: the
same IR drives both, only the transport differs (p2p sends and receives instead of mailboxes).

Data parallelism composes: give each pipeline its ``process_group`` and each stage's replicas a
``data_parallel_group`` (``init_mesh(pipeline=P, data=D)`` builds both); gradients are then
averaged across replicas, each stage's as soon as its last backward of the step ends.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import time
from collections import OrderedDict
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

from .policies import amp, batchnorm, tied as tied_weights
from . import materialise, microbatch, tracing
from .runtime import adaptive, auto
from .policies.checkpoint import checkpoint_stop, draw_step_seed
from .errors import PeerLost, PipelineAborted, PipelineError, ProcessGroupError
from .frontdoor import FrontDoor, check_checkpoint, check_step_arguments, warn_uneven_mean
from .placement import (auto_balance, check_balance, check_chunks, check_flag, check_timeout,
                        layer_names, resolve_virtual_stages)
from .runtime.board import Board, wait_work
from .runtime.dist_executor import DistributedExecutor, Topology, last_gradient_actions
from .runtime.grad_sync import GradSync
from .runtime.lowering import skip_links
from .runtime.stage import Stage
from .runtime import weight_versions
from .runtime.weight_versions import step_optimizer
from .runtime.step import StepState
from .runtime.token_mean import TokenMean
from .runtime.tied_sync import TiedSync
from .runtime import vitals
from .runtime.trace import StepRecorder, Trace
from .schedule.timeline import Timeline
from .schedule import Schedule
from .skip import exchange as skip_exchange, layout as skip_layout
from .skip.api import declaration

LayerFactory = Callable[[], nn.Module]
Layers = Union[nn.Sequential, Sequence[LayerFactory]]

_instances = itertools.count()  # ranks build their pipes in the same order: same ids everywhere


class _RemoteStage:
    """Stands for a virtual stage another rank holds (the handlers only read its index and
    the device its messages are staged on)."""

    def __init__(self, index: int, device: torch.device) -> None:
        self.index = index
        self.device = device


class DistributedPipe(FrontDoor):
    """A pipeline whose stages live in different processes (one rank per pipeline stage).

    Args:
        module: the whole model as an ``nn.Sequential`` (it may be built on the ``meta`` device:
            each rank then materialises only its own layers, with ``to_empty`` and the layers'
            ``reset_parameters``), or a list of zero-argument functions that each build one
            layer, so a rank builds only the layers it keeps.
        chunks: micro-batches per batch (``torch.chunk`` semantics, as in ``Pipe``), or
            ``'auto'``: the rank of the first stage searches the count with the best measured
            step throughput (``fastpipe.runtime.adaptive``); the others follow the count each
            step's first message announces.
        schedule: a schedule name of ``fastpipe.schedule`` (``'gpipe'``, ``'1f1b'``,
            ``'interleaved'``, ``'looped-bfs'``, ``'zb-h1'``, ``'zbv'``, ``'dualpipev'``,
            ``'pipedream'``), or ``'auto'``: the first training step runs 1F1B (looped BFS with
            virtual stages) and is traced on every rank; every rank then ranks the same
            gathered timeline with the simulator (as ``Pipe`` does) and keeps the same choice.
        balance: layers per virtual stage in model order (``ranks * virtual_stages`` entries);
            default: by parameter count for an ``nn.Sequential``, by layer count for factories.
        checkpoint: a checkpoint mode of ``Pipe`` (``'never'``, ``'except_last'``,
            ``'always'``, ``'selective'``, ``'offload'``).
        virtual_stages: model chunks per rank (interleaved and V-shaped schedules; default 2
            for ``'zbv'`` and ``'dualpipev'``, else 1).
        process_group: the pipeline's ranks, in stage order (default: the whole world).
        data_parallel_group: the replicas of this rank's stage in other pipelines; their
            gradients are averaged (default: none).
        device: where this rank's layers run: the CPU (the default, and for now the only
            choice: messages go over gloo, see below).
        timeout: seconds any wait (a message, a send, a collective) may take before the step
            fails with an error naming the rank, the stage, the action and the micro-batch.
        deferred_batch_norm: as in ``Pipe``: running statistics over the whole mini-batch.
        tied: as in ``Pipe``: groups of parameters (plain-module names) to tie. Parameters the
            module already shares stay tied. A tied parameter used on several ranks has a copy
            on each; the copies start equal (broadcast from the first stage that uses it), their
            gradients are summed across those ranks at the end of every step, so identical
            optimizer steps keep them equal.
        split_points, example_inputs: as in ``Pipe``: any ``nn.Module`` is traced on
            ``example_inputs`` (every rank passes them) and cut at ``split_points``
            (``fastpipe.tracing``); names and state dicts are the module's own.
        init_weights: for a model built on the ``meta`` device, a function of one submodule
            that initialises its own tensors (a Hugging Face model's ``_init_weights``); each
            rank gives memory only to what its stages use (``fastpipe.materialise``). Default:
            each submodule's ``reset_parameters()``.
    """

    def __init__(self, module: Layers, chunks: int = 1, schedule: str = "1f1b",
                 balance: Optional[Sequence[int]] = None, checkpoint: str = "except_last", *,
                 virtual_stages: Optional[int] = None, process_group: Optional[Any] = None,
                 data_parallel_group: Optional[Any] = None,
                 device: Optional[Union[str, torch.device]] = None,
                 timeout: float = 300.0, deferred_batch_norm: bool = False,
                 tied: Sequence[Sequence[Any]] = (), split_points: Optional[Any] = None,
                 example_inputs: Optional[Any] = None,
                 init_weights: Optional[Callable[[nn.Module], Any]] = None) -> None:
        super().__init__()
        if not dist.is_available() or not dist.is_initialized():
            raise ProcessGroupError("DistributedPipe needs torch.distributed: call "
                               "torch.distributed.init_process_group() first (under torchrun the "
                               "environment provides the rendezvous), or use fastpipe.Pipe in one "
                               "process")
        traced = module if tracing.wanted(module, split_points) else None
        if traced is not None:  # any module: traced, cut at split_points (fastpipe.tracing)
            group = process_group if process_group is not None else dist.group.WORLD
            count = dist.get_world_size(group) * resolve_virtual_stages(virtual_stages, schedule)
            module = tracing.stages_of(traced, split_points, example_inputs, count, follow=False)
        layers = _check_layers(module)
        self._auto_chunks = isinstance(chunks, str) and chunks == "auto"
        deferred = check_flag(deferred_batch_norm, "deferred_batch_norm")
        tie_groups = _check_tied(module, tied)
        self._chunks = 1 if self._auto_chunks else check_chunks(chunks)
        self.chunk_search: Optional[adaptive.ChunkSearch] = None  # chunks='auto', first rank
        self._checkpoint = check_checkpoint(checkpoint)
        self._timeout = check_timeout(timeout)
        self._virtual = resolve_virtual_stages(virtual_stages, schedule)
        self._schedule_name = auto.check_name(schedule)
        self._auto = self._schedule_name == "auto"
        if self._auto:
            self._schedule_name = auto.first_schedule(self._virtual)
        self.auto_ranking: Optional[List[Any]] = None
        self._group = process_group if process_group is not None else dist.group.WORLD
        ranks = dist.get_process_group_ranks(self._group)
        p, v = len(ranks), self._virtual
        self._balance = tuple(_balance(module, layers, balance, p * v))
        skips = _skip_plans(module, self._balance)
        if self._auto_chunks:
            self._chunks = adaptive.first_count(p, self._accepts)
        plan = self.plan(self._chunks)  # raises for a schedule that cannot run this layout
        rank = dist.get_rank()
        stage = ranks.index(rank)
        owner = [ranks[plan.stage_of(k)[0]] for k in range(p * v)]
        self._device = _resolve_device(device, self._group)
        if tie_groups:
            tied_weights.tie(module, tie_groups)
        shared = (tied_weights.find(module, self._balance)
                  if isinstance(module, nn.Sequential) else [])
        self._topology = Topology(owner, rank, stage, self._group, self._device)
        starts = [0, *itertools.accumulate(self._balance)]
        kept: "OrderedDict[str, nn.Module]" = OrderedDict()
        keys = layer_names(module, len(layers))
        stages: List[Any] = []
        init = materialise.check_init_weights(init_weights)
        if isinstance(module, nn.Module):  # meta tensors this rank uses get memory, ties kept
            new = materialise.materialise_used(
                traced if traced is not None else module,
                [layers[i] for k in range(p * v) if owner[k] == rank
                 for i in range(starts[k], starts[k + 1])], self._device, init)
            shared = [dataclasses.replace(w, parameter=new.get(id(w.parameter), w.parameter))
                      for w in shared]
        for k in range(p * v):
            if owner[k] != rank:
                stages.append(_RemoteStage(k, self._device))
                continue
            part = OrderedDict((keys[i], _materialise(layers[i], self._device, init))
                               for i in range(starts[k], starts[k + 1]))
            kept.update(part)
            stages.append(Stage(k, nn.Sequential(part), self._device,
                                deferred_batch_norm=deferred))
        _no_skips_in_factories(module, kept)
        self.module = nn.Sequential(kept)  # this rank's layers under their plain-model names
        if traced is not None:  # this rank's parameters and buffers under the module's names
            self.module = tracing.local_view(traced, self.module)
        object.__setattr__(self, "_stages", stages)
        object.__setattr__(self, "_local", [k for k in range(p * v) if owner[k] == rank])
        self._skips = {k: plan for k, plan in skips.items() if k in self._local}
        skip_exchange.wire(stages, self._skips)
        self._board = Board(f"pipe{next(_instances)}", rank, ranks=ranks)
        self._executor = DistributedExecutor(self._topology, self._board, self._after_action,
                                             skip_links(skips.values()))
        self._sync = _grad_sync(data_parallel_group, self._board, self._timeout)
        self._tied = TiedSync(shared, owner, self._group, self._device, self._board,
                              self._timeout)
        self._pipedream = (weight_versions.PipeDream(stages) if self._schedule_name == "pipedream"
                           else None)
        _check_asynchronous(self._pipedream, data_parallel_group, self._tied)
        self._tied.broadcast_initial()
        self._data_group = data_parallel_group
        self._steps = 0
        self._trace: Optional[Trace] = None
        self._broken: Optional[str] = None
        self._last_actions: Dict[Any, int] = {}

    # ---------------------------------------------------------------- properties
    @property
    def stages(self) -> Tuple[int, ...]:
        """The virtual stages this rank holds."""
        return tuple(self._local)

    @property
    def device(self) -> torch.device:
        """Where this rank's layers run."""
        return self._device

    @property
    def num_stages(self) -> int:
        """Physical stages: the ranks of the pipeline's process group."""
        return dist.get_world_size(self._group)

    # ---------------------------------------------------------------- running
    def train_step(self, inputs: Any, targets: Any, loss_fn: Callable[[Any, Any], torch.Tensor],
                   *, loss_reduction: str = "mean", scaler: Optional[Any] = None,
                   optimizer: Optional[torch.optim.Optimizer] = None) -> torch.Tensor:
        """Forward and backward of one batch on every rank; returns the loss on every rank.

        ``inputs`` are read on the rank of the first stage, ``targets`` on the rank of the last
        (``None`` elsewhere is fine). Adds to the local parameters' ``.grad`` what the plain
        model's backward adds (averaged over data-parallel replicas when there are some).
        ``scaler``: a ``torch.amp.GradScaler``; the micro-batch losses are scaled. With
        ``optimizer`` (over ``pipe.parameters()``) the pipe then steps it: through the scaler,
        after every rank agreed whether any gradient anywhere is inf or NaN (so all ranks skip
        the step together); without ``optimizer``, call ``fastpipe.amp.unscale_and_sync(scaler,
        optimizer)`` on every rank before ``scaler.step(optimizer)``.
        """
        self._check_usable()
        try:
            return self._train_step(inputs, targets, loss_fn, loss_reduction,
                                    amp.check_scaler(scaler), optimizer)
        except BaseException as error:
            self._publish(error)
            raise

    def forward(self, inputs: Any) -> Optional[Any]:
        """Forward-only evaluation (no graph, no recompute, nothing kept for backward): the
        output on the last stage's rank, ``None`` on the others."""
        self._check_usable()
        try:
            with torch.no_grad():
                return self._forward(inputs)
        except BaseException as error:
            self._publish(error)
            raise

    def _publish(self, error: BaseException) -> None:
        """After any failure: tell the other ranks (unless they told this one), and refuse
        further steps (the peers' message streams are no longer in step with this rank's)."""
        if self._broken is None:
            self._broken = f"{type(error).__name__}: {error}"
        if isinstance(error, PeerLost):  # a rank that exited or never started tells no one
            self._executor.fail(error.culprit)
            return
        if isinstance(error, PipelineAborted):
            return  # another rank failed first and told everyone
        self._executor.fail(f"rank {self._topology.rank} (stage {self._topology.stage}) "
                            f"failed: {type(error).__name__}: {error}")

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise PipelineError(f"a previous step of this DistributedPipe failed ({self._broken}"
                                f"); the ranks' message streams are out of step: destroy the "
                                f"process group and build new pipes")

    def _train_step(self, inputs: Any, targets: Any, loss_fn: Callable[[Any, Any], torch.Tensor],
                    loss_reduction: str, scaler: Optional[Any],
                    optimizer: Optional[torch.optim.Optimizer]) -> torch.Tensor:
        check_step_arguments(loss_fn, loss_reduction, optimizer, self._pipedream is not None,
                             scaler)
        handlers = self._pipedream.handlers(optimizer) if self._pipedream is not None else None
        last = len(self._stages) - 1
        has_targets = self._topology.local(last)
        start = time.perf_counter()
        sizes = self._local_sizes(inputs, targets if has_targets else None, has_targets)
        step = self._new_step(inputs if self._topology.local(0) else None, train=True,
                              targets=targets if has_targets else None, loss_fn=loss_fn,
                              scaler=scaler)
        sizes = self._agree_sizes(step, sizes)
        schedule = self.plan(len(sizes))
        total = sum(sizes)
        step.loss_weights = ([s / total for s in sizes] if loss_reduction == "mean"
                             else [1.0] * len(sizes))
        step.checkpoint_stop = checkpoint_stop(self._checkpoint, len(sizes))
        step.split = schedule.split_backwards
        step.handlers = handlers
        if handlers is None:  # (loss_sum, count) losses: counts travel in gradient headers
            step.token_mean = self._executor.info.token_mean = TokenMean(self.parameters)
        self._last_actions = last_gradient_actions(schedule.actions[self._topology.stage],
                                                   schedule)
        self._run(schedule.actions, step, schedule)
        self._executor.confirm_step(self._timeout)  # no rank keeps a step another did not finish
        loss, count = self._step_loss(step, len(sizes))
        if self.chunk_search is not None and self.chunk_search.chosen is None:
            self.chunk_search.record(len(sizes), total, time.perf_counter() - start)
        if self._sync is not None:
            self._sync.finish()
        if count is not None:  # the data-parallel average divided by the replicas already
            step.token_mean.finish(count, scale=self._replicas())
        elif loss_reduction == "mean" and len(set(sizes)) > 1 and has_targets:
            warn_uneven_mean(sizes)
        self._tied.sum_gradients()
        if optimizer is not None and self._pipedream is None:
            if scaler is not None:
                amp.unscale_and_sync(scaler, optimizer, timeout=self._timeout)
            step_optimizer(optimizer, scaler)
        vitals.finish_step(self, step, total, start)
        return loss

    def _run(self, programs: Any, step: StepState, schedule: Schedule) -> None:
        local = [self._stages[k] for k in self._local]
        batchnorm.discard(local)
        choosing = self._auto and step.train
        if self._trace is not None or choosing:
            step.recorder = StepRecorder(dist.get_world_size(self._group))
        self._executor.run(programs, step, schedule)
        batchnorm.commit(local)
        if step.recorder is not None:
            timeline = self._gather_timeline(step.recorder)
            if self._trace is not None:
                self._trace.timelines.append(timeline)
            if choosing:  # every rank ranks the same gathered timeline: the same choice
                self.auto_ranking = auto.rank(timeline, schedule)
                self._schedule_name, self._auto = self.auto_ranking[0].name, False
                if self._topology.rank == min(self._topology.owner):
                    auto.log_choice(self.auto_ranking)

    @contextlib.contextmanager
    def trace(self) -> Iterator[Trace]:
        """Record when every action of every rank started and ended, for the steps run inside
        the block (every rank must enter it): ``t.timeline`` is the whole pipeline's measured
        timeline, on every rank (see ``Pipe.trace``). Ranks on one machine share a clock; across
        machines the lanes are aligned only as well as the machines' clocks are."""
        trace = Trace()
        self._trace = trace
        try:
            yield trace
        finally:
            self._trace = None

    def _gather_timeline(self, recorder: StepRecorder) -> Any:
        """Every rank's (start, end) of its actions, on one clock (a collective over the
        pipeline group, bounded by the process group's timeout)."""
        mine = (recorder.origin, list(recorder.intervals))  # CPU stages: no events pending
        parts: List[Any] = [None] * dist.get_world_size(self._group)
        dist.all_gather_object(parts, mine, group=self._group)
        origin = min(o for o, _ in parts)
        intervals = [(stage, action, start + o - origin, end + o - origin)
                     for o, rows in parts for stage, action, start, end in rows]
        return Timeline.from_intervals(recorder.num_stages, intervals, source="measured",
                                       unit="s")

    def _forward(self, inputs: Any) -> Optional[Any]:
        sizes = self._local_sizes(inputs, None, False)
        step = self._new_step(inputs if self._topology.local(0) else None, train=False)
        step.grad_enabled = False
        sizes = self._agree_sizes(step, sizes)
        schedule = self.plan(len(sizes))
        self._last_actions = {}
        self._run(schedule.forward_actions, step, schedule)
        if not self._topology.local(len(self._stages) - 1):
            return None
        return microbatch.gather([step.outputs[i] for i in range(len(sizes))])

    def _local_sizes(self, inputs: Any, targets: Any, need_targets: bool) -> Optional[List[int]]:
        """Micro-batch sizes from the batch this rank reads, checked before any work."""
        sizes = None
        if self._topology.local(0):
            if inputs is None:
                raise ValueError(f"inputs is None on rank {self._topology.rank}, which holds the "
                                 f"first stage: pass the batch on this rank")
            total = microbatch.batch_size(inputs, argument="inputs")
            sizes = self._split(total, self._step_chunks(total))
        if targets is not None:
            total = microbatch.batch_size(targets, argument="targets")
            if sizes is not None and sum(sizes) != total:
                raise ValueError(f"targets has batch size {total} but inputs has {sum(sizes)}; "
                                 f"give one target per input sample")
            sizes = self._split(total, self._step_chunks(total), argument="targets")
        elif need_targets:
            raise ValueError(f"targets is None on rank {self._topology.rank}, which holds the "
                             f"last stage: pass the targets on this rank")
        return sizes

    def _step_chunks(self, total: int) -> int:
        """The micro-batch count this rank splits a batch of ``total`` into: ``chunks``, or
        with ``chunks='auto'`` on the first stage's rank, the search's next count (the other
        ranks take the count from the step's first message)."""
        if not self._auto_chunks or not self._topology.local(0):
            return min(self._chunks, total) if self._auto_chunks else self._chunks
        if self.chunk_search is None:
            self.chunk_search = self._new_chunk_search(total)
        self._chunks = min(self.chunk_search.next(), total)
        return self._chunks

    def _new_step(self, inputs: Any, *, train: bool, **kwargs: Any) -> StepState:
        for k in self._local:
            self._stages[k].rng.reset()
        self._steps += 1
        self._board.liveness.at(self._steps, "starting the step")
        step = StepState(stages=self._stages, inputs=[], train=train, seed=draw_step_seed(),
                         checkpoint_stop=0, timeout=self._timeout,
                         checkpoint_mode=self._checkpoint, **kwargs)
        step.batch = inputs  # scattered once the micro-batch sizes are agreed
        return step

    def _agree_sizes(self, step: StepState, sizes: Optional[List[int]]) -> List[int]:
        """Wire the step and start its receivers. A rank that does not read the batch learns
        the micro-batch count and batch size from the first activation it receives (the header
        of every message repeats them); a rank that reads the targets checks them against it."""
        self._executor.wire(step, self.plan(self._chunks))
        entry = min(self._local)
        learned_from: Optional[int] = None
        if entry > 0:
            learned_from = self._topology.owner[entry - 1]
            header = self._executor.learn_microbatches(learned_from, step)
            learned = microbatch.split_sizes(header.batch_size, header.num_microbatches)
            if not self._auto_chunks and learned != self._split(header.batch_size,
                                                                 self._chunks):
                mine = len(self._split(header.batch_size, self._chunks))
                raise RuntimeError(f"rank {learned_from} split a batch of {header.batch_size} "
                                   f"into {header.num_microbatches} micro-batches but this rank "
                                   f"into {mine}: build the pipes with the same chunks on every "
                                   f"rank")
            if sizes is not None and sum(sizes) != header.batch_size:
                raise ValueError(f"targets on rank {self._topology.rank} have batch size "
                                 f"{sum(sizes)} but the inputs on rank {self._topology.owner[0]} "
                                 f"have {header.batch_size}; give one target per input sample")
            sizes = learned
            if self._auto_chunks:
                self._chunks = header.num_microbatches
        assert sizes is not None
        m = len(sizes)
        self._executor.info.step, self._executor.info.num_microbatches = self._steps, m
        self._executor.info.batch_size = sum(sizes)
        self._executor.info.losses = step.losses  # filled by the last stage or by the headers
        schedule = self.plan(m)
        rows = schedule.actions if step.train else schedule.forward_actions
        self._executor.expect(schedule, rows, learned_from)
        if step.batch is not None:
            step.inputs = microbatch.scatter(step.batch, sizes)
        if step.targets is not None:
            step.targets = microbatch.scatter(step.targets, sizes)
        return sizes

    def _step_loss(self, step: StepState, m: int) -> Tuple[torch.Tensor, Optional[float]]:
        """The step's loss on every rank: the last stage's rank computed the micro-batch losses,
        the others received them in the headers of their gradients (averaged over replicas).
        With ``(loss_sum, count)`` losses, the sums over the total count (over the replicas
        too), which is also returned; else ``None``."""
        missing = [i for i in range(m) if i not in step.losses]
        if missing:
            raise PipelineError(f"rank {self._topology.rank}: the losses of micro-batches "
                                f"{missing} never arrived with their gradients")
        total = math.fsum(float(step.losses[i]) for i in range(m))  # the same sum everywhere
        token_mean = step.token_mean
        counted = token_mean is not None and token_mean.active
        values = [total, token_mean.total()] if counted else [total]
        sums = torch.tensor(values, dtype=torch.float64, device=self._device)
        if self._replicas() > 1:
            work = dist.all_reduce(sums, group=self._data_group, async_op=True)
            wait_work(work, self._timeout, "the data-parallel loss average", self._board)
        dtype = step.losses[0].dtype
        if counted:
            count = float(sums[1])
            return (sums[0] / count if count > 0 else sums[0] * 0).to(dtype), count
        return (sums[0] / self._replicas()).to(dtype), None

    def _replicas(self) -> int:
        """Data-parallel replicas of this rank's stage (1 without data parallelism)."""
        if self._data_group is None:
            return 1
        return dist.get_world_size(self._data_group)

    def _after_action(self, step: StepState, stage: Any, action: Any) -> None:
        if self._sync is not None and action in self._last_actions:
            self._sync.launch(stage.parameters(), f"stage {stage.index}")

    # ---------------------------------------------------------------- plain-module names
    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load this rank's entries of a plain-model (or any rank's) state dict; entries of
        layers other ranks hold are ignored, missing local ones are an error when ``strict``."""
        local = self.module.state_dict().keys()
        mine = {k: v for k, v in state_dict.items() if k in local}
        missing = [k for k in local if k not in mine]
        if strict and missing:
            raise RuntimeError(f"the state dict lacks {len(missing)} entries of the layers on rank "
                               f"{self._topology.rank}, e.g. {missing[:3]}; save it from the "
                               f"plain model or gather every rank's state_dict()")
        return self.module.load_state_dict(mine, strict=False, assign=assign)

    def __repr__(self) -> str:
        return (f"DistributedPipe(rank={self._topology.rank}, stages={list(self._local)}, "
                f"balance={list(self._balance)}, chunks={self._chunks}, "
                f"schedule={self._schedule_name!r}, checkpoint={self._checkpoint!r})")


# -------------------------------------------------------------------- construction helpers
def _check_layers(module: Any) -> List[Any]:
    if isinstance(module, nn.Sequential):
        if len(module) == 0:
            raise ValueError("module is an empty nn.Sequential; give it at least one layer")
        return list(module)
    if isinstance(module, (list, tuple)) and module and all(callable(f) for f in module):
        return list(module)
    raise TypeError(f"module must be an nn.Sequential or a list of functions that each build "
                    f"one layer, got {type(module).__name__}")


def _check_asynchronous(pipedream: Optional[Any], data_group: Optional[Any],
                        tied: TiedSync) -> None:
    """PipeDream updates each stage inside the step: no cross-rank gradient sums then."""
    if pipedream is None:
        return
    if data_group is not None and dist.get_world_size(data_group) > 1:
        raise NotImplementedError("schedule='pipedream' with data_parallel_group is not "
                                  "supported (its updates happen per micro-batch, inside the "
                                  "step); use a flushed schedule such as '1f1b'")
    if tied.shared:
        raise NotImplementedError("schedule='pipedream' with weights tied across ranks is not "
                                  "supported; untie them or use a flushed schedule such as "
                                  "'1f1b'")


def _check_tied(module: Any, tied: Sequence[Sequence[Any]]) -> List[List[str]]:
    if not isinstance(module, nn.Sequential):
        if tied:
            raise ValueError("tied=... needs the model as an nn.Sequential (it names the "
                             "plain model's parameters); layer factories cannot share weights")
        return []
    return tied_weights.check(module, tied)


def _skip_plans(module: Any, balance: Sequence[int]) -> Dict[int, Any]:
    """Where the skip connections (``fastpipe.skip``) go, by virtual stage (checked)."""
    if isinstance(module, nn.Sequential):
        return skip_layout.plan(module, balance)
    return {}


def _no_skips_in_factories(module: Any, kept: Dict[str, nn.Module]) -> None:
    if isinstance(module, nn.Sequential):
        return
    if any(declaration(m) is not None for layer in kept.values() for m in layer.modules()):
        raise NotImplementedError("skip connections (fastpipe.skip) need the model as an "
                                  "nn.Sequential (on the meta device if it is large), so that "
                                  "every rank knows where each skip goes")


def _balance(module: Any, layers: List[Any], balance: Optional[Sequence[int]],
             parts: int) -> List[int]:
    if balance is None:
        if len(layers) < parts:
            raise ValueError(f"the model has {len(layers)} layers but the pipeline needs at "
                             f"least {parts} (ranks x virtual_stages); use fewer ranks")
        if isinstance(module, nn.Sequential):
            return auto_balance(module, parts)
        return [len(range(i, len(layers), parts)) for i in range(parts)]
    values = check_balance(balance, layers)
    if len(values) != parts:
        raise ValueError(f"balance has {len(values)} entries but the pipeline has {parts} "
                         f"virtual stages (ranks x virtual_stages); give one count per stage")
    return values


def _materialise(layer: Any, device: torch.device, init_weights: Any) -> nn.Module:
    """A kept layer on ``device``: built (factories), allocated (meta) or moved."""
    if not isinstance(layer, nn.Module):
        layer = layer()
        if not isinstance(layer, nn.Module):
            raise TypeError(f"a layer factory returned {type(layer).__name__}, not an nn.Module")
    if materialise.is_meta(layer):
        materialise.materialise_layer(layer, device, init_weights)
        return layer
    return layer.to(device)


def _resolve_device(device: Optional[Union[str, torch.device]], group: Any) -> torch.device:
    """The rank's device; gloo process groups and CPU tensors only, for now."""
    backend = dist.get_backend(group)
    if backend != "gloo":
        raise NotImplementedError(
            f"DistributedPipe sends its messages over gloo only, for now; this process group "
            f"uses {backend!r}. NCCL runs a pair of ranks' sends and receives on one stream, and "
            f"this pipe's order (send when an action ends, receive when an action needs it) can "
            f"deadlock there. Build the pipeline's group with backend='gloo'")
    resolved = torch.device("cpu" if device is None else device)
    if resolved.type != "cpu":
        raise NotImplementedError(f"device={device!r}: DistributedPipe runs its stages on the "
                                  f"CPU for now (gloo sends CPU tensors); use device='cpu'")
    return resolved


def _grad_sync(group: Optional[Any], board: Board, timeout: float) -> Optional[GradSync]:
    if group is None or dist.get_world_size(group) == 1:
        return None
    return GradSync(group, board, timeout)


def init_mesh(pipeline: int, data: int = 1, device_type: str = "cpu") -> Tuple[Any, Any]:
    """Split the world into ``data`` pipelines of ``pipeline`` ranks: returns this rank's
    (pipeline group, data-parallel group). Rank ``r`` is stage ``r % pipeline`` of pipeline
    ``r // pipeline``; the data group joins the same stage of every pipeline."""
    world = dist.get_world_size()
    if pipeline < 1 or data < 1 or pipeline * data != world:
        raise ValueError(f"pipeline={pipeline} x data={data} must equal the world size {world}")
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh(device_type, (data, pipeline), mesh_dim_names=("data", "pipeline"))
    return mesh.get_group("pipeline"), mesh.get_group("data")
