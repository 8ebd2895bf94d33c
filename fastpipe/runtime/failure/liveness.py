"""Each rank's sign of life in the job's key-value store, read to name the rank holding a pipe up.

A rank records in the store that it built its pipe; a heartbeat thread then keeps a record fresh:
a beat count, the step the rank is in, what it is doing (running or waiting for an action), and
whether its process has exited. A rank that waited past its timeout, or whose peer's connection
closed, reads every rank's record twice, a few beats apart, and names the culprit: a rank that
exited or stopped beating (its process died or froze), one that never built its pipe, one still
in an earlier step, or one stuck running an action. Store traffic stays small: one write per beat
or per change of state (at most one every ``MIN_GAP`` seconds), from the heartbeat thread, which
wakes when the state changes.
"""
from __future__ import annotations

import atexit
import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

BEAT_EVERY = 0.25  # seconds between beats while nothing changes
MIN_GAP = 0.05  # seconds at least between two writes (a change is written after at most this):
# each write wakes this thread, which then competes for the GIL with the worker running actions
STALE_AFTER = 1.0  # a rank whose beat count did not move in this long has stopped
FAILED = "failed"  # the state of a rank whose step failed (it posted why on the board)

_live: "weakref.WeakSet[_Beater]" = weakref.WeakSet()


@dataclass(frozen=True)
class Record:
    """One rank's last report."""

    count: int
    step: int
    exited: bool
    doing: str

    def where(self) -> str:
        """When the report was made, e.g. ``during step 2, running action 1B3 (micro-batch 3)``."""
        return f"during step {self.step}, {self.doing}" if self.step else f"({self.doing})"

    def encode(self) -> str:
        return f"{self.count}|{self.step}|{int(self.exited)}|{self.doing}"

    @classmethod
    def decode(cls, text: str) -> "Record":
        count, step, exited, doing = text.split("|", 3)
        return cls(int(count), int(step), exited == "1", doing)


class _Beater(threading.Thread):
    """Writes this rank's record whenever its state changes, and at least every beat."""

    def __init__(self, store: Any, key: str) -> None:
        super().__init__(name="fastpipe-heartbeat", daemon=True)
        self.store, self.key = store, key
        self._state: Tuple[int, str] = (0, "built its pipe, no step run yet")
        self.count = 0
        self.stopped = threading.Event()
        self.changed = threading.Event()

    @property
    def state(self) -> Tuple[int, str]:
        return self._state

    @state.setter
    def state(self, value: Tuple[int, str]) -> None:
        self._state = value
        self.changed.set()

    def run(self) -> None:
        while not self.stopped.is_set():
            self.changed.wait(BEAT_EVERY)
            self.changed.clear()
            if self.stopped.is_set() or not self.write(self._state, exited=False):
                return  # stopped, or the store is gone: the job is over
            self.stopped.wait(MIN_GAP)

    def write(self, state: Tuple[int, str], exited: bool) -> bool:
        self.count += 1
        try:
            self.store.set(self.key, Record(self.count, state[0], exited, state[1]).encode())
            return True
        except Exception:  # noqa: BLE001 - a store that went away with its host
            return False

    def exit(self) -> None:
        """The process is exiting: stop beating (the thread ends before the interpreter and
        torch's own threads are torn down), then say so."""
        self.stopped.set()
        self.changed.set()
        if self.is_alive():
            self.join(timeout=2.0)
        self.write(self.state, exited=True)


@atexit.register
def _exiting() -> None:
    for beater in list(_live):
        beater.exit()


