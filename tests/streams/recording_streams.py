"""A recording stream backend for the tests: runs a seam's operations on CPU tensors and checks
the happens-before relations a GPU would need, on the exact operations the seam issued.

The model (what CUDA and torch's caching allocator guarantee, and nothing more):

- each stream runs its operations in order; streams are otherwise unordered, except through
  ``wait_stream`` and events (tracked with one vector clock per stream);
- an allocation belongs to the stream current on its device when it was made: that stream may
  reuse the memory as soon as the tensor dies, so another stream that touches the tensor must
  (a) be ordered after the allocating stream's work up to the allocation (the memory may have
  been in use until then), and (b) be recorded on the tensor (``record_stream``) before its last
  reference dies;
- data hazards: a read is ordered after the last write, a write after the last write and every
  read since.

- the host learning that an event completed (``done`` answering True) orders everything issued
  afterwards, on any stream, after that event.

Operations the seam does not issue through the backend (a stage's compute) are declared by the
test: :meth:`RecordingStreams.made` (a tensor produced on a stream) and
:meth:`RecordingStreams.compute` (reads and writes on a stream), or, for real modules,
:meth:`RecordingStreams.tracking`, which declares every tensor operation run inside it as
compute on the stream issuing it. :meth:`RecordingStreams.check` raises ``AssertionError``
listing every violation.

Graphs: :meth:`RecordingStreams.capturing` runs its block once and records its tensor
operations into a :class:`FakeGraph`; :meth:`RecordingStreams.replay` runs them again on the
same tensors (as a CUDA graph replays its kernels on the same memory) and declares the replay's
reads and writes on the current stream. Memory allocated inside a capture belongs to the graph
pool (outside every stream's: only later captures into the pool reuse it) and is poisoned with
NaN when the capture ends, since a real capture leaves it unwritten until the first replay. A
capture is checked for what CUDA requires (its stream's device current, a side stream, a pool
of that device, the autocast cache off while autocast is on, no host reads, no nesting);
:attr:`RecordingStreams.captures` keeps what each capture saw (device, mode, pool, autocast).

``RecordingStreams("cuda:0")`` pretends there is a GPU and treats CPU allocations as host memory;
``RecordingStreams("cpu")`` makes the CPU itself the pretend GPU, so that real modules run on it
and their allocations belong to the streams' pools (host buffers then come from outside the
backend, or from ``empty(..., pin_memory=True)``).
"""
from __future__ import annotations

import contextlib
import itertools
import threading
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

Clock = Dict["FakeStream", int]

_ids = itertools.count()


class FakeStream:
    """A stream of a (pretend) device."""

    def __init__(self, device: torch.device, name: str) -> None:
        self.device, self.name, self.id = torch.device(device), name, next(_ids)

    def __repr__(self) -> str:
        return f"<stream {self.name}>"


@dataclass(frozen=True)
class FakeEvent:
    """An event: the clock of its stream when it was recorded."""

    stream: FakeStream
    clock: Tuple[Tuple[FakeStream, int], ...]

    def as_clock(self) -> Clock:
        return dict(self.clock)


@dataclass
class Stamp:
    """One operation: the stream it ran on and that stream's clock right after it."""

    stream: FakeStream
    clock: Clock
    what: str

    def before(self, other: "Stamp") -> bool:
        """Whether this operation happens before ``other``."""
        return self.clock.get(self.stream, 0) <= other.clock.get(self.stream, 0)


@dataclass
class Memory:
    """What the backend knows of one storage."""

    ref: StorageWeakRef
    label: str
    alloc: Optional[Stamp]  # None: made outside the model (a parameter, a host buffer)
    last_write: Optional[Stamp] = None
    reads: List[Stamp] = field(default_factory=list)
    used_on: Set[FakeStream] = field(default_factory=set)  # streams other than the allocating
    recorded: Set[FakeStream] = field(default_factory=set)


