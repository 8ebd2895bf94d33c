"""The state-dict route matrix of the one-process front doors, across processes.

``Pipe``, ``GPipe`` and a traced ``Pipe`` (tied weights), and the plain models, saved by every
route (torch's ``get_state_dict`` nested and flattened through ``torch.distributed.checkpoint``,
``fastpipe.checkpoint``, ``torch.save`` of the state dicts) in one process, loaded in a new one
at the saving layout (bit for bit), at another layout and from the plain model (fp32
tolerance), then trained 3 steps: parameters, Adam's moments and step equal the uninterrupted
run (``state_route_cases.py``). ``DistributedPipe``'s routes: ``test_checkpoint_resume.py``.
"""
from __future__ import annotations

import pytest
import torch.distributed as dist

from dist_launch import assert_all_ok, launch

ROUTES = ("nested", "flat", "fastpipe", "torch_save")


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                    reason="needs torch.distributed with gloo (the launcher's store)")
def test_every_route_of_the_one_process_front_doors_resumes_in_a_new_process(tmp_path):
    args = {"path": str(tmp_path)}
    made = assert_all_ok(launch("routes_save", 1, limit=120, args=args,
                                script="state_route_cases.py"))[0]
    assert made == {k: len(ROUTES) for k in ("Pipe", "GPipe", "traced", "plain-Sequential",
                                             "plain-traced")}
    checked = assert_all_ok(launch("routes_load", 1, limit=180, args=args,
                                   script="state_route_cases.py"))[0]
    cells = {(kind, layout, route, source.startswith("plain"))
             for kind, layout, route, source in _cells(checked)}
    assert cells == {(kind, layout, route, plain) for kind in ("Pipe", "GPipe", "traced")
                     for route in ROUTES
                     for layout, plain in (("saved", False), ("other", False), ("saved", True))}
    assert all(n > 0 for n in checked.values())


def _cells(checked):
    for where in checked:
        source, rest = where.split(" -> ")
        kind, rest = rest.split(" at the ")
        layout, route = rest.split(" layout by ")
        yield kind, layout, route, source
