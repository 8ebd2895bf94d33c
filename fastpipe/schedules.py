"""Alias of :mod:`fastpipe.schedule`, plus the schedule recommender.

``fastpipe.schedules.simulate`` (like :meth:`Schedule.simulate`) is the timed simulator; the
validator's lock-step deadlock check is ``run_lockstep``.
"""

from .schedule import *  # noqa: F401,F403
from .schedule import __all__ as _schedule_all
from .schedule.recommend import Recommendation, recommend

__all__ = [*_schedule_all, "Recommendation", "recommend"]