class RecordingStreams:
    """A :class:`fastpipe.streams.StreamBackend` on CPU tensors that records and checks."""

    def __init__(self, device: Any = "cuda:0") -> None:
        self.main = torch.device(device)  # the pretend device copies run on by default
        self.log: List[Tuple[Any, ...]] = []
        self.violations: List[str] = []
        self._clocks: Dict[FakeStream, Clock] = {}
        self._defaults: Dict[torch.device, FakeStream] = {}
        self._local = threading.local()
        self._memory: Dict[int, Memory] = {}
        self._lock = threading.RLock()
        self.completed = True  # what ``done`` answers
        self.devices_entered: List[torch.device] = []
        self._retired: List[Memory] = []  # storages replaced at the same address
        self._seen_done: Clock = {}  # work the host has seen complete (through ``done``)
        self.pools: List["FakePool"] = []  # graph pools made
        self.captures: List["Capture"] = []  # what each capture saw
        self.replays: List["FakeGraph"] = []  # graphs replayed, in order

    # ---------------------------------------------------------------- streams
    def default(self, device: Any) -> FakeStream:
        """The default stream of ``device``."""
        device = torch.device(device)
        if device not in self._defaults:
            self._defaults[device] = self._stream(device, f"{device}:default")
        return self._defaults[device]

    def _stream(self, device: torch.device, name: str) -> FakeStream:
        stream = FakeStream(device, name)
        self._clocks[stream] = {**self._seen_done, stream: 0}
        return stream

    def _stack(self) -> List[FakeStream]:
        if not hasattr(self._local, "stack"):
            self._local.stack = []
        return self._local.stack

    def current(self, device: Any) -> FakeStream:
        device = torch.device(device)
        for stream in reversed(self._stack()):
            if stream.device == device:
                return stream
        return self.default(device)

    def new_stream(self, device: Any, name: Optional[str] = None) -> FakeStream:
        with self._lock:
            stream = self._stream(torch.device(device),
                                  name or f"{device}:side{len(self._clocks)}")
            self.log.append(("new_stream", stream))
            return stream

    @contextlib.contextmanager
    def using(self, stream: FakeStream) -> Iterator[FakeStream]:
        stack = self._stack()
        stack.append(stream)
        self.log.append(("using", stream))
        try:
            yield stream
        finally:
            stack.pop()
            self.log.append(("left", stream))

    def issuing(self) -> FakeStream:
        """The stream a copy is issued on now: the innermost one entered on this thread, else
        the main device's current stream."""
        stack = self._stack()
        return stack[-1] if stack else self.current(self.main)

    @property
    def device(self) -> Optional[torch.device]:
        """The current device of this thread (``None``: never set)."""
        return getattr(self._local, "device", None)

    @contextlib.contextmanager
    def on_device(self, device: Any) -> Iterator[None]:
        before = self.device
        self._local.device = torch.device(device)
        self.devices_entered.append(torch.device(device))
        self.log.append(("on_device", torch.device(device)))
        try:
            yield
        finally:
            self._local.device = before

    # ---------------------------------------------------------------- ordering
    def wait_stream(self, waiter: FakeStream, producer: FakeStream) -> None:
        with self._lock:
            self.log.append(("wait_stream", waiter, producer))
            _join(self._clocks[waiter], self._clocks[producer])

    def record_event(self, stream: FakeStream) -> FakeEvent:
        with self._lock:
            event = FakeEvent(stream, tuple(self._clocks[stream].items()))
            self.log.append(("record_event", stream, event))
            return event

    def wait_event(self, waiter: FakeStream, event: Optional[FakeEvent]) -> None:
        with self._lock:
            self.log.append(("wait_event", waiter, event))
            if event is None:
                self.violations.append(f"{waiter} waited on no event (None)")
                return
            _join(self._clocks[waiter], event.as_clock())

    def done(self, event: Any) -> bool:
        """``completed``; when True, the host has seen ``event`` complete: everything issued
        from now on, on any stream, is ordered after it."""
        if self.completed and event is not None:
            with self._lock:
                _join(self._seen_done, event.as_clock())
                for clock in self._clocks.values():
                    _join(clock, self._seen_done)
        return self.completed

    def record_stream(self, tensor: torch.Tensor, stream: FakeStream) -> None:
        with self._lock:
            memory = self._find(tensor)
            self.log.append(("record_stream", memory.label, stream))
            memory.recorded.add(stream)

    # ---------------------------------------------------------------- memory and work
    def empty(self, shape: Sequence[int], dtype: torch.dtype, device: Any,
              pin_memory: bool = False) -> torch.Tensor:
        with self.quiet():
            tensor = torch.empty(tuple(shape), dtype=dtype)
        device = torch.device(device)
        if pin_memory or (device.type == "cpu" and self.main.type != "cpu"):
            self.adopt(tensor, "host buffer")  # host memory: outside the streams' pools
            return tensor
        with self._lock:
            stream = self.current(device)
            label = f"empty{tuple(shape)}@{stream.name}#{len(self.log)}"
            self._register(tensor, label, Stamp(stream, dict(self._clocks[stream]), "alloc"))
            self.log.append(("empty", label, stream))
        return tensor

    def copy(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = True) -> None:
        self.compute(self.issuing(), reads=[src], writes=[dst], what="copy")
        with self.quiet():
            dst.copy_(src)

    def made(self, tensor: torch.Tensor, stream: Optional[FakeStream] = None,
             label: Optional[str] = None) -> torch.Tensor:
        """Declare ``tensor`` allocated and written on ``stream`` (default: the stream issuing
        now); returns it."""
        stream = stream or self.issuing()
        with self._lock:
            label = label or f"made{tuple(tensor.shape)}@{stream.name}#{len(self.log)}"
            self._register(tensor, label, Stamp(stream, dict(self._clocks[stream]), "alloc"))
        self.compute(stream, writes=[tensor], what=f"produce {label}")
        return tensor

    def adopt(self, tensor: torch.Tensor, label: str = "outside") -> torch.Tensor:
        """Declare ``tensor`` made outside any stream's pool (a parameter, a host buffer)."""
        with self._lock:
            self._register(tensor, label, None)
        return tensor

    def compute(self, stream: FakeStream, reads: Sequence[torch.Tensor] = (),
                writes: Sequence[torch.Tensor] = (), what: str = "compute") -> Stamp:
        """An operation on ``stream`` reading ``reads`` and writing ``writes``, checked."""
        with self._lock:
            clock = self._clocks[stream]
            clock[stream] = clock.get(stream, 0) + 1
            stamp = Stamp(stream, dict(clock), what)
            self.log.append(("op", what, stream))
            for tensor in reads:
                self._access(self._find(tensor), stamp, write=False)
            for tensor in writes:
                self._access(self._find(tensor), stamp, write=True)
            return stamp

    def _access(self, memory: Memory, stamp: Stamp, write: bool) -> None:
        where = f"{stamp.what} on {stamp.stream}"
        alloc = memory.alloc
        if alloc is not None and alloc.stream is not stamp.stream:
            memory.used_on.add(stamp.stream)
            if not alloc.before(stamp):
                self.violations.append(
                    f"{where} touches {memory.label}, allocated from {alloc.stream}'s pool, "
                    f"without waiting for that stream's work up to the allocation (the memory "
                    f"may still be in use there)")
        if memory.last_write is not None and not memory.last_write.before(stamp):
            self.violations.append(f"{where} {'writes' if write else 'reads'} {memory.label} "
                                   f"before its write by {memory.last_write.what} on "
                                   f"{memory.last_write.stream} is ordered before it")
        if write:
            for read in memory.reads:
                if not read.before(stamp):
                    self.violations.append(f"{where} overwrites {memory.label} before its read "
                                           f"by {read.what} on {read.stream} is ordered before it")
            memory.last_write, memory.reads = stamp, []
        else:
            memory.reads.append(stamp)

    # ---------------------------------------------------------------- real modules
    def tracking(self) -> TorchDispatchMode:
        """A context in which every tensor operation (of a real module's forward or backward,
        say) is declared as compute on the stream issuing it: fresh outputs as allocated and
        written there, inputs as read, arguments the operation mutates as written. Views
        touch no data and are not declared; nor is the backend's own work."""
        return _Tracking(self)

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """Tensor operations inside are not declared by :meth:`tracking` (host-side
        bookkeeping, say, such as a pool handing out a host buffer)."""
        self._local.quiet = getattr(self._local, "quiet", 0) + 1
        try:
            yield
        finally:
            self._local.quiet -= 1

    def _is_quiet(self) -> bool:
        return getattr(self._local, "quiet", 0) > 0

    def _declare(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        """One operation seen by :meth:`tracking`."""
        schema = func._schema
        written = [a.name for a in schema.arguments
                   if a.alias_info is not None and a.alias_info.is_write]
        if not written and any(r.alias_info is not None for r in schema.returns):
            return  # a view
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        storages = {t.untyped_storage()._cdata for t in inputs}
        writes = [kwargs.get(name, args[i] if i < len(args) else None)
                  for i, name in enumerate(a.name for a in schema.arguments) if name in written]
        writes = [t for t in tree_leaves(writes) if isinstance(t, torch.Tensor)]
        stream = self.issuing()
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in storages:
                with self._lock:
                    label = f"{func.__name__}{tuple(t.shape)}@{stream.name}#{len(self.log)}"
                    self._register(t, label, Stamp(stream, dict(self._clocks[stream]), "alloc"))
                writes.append(t)
        self.compute(stream, reads=inputs, writes=writes, what=func.__name__)

    # ---------------------------------------------------------------- graphs
    def graph_pool(self, device: Any) -> "FakePool":
        with self._lock:
            pool = FakePool(torch.device(device), len(self.pools))
            self.pools.append(pool)
            self.log.append(("graph_pool", pool))
            return pool

    def new_graph(self) -> "FakeGraph":
        return FakeGraph()

    @contextlib.contextmanager
    def capturing(self, graph: "FakeGraph", stream: FakeStream, pool: "FakePool",
                  mode: str) -> Iterator[None]:
        """Run the block once, recording its tensor operations into ``graph`` (see the module
        docstring); the capture stream is declared to read what the graph reads."""
        seen = Capture(graph, stream, pool, mode, self.device, _autocast_now(stream.device.type),
                       torch.is_autocast_cache_enabled(), threading.current_thread().name)
        self._check_capture(seen)
        with self._lock:
            self.captures.append(seen)
            self.log.append(("capture", graph, stream, pool, mode))
        graph.device, graph.pool, graph.stream = stream.device, pool, stream
        self._local.capturing = getattr(self._local, "capturing", 0) + 1
        try:
            with self.using(stream), self.quiet(), _Recorder(self, graph):
                yield
        finally:
            self._local.capturing -= 1
        graph.seal()
        self.compute(stream, reads=graph.reads, what=f"capture of {graph}")

    def _check_capture(self, seen: "Capture") -> None:
        stream, problems = seen.stream, []
        if seen.device != stream.device:
            problems.append(f"captured on {stream} with {seen.device} current: a capture records "
                            f"only the work issued for its stream's device")
        if seen.pool.device != stream.device:
            problems.append(f"a capture on {stream} allocates from {seen.pool}, a pool of "
                            f"another device")
        if self._defaults.get(stream.device) is stream:
            problems.append(f"captured on the default stream {stream}: graphs need a side stream")
        if seen.graph.device is not None:
            problems.append(f"{seen.graph} captured twice")
        if seen.cache and any(enabled for _, enabled, _ in seen.autocast):
            problems.append(f"captured under autocast with its cast cache on: casts cached "
                            f"outside the capture would be replayed stale, those made inside "
                            f"freed with the cache ({seen.autocast})")
        if getattr(self._local, "capturing", 0):
            problems.append(f"{seen.graph} captured inside another capture")
        with self._lock:
            self.violations += problems

    def replay(self, graph: "FakeGraph") -> None:
        if graph.device is None:
            with self._lock:
                self.violations.append(f"{graph} replayed but never captured")
            return
        stream = self.current(graph.device)
        with self.quiet(), torch.no_grad():
            for op in graph.ops:
                op.run()
        with self._lock:
            self.replays.append(graph)
        self.compute(stream, reads=graph.reads, writes=graph.writes, what=f"replay of {graph}")

    # ---------------------------------------------------------------- bookkeeping
    def _register(self, tensor: torch.Tensor, label: str, alloc: Optional[Stamp]) -> Memory:
        storage = tensor.untyped_storage()
        memory = Memory(StorageWeakRef(storage), label, alloc)
        replaced = self._memory.get(storage._cdata)
        if replaced is not None:  # its uses are still checked (a dead storage's address reused)
            self._retired.append(replaced)
        self._memory[storage._cdata] = memory
        return memory

    def _find(self, tensor: torch.Tensor) -> Memory:
        storage = tensor.untyped_storage()
        memory = self._memory.get(storage._cdata)
        if memory is None or memory.ref.expired():  # unknown: made outside the model
            memory = self._register(tensor, f"untracked{tuple(tensor.shape)}", None)
        return memory

    def alive(self, tensor: torch.Tensor) -> bool:
        """Whether the backend tracks ``tensor``'s storage."""
        return tensor.untyped_storage()._cdata in self._memory

    def unrecorded(self) -> List[str]:
        """Tensors used on a stream other than their allocating one without being recorded
        there (checked for all: a record after the last reference died cannot happen)."""
        found = []
        for memory in [*self._retired, *self._memory.values()]:
            for stream in sorted(memory.used_on - memory.recorded, key=lambda s: s.id):
                found.append(f"{memory.label} was used on {stream} but never recorded there "
                             f"(record_stream): its memory could be reused while {stream} "
                             f"still reads or writes it")
        return found

    def check(self) -> None:
        """Raise ``AssertionError`` naming every violation seen so far."""
        problems = self.violations + self.unrecorded()
        if problems:
            raise AssertionError("stream protocol violated:\n  " + "\n  ".join(problems))


def _join(into: Clock, other: Clock) -> None:
    for stream, tick in other.items():
        if into.get(stream, 0) < tick:
            into[stream] = tick


class _Tracking(TorchDispatchMode):
    """:meth:`RecordingStreams.tracking`'s dispatch mode."""

    def __init__(self, streams: RecordingStreams) -> None:
        super().__init__()
        self.streams = streams

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.streams._is_quiet():
            self.streams._declare(func, args, kwargs, out)
        return out


# ---------------------------------------------------------------------------------------- graphs
_ALLOCATIONS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
                "empty_permuted"}  # allocate without writing: no kernel in a graph
