"""The runtime runs lower()'s programs: local and skip-connection transfers in the lowering,
the messages a step hands over are exactly its receive ops, and a deadlocking program fails
before any work."""
import copy
from collections import Counter

import pytest
import torch
from torch import nn

import fastpipe
from fastpipe.runtime.lowering import lowering, skip_links
from fastpipe.runtime.transport.mailbox import Mailbox
from fastpipe.schedule import (Comm, CommGroup, CommKind, Schedule, ScheduleError, SkipLink,
                               format_program, get_schedule, lower, run_lockstep)
from helpers import assert_same_grads, grads_of, reference
from skip_models import AddX, StashX


def test_local_transfers_are_ops_to_the_stage_itself():
    schedule = Schedule.from_strings("t", ["0F0 0F0.1 0B0.1 0B0"], num_chunks=2)
    assert format_program(lower(schedule)[0]) == "0F0 0F0.1 0B0.1 0B0"
    assert format_program(lower(schedule, local=True)[0]) == (
        "0F0 [send act0 v0->0 | recv act0 v1<-0] 0F0.1 0B0.1 [send grad0 v1->0 | "
        "recv grad0 v0<-0] 0B0")


def test_skip_transfers_go_between_the_links_ends():
    schedule = get_schedule("gpipe", 3, 1)
    link = SkipLink("h", 0, 2)
    programs = [format_program(p) for p in lower(schedule, skips=[link])]
    assert programs == [
        "0F0 [send act0 v0->1 | send act0[h] v0->2 | recv grad0 v0<-1 | recv grad0[h] v0<-2] 0B0",
        "[recv act0 v1<-0] 1F0 [send act0 v1->2 | recv grad0 v1<-2] 1B0 [send grad0 v1->0]",
        "[recv act0 v2<-1 | recv act0[h] v2<-0] 2F0 2B0 [send grad0 v2->1 | send grad0[h] v2->0]",
    ]
    send = Comm(CommKind.SEND, "act", 2, 0, 0, link)
    assert send.counterpart(0) == Comm(CommKind.RECV, "act", 0, 0, 2, link)
    assert send.counterpart(0).counterpart(2) == send
    run_lockstep(schedule, lower(schedule, skips=[link]), comm="rendezvous")


@pytest.mark.parametrize("name, v", [("1f1b", 1), ("interleaved", 2), ("zbv", 2), ("zb-h1", 1)])
def test_every_receive_op_names_one_message_sent_once(name, v):
    schedule = get_schedule(name, 2, 4, virtual_stages=v)
    links = (SkipLink("s", 0, 2 * v - 1),)
    lowered = lowering(schedule, schedule.actions, links)
    receives = [c for p in lowered.programs for op in p if isinstance(op, CommGroup)
                for c in op.ops if c.kind is CommKind.RECV]
    sent = [target[1] for row in lowered.rows for _, route in row
            for target in [route.output, *route.skip_outputs.values()] if target is not None]
    assert Counter(receives) == Counter(sent) and len(set(receives)) == len(receives)
    assert lowering(schedule, schedule.actions, links) is lowered  # cached


def test_a_deadlocking_program_fails_when_lowered():
    schedule = Schedule.from_strings("crossed", ["0B0 0F0", "1F0 1B0"])
    with pytest.raises(ScheduleError, match="deadlocks"):
        lowering(schedule, schedule.actions, ())


@pytest.mark.parametrize("schedule, v, checkpoint", [("1f1b", 1, "never"),
                                                     ("interleaved", 2, "always"),
                                                     ("zbv", 2, "never")])
def test_a_step_hands_over_exactly_the_messages_of_its_lowered_programs(monkeypatch, schedule,
                                                                       v, checkpoint):
    torch.manual_seed(0)
    layers = [StashX(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), AddX(), nn.Linear(8, 4),
              nn.Linear(4, 4), nn.Linear(4, 4)]
    model = nn.Sequential(*layers)
    x, y = torch.randn(7, 8), torch.randn(7, 4)  # uneven micro-batches
    expected_loss, expected = reference(copy.deepcopy(model), x, y, nn.MSELoss())
    pipe = fastpipe.Pipe(model, chunks=4, balance=[2, 6] if v == 1 else [2, 1, 1, 4],
                         devices=["cpu"] * 2, schedule=schedule, virtual_stages=v,
                         checkpoint=checkpoint)
    put, original = [], Mailbox.put
    monkeypatch.setattr(Mailbox, "put", lambda box, key, value: (put.append(key),
                                                                 original(box, key, value))[1])
    loss = pipe.train_step(x, y, nn.MSELoss())
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-7)
    assert_same_grads(grads_of(model), expected)
    plan = pipe.plan(4)
    links = skip_links(s.skips.skips for s in pipe._stages if s.skips is not None)
    assert links == (SkipLink("x", 0, 2 * v - 1),)
    lowered = lowering(plan, plan.actions, links)
    receives = [c for p in lowered.programs for op in p if isinstance(op, CommGroup)
                for c in op.ops if c.kind is CommKind.RECV]
    assert any(c.skip is not None for c in receives)
    assert Counter(put) == Counter(receives)
