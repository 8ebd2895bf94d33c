"""Asynchronous PipeDream: the 1F1B action order with no flush of the weights between groups.

The action table is 1F1B's (warm-up forwards, one forward / one backward, cool-down); what differs
is what the runtime does around it (``fastpipe.runtime.weight_versions``): every stage applies its
optimizer after each backward, the forward of a micro-batch uses the stage's latest weights, and its
backward uses the very version its forward used (weight versions). The schedule is data like any
other, so it validates, simulates and draws as 1F1B does.
"""

from __future__ import annotations

from .actions import gc_paused
from .checks import check_count, require_chunks
from .schedule import Schedule
from .one_f_one_b import one_f_one_b

__all__ = ["pipedream"]


@gc_paused()
def pipedream(num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> Schedule:
    """PipeDream's schedule: 1F1B's action order, named ``'pipedream'`` so executors run it with
    per-micro-batch weight updates and weight versions. One chunk per stage."""
    check_count("num_stages", num_stages)
    check_count("num_microbatches", num_microbatches)
    require_chunks("pipedream", virtual_stages, 1, "1f1b")
    rows = one_f_one_b(num_stages, num_microbatches).actions
    return Schedule("pipedream", num_stages, num_microbatches, rows)
