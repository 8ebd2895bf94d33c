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

Operations the seam does not issue through the backend (a stage's compute) are declared by the
test: :meth:`RecordingStreams.made` (a tensor produced on a stream) and
:meth:`RecordingStreams.compute` (reads and writes on a stream). :meth:`RecordingStreams.check`
raises ``AssertionError`` listing every violation.
"""
from __future__ import annotations

import contextlib
import itertools
import threading
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef

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

    # ---------------------------------------------------------------- streams
    def default(self, device: Any) -> FakeStream:
        """The default stream of ``device``."""
        device = torch.device(device)
        if device not in self._defaults:
            self._defaults[device] = self._stream(device, f"{device}:default")
        return self._defaults[device]

    def _stream(self, device: torch.device, name: str) -> FakeStream:
        stream = FakeStream(device, name)
        self._clocks[stream] = {stream: 0}
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
        return self.completed

    def record_stream(self, tensor: torch.Tensor, stream: FakeStream) -> None:
        with self._lock:
            memory = self._find(tensor)
            self.log.append(("record_stream", memory.label, stream))
            memory.recorded.add(stream)

    # ---------------------------------------------------------------- memory and work
    def empty(self, shape: Sequence[int], dtype: torch.dtype, device: Any,
              pin_memory: bool = False) -> torch.Tensor:
        tensor = torch.empty(tuple(shape), dtype=dtype)
        device = torch.device(device)
        if device.type == "cpu":  # host memory: outside the streams' pools
            self.adopt(tensor, "host buffer")
            return tensor
        with self._lock:
            stream = self.current(device)
            label = f"empty{tuple(shape)}@{stream.name}#{len(self.log)}"
            self._register(tensor, label, Stamp(stream, dict(self._clocks[stream]), "alloc"))
            self.log.append(("empty", label, stream))
        return tensor

    def copy(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = True) -> None:
        self.compute(self.issuing(), reads=[src], writes=[dst], what="copy")
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

    # ---------------------------------------------------------------- bookkeeping
    def _register(self, tensor: torch.Tensor, label: str, alloc: Optional[Stamp]) -> Memory:
        storage = tensor.untyped_storage()
        memory = Memory(StorageWeakRef(storage), label, alloc)
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
        for memory in self._memory.values():
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
