"""The grouped exchange's stream protocol (fastpipe.streams.exchange), driven through real
GroupedExchanges of two ranks in one process: messages posted by the real message path, packed
by the real ``pack``, sent and received in the real phases, with torch.distributed replaced by
an in-process pair of ranks whose data channel runs on a pretend NCCL stream per rank (ordered
after the current stream at launch, ``wait()`` ordering the current stream after it, tensors
recorded on it, as the NCCL process group does). Each rank's device is the CPU playing a GPU,
its streams and pools RecordingStreams', every tensor operation declared on the stream issuing
it."""
import collections
import types

import pytest
import torch

from fastpipe.runtime.transport import grouped
from fastpipe.runtime.transport.grouped import GroupedExchange, Stash
from fastpipe.runtime.transport.message import post
from fastpipe.runtime.transport.p2p import Channels, SendLog, StepInfo, Transport
from fastpipe.schedule import Comm, CommGroup, CommKind, Payload
from fastpipe.streams.exchange import ExchangeStreams
from recording_streams import RecordingStreams

CPU = torch.device("cpu")


class _Work:
    def __init__(self, finish=lambda: None):
        self._finish = finish

    def wait(self, timeout=None):
        self._finish()
        return True


class _Ranks:
    """torch.distributed for two ranks in one process; ``me`` is the rank calling now. Each
    (sender, receiver, channel, tag) is a first-in first-out queue; a rank sends before its
    peer receives."""

    def __init__(self, recs):
        self.recs, self.me = recs, 0
        self.queues = collections.defaultdict(collections.deque)
        self.nccl = {rank: rec.new_stream("cpu", f"nccl{rank}") for rank, rec in recs.items()}
        self.dist = types.SimpleNamespace(isend=self._side_send, irecv=self._side_recv,
                                          P2POp=self._p2p_op,
                                          batch_isend_irecv=self._batch)

    # the side channel (gloo, host memory): no streams
    def _side_send(self, tensor, dst, group=None, tag=0):
        with self.recs[self.me].quiet():
            self.queues[(self.me, dst, "side", tag)].append(tensor.clone())
        return _Work()

    def _side_recv(self, tensor, src, group=None, tag=0):
        key, rec = (src, self.me, "side", tag), self.recs[self.me]

        def finish():
            with rec.quiet():
                tensor.copy_(self.queues[key].popleft())
        return _Work(finish)

    # the data channel (NCCL): one work for a batch, as NCCL coalesces it
    @staticmethod
    def _p2p_op(op, tensor, peer, group=None, tag=0):
        return op, tensor, peer, tag

    def _batch(self, ops):
        me, rec, nccl = self.me, self.recs[self.me], self.nccl[self.me]
        rec.wait_stream(nccl, rec.issuing())
        for op, tensor, peer, tag in ops:
            rec.record_stream(tensor, nccl)
            if op is self.dist.isend:
                rec.compute(nccl, reads=[tensor], what="nccl send")
                with rec.quiet():
                    self.queues[(me, peer, "data", tag)].append(tensor.clone())
            else:
                rec.compute(nccl, writes=[tensor], what="nccl receive")
                with rec.quiet():
                    tensor.copy_(self.queues[(peer, me, "data", tag)].popleft())
        return [_Work(lambda: rec.wait_stream(rec.issuing(), nccl))]


class _Inbox:
    def __init__(self):
        self.items = {}

    def put(self, key, value):
        self.items[key] = value


