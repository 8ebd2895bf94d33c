"""The driver of ``DistributedPipe``: this rank's stages, the others' over ``torch.distributed``.

Per step it agrees the micro-batch sizes with the other ranks (a rank that does not read the
batch learns them from its first message), runs this rank's program through the distributed
executor, averages gradients over data-parallel replicas, sums the gradients of weights tied
across ranks, and turns any failure into one that every rank of the pipeline sees.
"""
from __future__ import annotations

import contextlib
import itertools
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ... import microbatch
from ...policies import amp, batchnorm
from ...errors import NonFiniteError, PeerLost, PipelineAborted, PipelineError
from ...schedule import Action, Schedule
from ...schedule.timeline import Timeline
from ..transport import backends
from ..failure.board import Board
from ..failure.waits import wait_work
from ..dist_executor import distributed_executor
from ..rank_executor import Topology, last_gradient_actions
from ..gradients import closing, grad_norm
from .base import Driver, scaler_found_inf
from ..gradients.data_parallel import GradSync
from ..lowering import skip_links
from ..stage import order_streams
from ..step import StepState
from ..gradients.tied import TiedSync
from ..observe.trace import StepRecorder
from ..transport.gather_data import gather_json
from ..transport.wire import HostReads

NAME_BYTES = 256  # a parameter name, as sent to every rank in a non-finite step's error
_instances = itertools.count()  # ranks build their pipes in the same order: same ids everywhere


class RemoteStage:
    """Stands for a virtual stage another rank holds (the handlers only read its index and
    the device its messages are staged on)."""

    def __init__(self, index: int, device: torch.device) -> None:
        self.index = index
        self.device = device