_HOST_READS = {"_local_scalar_dense", "item", "is_nonzero", "equal"}  # synchronise


@dataclass(frozen=True)
class FakePool:
    """A graph memory pool of a (pretend) device."""

    device: torch.device
    id: int

    def __repr__(self) -> str:
        return f"<pool {self.id} of {self.device}>"


@dataclass(frozen=True)
class Capture:
    """What one capture saw when it began."""

    graph: "FakeGraph"
    stream: FakeStream
    pool: FakePool
    mode: str
    device: Optional[torch.device]  # the thread's current device
    autocast: Tuple[Tuple[str, bool, torch.dtype], ...]  # (device type, enabled, dtype)
    cache: bool  # the autocast cast cache was on
    thread: str


def _autocast_now(kind: str) -> Tuple[Tuple[str, bool, torch.dtype], ...]:
    return tuple((k, torch.is_autocast_enabled(k), torch.get_autocast_dtype(k))
                 for k in sorted({"cpu", kind}))


class _Op:
    """One recorded tensor operation: its replay writes the same output tensors again."""

    def __init__(self, func: Any, args: Any, kwargs: Any, out: Any, mutates: bool) -> None:
        self.func, self.args, self.kwargs, self.out, self.mutates = func, args, kwargs, out, mutates

    def run(self) -> None:
        result = self.func(*tree_map(_data, self.args), **tree_map(_data, self.kwargs))
        if self.mutates:
            return
        for kept, fresh in zip(tree_leaves(self.out), tree_leaves(result)):
            if isinstance(kept, torch.Tensor):
                kept.data.copy_(fresh)