class _Rank:
    """One rank: its stage (virtual stage = rank), stream, exchange and mailboxes."""

    def __init__(self, rank, rec, ranks):
        self.rank, self.rec, self.ranks = rank, rec, ranks
        self.stage = rec.new_stream("cpu", f"stage{rank}")
        transport = Transport("pg", CPU, rank, Channels(), StepInfo(0, 4, 16))
        self.exchange = GroupedExchange(transport, "side", rank, [0, 1], SendLog(),
                                        streams=ExchangeStreams(CPU, backend=rec))
        self.exchange.streams.stages = [self.stage]
        self.inbox = _Inbox()
        mailboxes = [self.inbox, self.inbox]
        mailboxes[1 - rank] = Stash(1 - rank, self.exchange.outgoing)
        self.step = types.SimpleNamespace(
            mailboxes=mailboxes,
            config=types.SimpleNamespace(stages=[types.SimpleNamespace(device=CPU)] * 2))

    def produce(self, what, mb, value, loss=None):
        """The stage computes ``value`` (and the micro-batch's loss) and posts it."""
        self.rec.compute(self.stage, what="the stage's earlier work")
        tensors = [value] if isinstance(value, torch.Tensor) else list(value)
        for t in tensors:
            self.rec.made(t, self.stage)
        if loss is not None:
            self.exchange.transport.info.losses[mb] = self.rec.made(loss, self.stage)
        key = Comm(CommKind.RECV, what, self.rank, mb, 1 - self.rank)
        post(self.step, 1 - self.rank, key, value, detach=True)

    def exchange_group(self, kind, what, mb):
        self.ranks.me = self.rank
        op = Comm(kind, what, 1 - self.rank, mb, self.rank)
        with self.rec.tracking():
            posted = self.exchange.post(CommGroup((op,)))
            self.rec.compute(self.stage, what="the stage's next action")
            self.exchange.finish(posted, self.step.mailboxes, lambda work, what: work.wait())
        return op

    def consume(self, op):
        """The stage takes a received message and reads its tensors."""
        message = self.inbox.items.pop(op)
        tensors = [t for t in message.parcel.tensors if t is not None]
        with self.rec.using(self.stage):
            self.rec.compute(self.stage, reads=tensors, what="the stage's layers")
        return tensors


@pytest.fixture
def pair(monkeypatch):
    recs = {0: RecordingStreams("cpu"), 1: RecordingStreams("cpu")}
    ranks = _Ranks(recs)
    monkeypatch.setattr(grouped, "dist", ranks.dist)
    return _Rank(0, recs[0], ranks), _Rank(1, recs[1], ranks)


def _activation(mb, rows):
    """Two tensors, one not contiguous: the pack copies both on the communication stream."""
    generator = torch.Generator().manual_seed(mb)
    return (torch.randn(rows, 6, generator=generator),
            torch.randn(5, rows, generator=generator).t())


def _send_activation(sender, receiver, mb, rows):
    value = _activation(mb, rows)
    expected = [t.clone() for t in value]
    sender.produce(Payload.ACT, mb, value)
    del value  # the message holds the only reference, as for an input gradient
    sender.exchange_group(CommKind.SEND, Payload.ACT, mb)
    op = receiver.exchange_group(CommKind.RECV, Payload.ACT, mb)
    for got, want in zip(receiver.consume(op), expected):
        assert torch.equal(got, want)


def test_packed_sends_and_received_buffers_keep_the_stream_protocol(pair):
    sender, receiver = pair
    for rows in (3, 3, 7):  # first sizes (phase 2), the same (phase 1), new ones (filler)
        for mb in (0, 1):
            _send_activation(sender, receiver, mb, rows)
    sender.rec.check()
    receiver.rec.check()
    comm = sender.exchange.streams.stream
    packs = [e for e in sender.rec.log if e[0] == "op" and e[1] == "copy" and e[2] is comm]
    assert len(packs) == 12  # two tensors per message, six messages
    assert not sender.exchange.outgoing and not receiver.inbox.items


def test_a_single_strided_tensor_is_copied_into_the_packed_buffer_in_order(pair):
    sender, receiver = pair
    value = torch.randn(4, 3).t()
    expected = value.clone()
    sender.produce(Payload.ACT, 0, value)
    del value
    sender.exchange_group(CommKind.SEND, Payload.ACT, 0)
    op = receiver.exchange_group(CommKind.RECV, Payload.ACT, 0)
    (got,) = receiver.consume(op)
    assert torch.equal(got, expected)
    sender.rec.check()
    receiver.rec.check()


def test_gradients_and_the_loss_travel_back_in_order(pair):
    first, last = pair
    for mb in (0, 1):
        grads = (torch.randn(3, 6), torch.randn(2, 2).t())
        expected = [g.clone() for g in grads]
        last.produce(Payload.GRAD, mb, grads, loss=torch.tensor(0.25 + mb))
        del grads
        last.exchange_group(CommKind.SEND, Payload.GRAD, mb)
        op = first.exchange_group(CommKind.RECV, Payload.GRAD, mb)
        for got, want in zip(first.consume(op), expected):
            assert torch.equal(got, want)
        loss = first.exchange.transport.info.losses[mb]
        with first.rec.using(first.stage):
            first.rec.compute(first.stage, reads=[loss], what="the loss read on the stage")
        assert float(loss) == 0.25 + mb
    first.rec.check()
    last.rec.check()