class PerRankDriver(Driver):
    """Runs this rank's share of every step and keeps the ranks in agreement."""

    distributed = True

    def __init__(self, topology: Topology, stages: Sequence[Any], skips: Dict[int, Any],
                 data_group: Optional[Any], shared: Sequence[Any], timeout: float,
                 p2p: str = "tagged", sharded: Optional[Any] = None,
                 closing_group: Optional[Any] = None,
                 coordinates: Optional[Dict[str, int]] = None) -> None:
        self.topology = topology
        self.rank = topology.rank
        self.stages = list(stages)
        self.local = [k for k, owner in enumerate(topology.owner) if owner == topology.rank]
        self.skips = {k: where for k, where in skips.items() if k in self.local}
        self.timeout = timeout
        self.searches_chunks = topology.local(0)
        self.shows_next_count = False
        self.reports = topology.rank == min(topology.owner)
        self.board = Board(f"pipe{next(_instances)}", topology.rank,
                           ranks=dist.get_process_group_ranks(topology.group))
        self.executor = distributed_executor(topology, self.board, self._after_action,
                                             skip_links(skips.values()), grouped=p2p == "grouped")
        self.p2p = p2p
        self._facts = backends.agreement(topology.device, p2p)
        self.board.share(self._facts)
        self.data_group = data_group
        self.replicas = 1 if data_group is None else dist.get_world_size(data_group)
        # FSDP's per-step hooks (fastpipe.parallel.fsdp.ShardedStages): FSDP reduces gradients
        self.sharded = sharded
        self.grad_sync = (GradSync(data_group, self.board, timeout)
                          if self.replicas > 1 and sharded is None else None)
        self.tied = TiedSync(shared, topology.owner, topology.group, topology.device, self.board,
                             timeout, side=self.executor.side)
        self.steps = 0
        self.broken: Optional[str] = None
        self.last_actions: Dict[Any, int] = {}
        # the close of a training step: every rank's report gathered over the pipeline group,
        # or over the whole mesh when gradients are sharded (tensor parallel, FSDP), the
        # replicated copies then counted on the mesh's first replica only (``coordinates``)
        self.closing_group = closing_group if closing_group is not None else topology.group
        self.closing_side = backends.side_channel(self.closing_group)  # its reports: host numbers
        self.coordinates = coordinates
        self.syncing = True  # False inside no_sync(): the step's gradients stay local
        self.unsynced = False  # calls under no_sync() accumulated gradients not yet synced
        self._deferred: List[Any] = []  # stages whose data-parallel average waits (see below)
        # PipeDream's weight versions (runtime.weight_versions): each stage updates after every
        # micro-batch, its replicas' averages and tied weights' sums made then, not at the end
        self.pipedream: Optional[Any] = None

    @property
    def norm_device(self) -> torch.device:
        return self.topology.device

    # ---------------------------------------------------------------- failures
    @contextlib.contextmanager
    def guarded(self) -> Iterator[None]:
        """Refuse a step after a failed one; after any failure, tell the other ranks (unless
        they told this one) and refuse further steps (the peers' message streams are no longer
        in step with this rank's)."""
        if self.broken is not None:
            raise PipelineError(f"a previous step of this DistributedPipe failed ({self.broken}"
                                f"); the ranks' message streams are out of step: destroy the "
                                f"process group and build new pipes")
        try:
            yield
        except NonFiniteError as error:
            if not error.agreed:  # raised inside the step (PipeDream): a failure like others
                self._failed(error)
            raise  # else every rank raised it at the step's close: the pipe goes on
        except BaseException as error:
            self._failed(error)
            raise

    def _failed(self, error: BaseException) -> None:
        """Refuse further steps and tell the other ranks (unless they told this one)."""
        if self.broken is None:
            self.broken = f"{type(error).__name__}: {error}"
        if isinstance(error, PeerLost):  # a rank that exited or never started tells no one
            self.executor.fail(error.culprit)
        elif not isinstance(error, PipelineAborted):  # else another rank told everyone
            self.executor.fail(f"rank {self.topology.rank} (stage {self.topology.stage}) "
                               f"failed: {type(error).__name__}: {error}")

    def forward_grad_mode(self) -> Any:
        return torch.no_grad()

    def check_present(self, inputs: Any, targets: Any, reads_targets: bool) -> None:
        if self.topology.local(0) and inputs is None:
            raise ValueError(f"inputs is None on rank {self.topology.rank}, which holds the "
                             f"first stage: pass the batch on this rank")
        if reads_targets and targets is None:
            raise ValueError(f"targets is None on rank {self.topology.rank}, which holds the "
                             f"last stage: pass the targets on this rank")

    # ---------------------------------------------------------------- one step
    def agree(self, step: StepState, sizes: Optional[List[int]], train: bool,
              fixed: Optional[Callable[[int], List[int]]],
              plan: Callable[..., Schedule]) -> List[int]:
        """Wire the step and start its receivers. A rank that does not read the batch learns
        the micro-batch count and batch size from the first activation it receives (the header
        of every message repeats them); a rank that reads the targets checks them against it."""
        self.steps += 1
        self.board.liveness.at(self.steps, "starting the step")
        if self.steps == 1:
            backends.check_agreement(self._facts, self.board.facts(
                dist.get_process_group_ranks(self.topology.group)), self.topology.rank)
        self.executor.wire(step, plan())
        self.executor.info.tags = step.tags  # PipeDream's versions, the first message's too
        learned_from: Optional[int] = None
        entry = min(self.local)
        if entry > 0:
            learned_from = self.topology.owner[entry - 1]
            sizes = self._learn(step, learned_from, sizes, fixed)
        assert sizes is not None
        info = self.executor.info
        info.step, info.num_microbatches, info.batch_size = self.steps, len(sizes), sum(sizes)
        info.losses = step.losses  # filled by the last stage or by the headers
        info.token_mean = step.token_mean  # counts of (loss_sum, count) losses, from headers
        schedule = plan(len(sizes))
        rows = schedule.actions if train else schedule.forward_actions
        self.executor.expect(schedule, rows, learned_from)
        return sizes

    def _learn(self, step: StepState, src: int, sizes: Optional[List[int]],
               fixed: Optional[Callable[[int], List[int]]]) -> List[int]:
        header = self.executor.learn_microbatches(src, step)
        learned = microbatch.split_sizes(header.batch_size, header.num_microbatches)
        if fixed is not None and learned != fixed(header.batch_size):
            mine = len(fixed(header.batch_size))
            raise RuntimeError(f"rank {src} split a batch of {header.batch_size} into "
                               f"{header.num_microbatches} micro-batches but this rank into "
                               f"{mine}: build the pipes with the same chunks on every rank")
        if sizes is not None and sum(sizes) != header.batch_size:
            raise ValueError(f"targets on rank {self.topology.rank} have batch size "
                             f"{sum(sizes)} but the inputs on rank {self.topology.owner[0]} "
                             f"have {header.batch_size}; give one target per input sample")
        return learned

    def run(self, programs: Sequence[Sequence[Action]], step: StepState,
            schedule: Schedule) -> None:
        local = [self.stages[k] for k in self.local]
        self.last_actions = (last_gradient_actions(schedule.actions[self.topology.stage],
                                                   schedule) if step.train else {})
        batchnorm.discard(local)
        if self.sharded is not None:
            self.sharded.prepare(step, schedule.actions[self.topology.stage], schedule)
        order_streams(local, before=True)  # GPU: after the optimizer's update, and back after
        try:
            self.executor.run(programs, step, schedule)
        finally:
            order_streams(local, before=False)
        if self.sharded is not None:
            self.sharded.after_run(step)
        batchnorm.commit(local)  # (a training step is confirmed by gather_reports)

    def _after_action(self, step: StepState, stage: Any, action: Any) -> None:
        if self.sharded is not None:
            self.sharded.after_action(stage, action)
        if self.grad_sync is not None and action in self.last_actions and self.syncing \
                and self.pipedream is None:
            counted = step.token_mean is not None and step.token_mean.active
            if self.unsynced and counted:  # see finish_gradients
                self._deferred.append(stage)
            else:
                self.grad_sync.launch(stage.parameters(), f"stage {stage.index}")

    def timeline(self, recorder: StepRecorder) -> Timeline:
        """Every rank's (start, end) of its actions, on one clock (a collective over the
        pipeline group, each wait bounded by the pipe's timeout; the intervals travel as JSON
        data, the actions as their strings)."""
        rows = recorder.resolved(  # GPU stages: their CUDA events read
            {self.topology.stage: self.topology.device}, self.timeout)
        mine = [recorder.origin, [[stage, str(action), start, end]
                                  for stage, action, start, end in rows],
                [[stage, *seconds] for stage, seconds in recorder.cpu.items()]]
        parts = gather_json(mine, self.topology.group, self.topology.device,
                            lambda work, what: wait_work(work, self.timeout, what, self.board),
                            "the intervals of a traced step")
        origin = min(o for o, *_ in parts)
        intervals = [(stage, action, start + o - origin, end + o - origin)
                     for o, rows, _ in parts for stage, action, start, end in rows]
        recorder.cpu = {stage: [cpu, wall] for _, _, cpus in parts for stage, cpu, wall in cpus}
        return Timeline.from_intervals(recorder.num_stages, intervals, source="measured",
                                       unit="s")

    def loss(self, step: StepState,
             num_microbatches: int) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The step's loss on every rank: the last stage's rank computed the micro-batch losses,
        the others received them with their gradients (averaged over replicas). With
        ``(loss_sum, count)`` losses, the sums over the total count (over the replicas too),
        which is also returned; else ``None``. Summed on this rank's device, never read."""
        missing = [i for i in range(num_microbatches) if i not in step.losses]
        if missing:
            raise PipelineError(f"rank {self.topology.rank}: the losses of micro-batches "
                                f"{missing} never arrived with their gradients")
        device = self.topology.device
        total = torch.stack([step.losses[i].detach().reshape(()).to(device, torch.float64)
                             for i in range(num_microbatches)]).sum()
        token_mean = step.token_mean
        counted = token_mean is not None and token_mean.active
        sums = torch.stack([total, token_mean.total(device)]) if counted else total.reshape(1)
        if self.replicas > 1:
            work = dist.all_reduce(sums, group=self.data_group, async_op=True)
            wait_work(work, self.timeout, "the data-parallel loss average", self.board)
        dtype = step.losses[0].dtype
        if counted:
            count = sums[1]
            return torch.where(count > 0, sums[0] / count, sums[0] * 0).to(dtype), count
        return (sums[0] / self.replicas).to(dtype), None

    def replica_sums(self, values: List[float]) -> List[float]:
        """``values`` added over the data-parallel replicas (one all-reduce of the data group,
        bounded by the pipe's timeout)."""
        if self.replicas == 1:
            return list(values)
        sums = torch.tensor(values, dtype=torch.float64, device=self.topology.device)
        work = dist.all_reduce(sums, group=self.data_group, async_op=True)
        wait_work(work, self.timeout, "the data-parallel sum of the loss weights", self.board)
        return sums.tolist()

    # ---------------------------------------------------------------- gradients
    def begin_training(self, sync: bool) -> None:
        """Open the step's gradient window: the gradients of weights tied across ranks are set
        aside until the step syncs (so only what this window added is summed), and FSDP defers
        its reduction while ``sync`` is False."""
        self.syncing = sync
        if self.pipedream is None:  # PipeDream syncs (and updates) per micro-batch
            self.tied.begin()
        if self.sharded is not None:
            self.sharded.syncing = sync

    def finish_gradients(self, step: StepState, count: Optional[torch.Tensor]) -> None:
        """The step's gradients made final, in an order that keeps accumulation exact: the
        data-parallel average, the division by the token count of ``(loss_sum, count)`` losses
        (after the average, which was launched as each stage finished; before it, when calls
        under ``no_sync()`` left replica-specific gradients that the count must not divide),
        then the sums of tied weights. Inside ``no_sync()``: only the division. Under
        PipeDream: the updates of tied weights' copies still to come (``PipeDream.finish``)."""
        if count is not None and self.sharded is not None and (self.unsynced or
                                                               not self.syncing):
            raise NotImplementedError(
                "(loss_sum, count) losses inside pipe.no_sync() with data_parallel='fsdp': FSDP "
                "keeps the unsynced gradients where the count cannot reach them; call "
                "train_step without no_sync(), or return a mean loss")
        if self.pipedream is not None:  # each update synced as it came; the last ones now
            self.pipedream.finish(step, self.executor.info.num_microbatches)
            return
        if not self.syncing:
            if count is not None:
                step.token_mean.finish(count, scale=self.replicas)
            self.unsynced = True
            return
        deferred, self._deferred = self._deferred, []
        if deferred:
            step.token_mean.finish(count, scale=self.replicas)
            for stage in deferred:
                self.grad_sync.launch(stage.parameters(), f"stage {stage.index}")
        if self.grad_sync is not None:
            self.grad_sync.finish()
        if count is not None and not deferred:
            step.token_mean.finish(count, scale=self.replicas)
        self.tied.sum_gradients()
        self.unsynced = False

    def check_synced(self, what: str) -> None:
        if self.unsynced:
            raise RuntimeError(f"{what}: the gradients of the calls inside pipe.no_sync() are "
                               f"not synced yet; call it after a train_step outside the block")

    def counted(self, named: Sequence[Tuple[str, Any]]) -> List[grad_norm.Counted]:
        """This rank's parameters in the model's norm: a tied weight on its home rank only;
        over a mesh, replicated copies on the first replica only."""
        return grad_norm.counted(named, self.stage_of(), skip=self.tied.away(),
                                 coordinates=self.coordinates)

    def gather_reports(self, report: closing.Report) -> List[closing.Report]:
        """Every rank's report of the step, in one all-gather over the closing group; it
        returns once every rank has finished its part of the step (a rank that exited or
        failed during it is named), so no rank keeps a step, or steps an optimizer, that
        another did not complete."""
        values = self._all_gather(torch.tensor(report.encode(), dtype=torch.float64),
                                  "every rank of the pipeline to finish the step")
        return [closing.Report.decode(v.tolist()) for v in values]  # host numbers: no read

    def name_of(self, culprit: closing.Report, counted: Sequence[grad_norm.Counted]) -> str:
        """The culprit rank's parameter name, sent to every rank (the error path only)."""
        mine = (counted[culprit.bad_parameter].name.encode()[:NAME_BYTES]
                if culprit.rank == self.rank else b"")
        buffer = torch.zeros(NAME_BYTES, dtype=torch.uint8)
        buffer[:len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8) \
            if mine else buffer[:0]
        names = self._all_gather(buffer, "the name of the non-finite gradient")
        ranks = dist.get_process_group_ranks(self.closing_side)
        raw = names[ranks.index(culprit.rank)]
        return bytes(raw[raw != 0].tolist()).decode(errors="replace")

    def _all_gather(self, value: torch.Tensor, what: str) -> List[torch.Tensor]:
        """``value`` (a CPU tensor) from every rank of the closing group, in group order, over
        the group's side channel (gloo, CPU tensors: the host reads no device buffer, and
        waits for the other ranks' hosts only; bounded)."""
        self.board.liveness.at(self.steps, f"waiting for {what}")
        parts = [torch.empty_like(value) for _ in range(dist.get_world_size(self.closing_group))]
        try:
            work = dist.all_gather(parts, value, group=self.closing_side, async_op=True)
        except RuntimeError as error:
            raise self.board.lost(f"waiting for {what}", error) from None
        wait_work(work, self.timeout, what, self.board)
        self.board.liveness.at(self.steps, "between steps")
        return parts

    def before_update(self, optimizer: torch.optim.Optimizer, scaler: Optional[Any],
                      reads: HostReads) -> bool:
        amp.unscale_and_sync(scaler, optimizer, timeout=self.timeout,
                             device=self.topology.device)  # the flag reduces there
        return scaler_found_inf(scaler, optimizer, reads)
