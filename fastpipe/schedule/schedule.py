"""The public :class:`Schedule`: a schedule's data with its analyses as methods.

:class:`~fastpipe.schedule.ir.ScheduleData` is what the validator, the lowerings and the
simulator read; this module sits above them, so ``schedule.validate()`` and
``schedule.simulate()`` are plain calls into them and every import goes one way.
"""

from __future__ import annotations

from .ir import ScheduleData
from .simulator import Cost, Costs, SimulationResult, simulate
from .validate import ValidationReport, validate

__all__ = ["Schedule"]


class Schedule(ScheduleData):
    """A pipeline schedule: for each physical stage, its actions in execution order (the data
    of :class:`~fastpipe.schedule.ir.ScheduleData`), with its validation and its simulation as
    methods."""

    def validate(self, *, comm: str = "rendezvous") -> ValidationReport:
        """Check this schedule (see :func:`fastpipe.schedule.validate.validate`); ``comm`` is the
        deadlock model, ``"rendezvous"`` (unbuffered sends) or ``"buffered"``."""
        return validate(self, comm=comm)

    def simulate(self, costs: Costs | None = None, **kw: Cost) -> SimulationResult:
        """Time this schedule under ``costs`` (see :func:`fastpipe.schedule.simulator.simulate`);
        keywords replace fields of ``costs``."""
        return simulate(self, costs, **kw)