def _data(value: Any) -> Any:
    """The tensor without autograd's version counter (a replay bumps none, as on a GPU)."""
    return value.data if isinstance(value, torch.Tensor) else value


class FakeGraph:
    """A graph of :class:`RecordingStreams`: the operations its capture ran, with the memory
    they read from outside the graph and the memory they write."""

    def __init__(self) -> None:
        self.id = next(_ids)
        self.ops: List[_Op] = []
        self.device: Optional[torch.device] = None
        self.pool: Optional[FakePool] = None
        self.stream: Optional[FakeStream] = None
        self.reads: List[torch.Tensor] = []  # memory from outside the graph
        self.writes: List[torch.Tensor] = []
        self.made: List[torch.Tensor] = []  # allocated by the capture, from its pool
        self._made: Set[int] = set()
        self._read: Set[int] = set()

    def __repr__(self) -> str:
        return f"<graph {self.id}>"

    def record(self, streams: RecordingStreams, func: Any, args: Any, kwargs: Any,
               out: Any) -> None:
        name = func.overloadpacket.__name__
        if name in _HOST_READS:
            with streams._lock:
                streams.violations.append(f"{func} read a value on the host during the capture "
                                          f"of {self}")
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        for t in inputs:
            key = t.untyped_storage()._cdata
            if key not in self._made and key not in self._read:
                self._read.add(key)
                self.reads.append(t)
        if func.is_view:
            return
        fresh = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)
                 and t.untyped_storage()._cdata not in {i.untyped_storage()._cdata
                                                        for i in inputs}]
        for t in fresh:
            self._made.add(t.untyped_storage()._cdata)
            self.made.append(t)
            streams.adopt(t, f"graph pool {name}{tuple(t.shape)} of {self}")
        if name in _ALLOCATIONS:
            return
        mutated = _mutated(func, args, kwargs)
        self.ops.append(_Op(func, args, kwargs, out, bool(mutated)))
        self.writes += fresh + mutated

    def seal(self) -> None:
        """End of the capture: what it allocated holds nothing until a replay writes it."""
        with torch.no_grad():
            for t in self.made:
                if t.is_floating_point():
                    t.data.fill_(float("nan"))


def _mutated(func: Any, args: Any, kwargs: Any) -> List[torch.Tensor]:
    """The tensor arguments ``func`` writes in place."""
    found = []
    for i, argument in enumerate(func._schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            value = kwargs.get(argument.name, args[i] if i < len(args) else None)
            found += [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
    return found


class _Recorder(TorchDispatchMode):
    """:meth:`RecordingStreams.capturing`'s dispatch mode."""

    def __init__(self, streams: RecordingStreams, graph: FakeGraph) -> None:
        super().__init__()
        self.streams, self.graph = streams, graph

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.graph.record(self.streams, func, args, kwargs, out)
        return out
