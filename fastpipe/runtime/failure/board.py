"""Failure notices between ranks: the first failure, posted where every rank reads it.

A rank that fails writes one line to the process group's key-value store (the "board"); every
other rank checks the board while it waits, so it stops within a fraction of a second with an
error naming the rank that failed, instead of waiting for a message that will never come. A
rank that dies without writing (killed) is caught by its peers' receive errors or timeouts.
The keys of a pipe go under ``fastpipe/[attempt<N>/]pipe<K>/``: under torchrun's agent store,
which every attempt of a restarted job shares, a new attempt never reads an old one's notices.
The bounded waits that read the board live in :mod:`.waits`.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch.distributed as dist

from ...errors import PeerLost, PipelineAborted, PipelineError, PipelineTimeout
from ..transport.backends import attempt_scope
from .liveness import Liveness, unreachable


class Board:
    """The abort notice of one distributed pipe, shared by all of its ranks."""

    def __init__(self, name: str, rank: int, store: Optional[Any] = None,
                 ranks: Sequence[int] = ()) -> None:
        name = attempt_scope() + name
        self.key = f"fastpipe/{name}/abort"
        self.rank = rank
        self.store = store if store is not None else _default_store()
        self._seen: Optional[str] = None
        self.liveness = Liveness(name, rank, ranks, self.store)

    def publish(self, reason: str) -> None:
        """Post the first failure of this pipe (later ones are dropped); never raises."""
        self.liveness.failed()
        if self.store is None:
            return
        try:
            if self.store.add(self.key + "/count", 1) == 1:
                self.store.set(self.key, reason)
        except Exception:  # noqa: BLE001 - the store may be gone with a dead rank
            pass

    def read(self) -> Optional[str]:
        """The failure posted by any rank, or None."""
        if self._seen is not None or self.store is None:
            return self._seen
        try:
            if self.store.check([self.key]):
                self._seen = self.store.get(self.key).decode()
        except Exception as error:  # noqa: BLE001 - a lost store means a lost job
            self._seen = unreachable(error)
        return self._seen

    def share(self, facts: str) -> None:
        """Post this rank's facts (how it built the pipe) for the others to compare."""
        if self.store is not None:
            try:
                self.store.set(f"{self.key}/facts/{self.rank}", facts)
            except Exception:  # noqa: BLE001 - no store: mismatches surface as errors later
                pass

    def facts(self, ranks: Sequence[int]) -> dict:
        """The facts every rank of ``ranks`` that built its pipe has posted, by rank."""
        found = {}
        for rank in ranks:
            key = f"{self.key}/facts/{rank}"
            try:
                if self.store is not None and self.store.check([key]):
                    found[rank] = self.store.get(key).decode()
            except Exception:  # noqa: BLE001 - a lost store: the step's waits will tell
                pass
        return found

    def check(self) -> None:
        """Raise ``PipelineAborted`` if another rank posted a failure."""
        reason = self.read()
        if reason is not None:
            raise PipelineAborted(f"rank {self.rank} stopped because {reason}")

    def blame(self, timeout: PipelineTimeout, waited_on: Optional[int] = None) -> PipelineTimeout:
        """``timeout`` with the rank holding the pipeline up named (from the ranks' liveness
        records), which this rank then posts for the others."""
        culprit = self.liveness.culprit(waited_on)
        reason = self.read()  # another rank may have found and posted it meanwhile
        if reason is not None:
            culprit = reason
        if culprit is not None:
            timeout = PipelineTimeout(f"{timeout}; {culprit}", stage=timeout.stage,
                                      action=timeout.action, microbatch=timeout.microbatch,
                                      rank=timeout.rank)
            timeout.culprit = culprit  # type: ignore[attr-defined]
        return timeout

    def lost(self, what: str, error: BaseException,
             waited_on: Optional[int] = None) -> PipelineError:
        """The error for a communication that failed (a peer's connection closed, say): a
        ``PeerLost`` naming the rank that exited, froze or never started when the liveness
        records show one, else a ``PipelineError`` quoting the transport's error."""
        reason = self.read()
        if reason is not None:
            return PipelineAborted(f"rank {self.rank} stopped {what} because {reason}")
        culprit = self.liveness.culprit(waited_on)
        reason = self.read()  # another rank may have found and posted it meanwhile
        if reason is not None:
            return PipelineAborted(f"rank {self.rank} stopped {what} because {reason}")
        if culprit is not None:
            return PeerLost(f"rank {self.rank} stopped {what} because {culprit}",
                            culprit=culprit)
        return PipelineError(f"rank {self.rank} failed {what}: {error}")


def _default_store() -> Optional[Any]:
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store: failures are then caught by timeouts only
        return None

