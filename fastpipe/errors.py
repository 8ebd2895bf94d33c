"""Typed errors raised by fastpipe, each naming what went wrong and how to fix it."""
from __future__ import annotations

from typing import Any, Optional


class PipelineError(RuntimeError):
    """A failure while a pipeline step was running (not a bad argument)."""


class PipelineTimeout(PipelineError, TimeoutError):
    """A blocking wait in the pipeline ran past its timeout.

    The message names the stage, the action and the micro-batch that waited, so a stuck
    pipeline is diagnosed from the error alone.
    """

    def __init__(self, message: str, *, stage: Optional[int] = None, action: Optional[str] = None,
                 microbatch: Optional[int] = None, rank: Optional[int] = None) -> None:
        super().__init__(message)
        self.stage = stage
        self.action = action
        self.microbatch = microbatch
        self.rank = rank


class StageFailure(PipelineError):
    """A stage failed while running an action; carries where it happened, the original
    exception chained as ``__cause__``.

    Kept for programs that catch it: the pipelines no longer wrap exceptions in it. An
    exception raised by the user's layers or loss reaches the caller with its own type, located
    by a note (see :func:`located`); fastpipe's own failures are the other ``PipelineError``s.
    """

    def __init__(self, message: str, *, stage: int, action: str, microbatch: int) -> None:
        super().__init__(message)
        self.stage = stage
        self.action = action
        self.microbatch = microbatch


class LossFunctionError(TypeError):
    """``loss_fn`` returned a value that no backward can start from (not a scalar, not a
    floating-point tensor, or without a gradient graph), or a count that is not a count.
    Raised to the caller as it is, naming the micro-batch: before any gradient is written, or
    for a count tensor (checked on the device) at the step's close, the gradients from before
    the step put back."""


class ProcessGroupError(RuntimeError):
    """``torch.distributed`` is not set up the way a ``DistributedPipe`` needs."""


class ProtocolError(PipelineError):
    """A message from another rank that does not decode as fastpipe's wire format (metadata
    that is not the data it must be: a corrupt or forged message, or a rank running other
    code); ``rank`` is the sending rank. Nothing in the message was run or kept."""

    def __init__(self, message: str, *, rank: Optional[int] = None) -> None:
        super().__init__(message)
        self.rank = rank


class TooFewDevices(ValueError, IndexError):
    """``devices`` lists fewer devices than the pipeline has stages.

    A ``ValueError`` like fastpipe's other argument errors, and an ``IndexError`` as torchgpipe
    raises it, so a program written for either catches it."""


def describe(error: BaseException) -> str:
    """``Type: message`` of an exception, with the notes added to it (``add_note``)."""
    notes = "; ".join(getattr(error, "__notes__", ()))
    return f"{type(error).__name__}: {error}" + (f" ({notes})" if notes else "")


class PipelineAborted(PipelineError):
    """A stage stopped because another stage of the same step failed first."""


def located(error: BaseException, action: Any, rank: Optional[int] = None) -> BaseException:
    """``error`` (raised by the user's code in ``action``) with a note saying where it ran.

    A user exception keeps its own type, so ``except ValueError:`` around a step works as
    around the plain model; the note (shown in the traceback) names the rank, stage, action and
    micro-batch, which also stay readable as ``error.pipeline_location`` (a dict).
    """
    where = {"rank": rank, "stage": action.stage, "action": str(action),
             "microbatch": action.microbatch}
    if getattr(error, "pipeline_location", None) is None:
        prefix = f"rank {rank}, " if rank is not None else ""
        error.add_note(f"raised in the pipeline at {prefix}stage {action.stage}, action {action} "
                       f"(micro-batch {action.microbatch})")
        try:
            error.pipeline_location = where  # type: ignore[attr-defined]
        except AttributeError:  # an exception type with __slots__
            pass
    return error


class PeerLost(PipelineAborted):
    """A rank stopped because another rank of the pipeline exited, froze or never started.

    ``culprit`` is the sentence naming that rank and what it was doing, which this rank posts
    for every other rank to report.
    """

    def __init__(self, message: str, *, culprit: str) -> None:
        super().__init__(message)
        self.culprit = culprit


class NonFiniteError(RuntimeError):
    """A training step's loss or gradient is inf or NaN (``train_step(nonfinite='raise')``).

    Raised on every rank alike, before the optimizer step (no optimizer state has changed),
    naming where it was first seen: ``rank``, ``stage`` (virtual stage), ``microbatch`` (the
    first micro-batch whose loss is not finite) or ``parameter`` (the plain-model name of the
    first parameter whose gradient is not finite). Those that are unknown are ``None``.
    ``agreed``: every rank raised it at the same point of the step (the pipe stays usable).
    """

    def __init__(self, message: str, *, rank: Optional[int] = None, stage: Optional[int] = None,
                 microbatch: Optional[int] = None, parameter: Optional[str] = None,
                 agreed: bool = False) -> None:
        super().__init__(message)
        self.rank = rank
        self.stage = stage
        self.microbatch = microbatch
        self.parameter = parameter
        self.agreed = agreed