class Liveness:
    """This rank's record in the store, and the reading of every rank's records."""

    def __init__(self, name: str, rank: int, ranks: Sequence[int], store: Optional[Any]) -> None:
        self.prefix = f"fastpipe/{name}"
        self.rank = rank
        self.ranks = list(ranks)
        self.store = store
        self._beater: Optional[_Beater] = None
        if store is None:
            return
        beater = _Beater(store, self._key("alive", rank))
        try:
            store.set(self._key("built", rank), "1")
            beater.write(beater.state, exited=False)  # before the constructor returns
        except Exception:  # noqa: BLE001 - no store: failures are then caught by timeouts only
            self.store = None
            return
        beater.start()
        _live.add(beater)
        self._beater = beater
        weakref.finalize(self, beater.stopped.set)

    def _key(self, what: str, rank: int) -> str:
        return f"{self.prefix}/{what}/{rank}"

    def at(self, step: int, doing: str) -> None:
        """What this rank is doing now (cheap: the heartbeat thread writes it)."""
        if self._beater is not None:
            self._beater.state = (step, doing)

    def failed(self) -> None:
        """This rank's step failed (and it posted why): it no longer holds anyone up."""
        self.at(self.step, f"{FAILED} in this step")

    @property
    def step(self) -> int:
        return self._beater.state[0] if self._beater is not None else 0

    def _read(self) -> Dict[int, Optional[Record]]:
        """Every other rank's record (``None``: it never wrote one). Raises what the store
        raised when it cannot be reached."""
        records: Dict[int, Optional[Record]] = {}
        for rank in self.ranks:
            if rank == self.rank:
                continue
            key = self._key("alive", rank)
            text = self.store.get(key).decode() if self.store.check([key]) else None
            try:
                records[rank] = Record.decode(text) if text is not None else None
            except ValueError:  # a record of another format tells nothing
                records[rank] = None
        return records

    def culprit(self, waited_on: Optional[int] = None) -> Optional[str]:
        """The rank most likely holding the pipeline up, in a sentence; ``None`` when every
        other rank looks healthy (or there is no store). Takes ``STALE_AFTER`` seconds: each
        record is read twice to see whether its rank still beats."""
        if self.store is None:
            return None
        try:
            first = self._read()
            time.sleep(STALE_AFTER)
            second = self._read()
        except Exception as error:  # noqa: BLE001 - no store: every record is out of reach
            return unreachable(error)
        found: List[Tuple[int, int, str]] = []  # (priority, rank, sentence)
        for rank, now in second.items():
            verdict = _verdict(rank, first.get(rank), now, self.step)
            if verdict is not None:
                found.append((verdict[0], rank, verdict[1]))
        if not found:
            return None
        found.sort(key=lambda f: (f[0], f[1] != waited_on, f[1]))
        return found[0][2]


def unreachable(error: BaseException) -> str:
    """Why the job's key-value store cannot be reached, naming the process that hosts it when
    torchrun's environment tells: rank 0 when the ranks host it themselves (``torchrun`` with
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``), else torchrun's agent on the first machine."""
    hosted_by = os.environ.get("TORCHELASTIC_USE_AGENT_STORE")
    if hosted_by == "False":
        host = "rank 0, which hosts the job's key-value store, exited or became unreachable"
    elif hosted_by == "True":
        host = ("the job's key-value store is unreachable (torchrun's agent that hosts it, on "
                "the first machine, exited, or the network failed)")
    else:
        host = ("the job's key-value store is unreachable (the process hosting it has exited "
                "or the network failed)")
    return f"{host}: {error}"


def _verdict(rank: int, before: Optional[Record], now: Optional[Record],
             step: int) -> Optional[Tuple[int, str]]:
    """Why ``rank`` may hold the pipeline up, with a priority (lower: more certain)."""
    if now is not None and now.doing.startswith(FAILED):
        return None  # it failed and said why on the board: not the one holding others up
    if now is None:
        return 1, (f"rank {rank} never built its pipe (it failed, exited or is stuck before "
                   f"DistributedPipe(...) returned: see its log)")
    if now.exited:
        return 0, f"rank {rank} exited {now.where()}"
    if before is not None and before.count == now.count:
        return 0, (f"rank {rank} stopped responding {now.where()} (its process died or froze; "
                   f"see its log)")
    if now.step < step:
        return 2, f"rank {rank} has not reached step {step}: its last report is {now.where()}"
    if now.doing.startswith("running"):
        return 3, (f"rank {rank} is stuck or slow, {now.where()} (stuck in user code, or "
                   f"slower than the timeout)")
    return None
