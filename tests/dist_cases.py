"""Test cases run by every rank of a gloo process group (started by ``dist_launch.launch``).

Each case builds the plain model with the same seed on every rank, computes the reference loss
and gradients in-process, runs the pipeline, and raises (non-zero exit) on any mismatch; on
success it prints one ``RESULT <json>`` line.
"""
from __future__ import annotations

import copy
import json
import os
import sys
import time
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fastpipe  # noqa: E402
from fastpipe.distributed import DistributedPipe as _DistributedPipe, init_mesh  # noqa: E402

# The transport every case's pipes run (dist_launch.launch(..., p2p=...) sets it).
P2P = os.environ.get("FASTPIPE_CASES_P2P", "auto")


class DistributedPipe(_DistributedPipe):
    """fastpipe's DistributedPipe, on the transport the launch chose unless a case picks one."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("p2p", P2P)
        super().__init__(*args, **kwargs)

WIDTH = 8
TOL = dict(rtol=1e-5, atol=1e-6)


def model(depth: int = 8, dropout: bool = False) -> nn.Sequential:
    torch.manual_seed(1234)
    layers: List[nn.Module] = []
    for i in range(depth - 1):
        layers.append(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()))
    layers.append(nn.Linear(WIDTH, 4))
    return nn.Sequential(*layers)


def data(batch: int, seed: int = 7) -> tuple:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, WIDTH, generator=g), torch.randn(batch, 4, generator=g)


def reference_grads(plain: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple:
    plain.zero_grad(set_to_none=True)
    loss = nn.functional.mse_loss(plain(x), y)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in plain.named_parameters()}


def check_grads(pipe: nn.Module, expected: Dict[str, torch.Tensor], where: str) -> float:
    worst = 0.0
    names = [n for n, _ in pipe.named_parameters()]
    assert names, f"{where}: this rank holds no parameters"
    for name, p in pipe.named_parameters():
        assert p.grad is not None, f"{where}: {name} has no gradient"
        torch.testing.assert_close(p.grad, expected[name], **TOL,
                                   msg=lambda m: f"{where}: gradient of {name}: {m}")
        worst = max(worst, (p.grad - expected[name]).abs().max().item())
    return worst


# ------------------------------------------------------------------------------------- cases
def transparency(schedules: List[List[Any]], batches: List[int], chunks: int = 4) -> Dict:
    """Every (schedule, virtual_stages, checkpoint) against the plain model, uneven batches
    included; also the forward-only path."""
    worst = 0.0
    for name, v, mode in schedules:
        for batch in batches:
            plain = model(depth=max(8, 2 * dist.get_world_size() * v))
            x, y = data(batch)
            ref_loss, ref = reference_grads(plain, x, y)
            pipe = DistributedPipe(model(depth=max(8, 2 * dist.get_world_size() * v)),
                                   chunks=chunks, schedule=name, virtual_stages=v,
                                   checkpoint=mode, timeout=30)
            last = len(pipe.balance) - 1  # only the ranks that read them get inputs / targets
            loss = pipe.train_step(x if 0 in pipe.stages else None,
                                   y if last in pipe.stages else None, nn.functional.mse_loss)
            where = f"{name} v={v} {mode} batch={batch}"
            torch.testing.assert_close(loss, ref_loss, **TOL, msg=lambda m: f"{where}: loss {m}")
            worst = max(worst, check_grads(pipe, ref, where))
            out = pipe(x)
            if out is not None:
                torch.testing.assert_close(out, plain(x).detach(), **TOL)
    return {"worst": worst, "p2p": pipe.p2p}


def randomized(seed: int, count: int, path: Optional[str] = None) -> Dict:
    """Seeded random (schedule, checkpoint mode, chunks, transport, batch sizes, clipping,
    accumulation) drawn alike on every rank, each trained for several steps of changing batch
    sizes against the plain model (loss and every gradient, clipped by the global norm with
    ``max_grad_norm``, accumulated over the steps without zeroing): the transports' size
    caches and second phases included. With ``path``, some take SGD steps (with momentum, the
    optimizer's state) and resume from a
    ``fastpipe.checkpoint`` (saved under ``path``) into new pipes after the first step."""
    import random
    rng = random.Random(seed)
    schedules = {"gpipe": 1, "1f1b": 1, "interleaved": 2, "looped-bfs": 2, "zb-h1": 1,
                 "zbv": 2, "dualpipev": 2}
    modes = ["never", "except_last", "always", "selective", "offload"]
    drawn = []
    for _ in range(count):
        name = rng.choice(sorted(schedules))
        world = dist.get_world_size()  # chunked schedules take m <= stages or a multiple
        v, mode = schedules[name], rng.choice(modes)
        chunks = rng.choice([c for c in range(1, 7) if v == 1 or c <= world or c % world == 0])
        p2p = rng.choice(["tagged", "grouped"])
        batches = [rng.randint(chunks, 11) for _ in range(3)]  # uneven micro-batches
        clip = rng.choice([None, 0.05, 10.0])  # clips, or not
        resume = path is not None and rng.random() < 0.4
        accumulate = not resume and rng.random() < 0.5
        depth = max(8, 2 * dist.get_world_size() * v)
        plain = model(depth=depth)

        def build(source: nn.Module) -> tuple:
            pipe = DistributedPipe(source, chunks=chunks, schedule=name, checkpoint=mode,
                                   virtual_stages=v, timeout=30, p2p=p2p)
            return pipe, (torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9) if resume
                          else None)

        pipe, opt = build(model(depth=depth))
        # SGD with momentum: Adam would magnify rounding in gradients near zero past TOL
        opt_ref = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9) if resume else None
        last = len(pipe.balance) - 1
        for step, batch in enumerate(batches):
            x, y = data(batch, seed=seed + step)
            if resume and step == 1:  # saved by every rank, loaded into new pipes
                directory = os.path.join(path, f"{len(drawn)}")
                fastpipe.checkpoint.save(directory, pipe, opt)
                torch.manual_seed(len(drawn))
                fresh = model(depth=depth)
                for p in fresh.parameters():  # other values: the load must set them all
                    nn.init.normal_(p)
                pipe, opt = build(fresh)
                fastpipe.checkpoint.load(directory, pipe, opt)
            if not accumulate:
                plain.zero_grad(set_to_none=True)
                pipe.zero_grad(set_to_none=True)
            ref_loss = nn.functional.mse_loss(plain(x), y)
            ref_loss.backward()
            if clip is not None:
                ref_norm = float(torch.nn.utils.clip_grad_norm_(plain.parameters(), clip))
            loss = pipe.train_step(x if 0 in pipe.stages else None,
                                   y if last in pipe.stages else None, nn.functional.mse_loss,
                                   max_grad_norm=clip, optimizer=opt)
            where = (f"seed {seed}: {name} {mode} chunks={chunks} {p2p} batch={batch} "
                     f"clip={clip} accumulate={accumulate}")
            torch.testing.assert_close(loss, ref_loss.detach(), **TOL,
                                       msg=lambda m: f"{where}: {m}")
            if clip is not None:
                assert abs(pipe.last_step.grad_norm - ref_norm) <= 1e-5 * ref_norm, where
            check_grads(pipe, {n: p.grad for n, p in plain.named_parameters()}, where)
            if opt_ref is not None:
                opt_ref.step()
                after = dict(plain.named_parameters())
                for n, p in pipe.named_parameters():
                    torch.testing.assert_close(p, after[n], **TOL,
                                               msg=lambda m: f"{where}: parameter {n}: {m}")
        out = pipe.evaluate(x if 0 in pipe.stages else None)  # after training: eval mode
        if out is not None:
            with torch.no_grad():
                torch.testing.assert_close(out, plain.eval()(x), **TOL)
            plain.train()
        drawn.append([name, mode, chunks, p2p, batches, clip, accumulate, resume])
    return {"drawn": drawn}


def loss_checks() -> Dict:
    """A float64 model's loss comes back as float64 on every rank, equal to the plain model's."""
    plain = model().double()
    x, y = data(10)
    x, y = x.double(), y.double()
    ref_loss, ref = reference_grads(plain, x, y)
    pipe = DistributedPipe(model().double(), chunks=3, timeout=30)
    loss = pipe.train_step(x, y, nn.functional.mse_loss)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-14)
    check_grads(pipe, ref, "float64")
    return {"dtype": str(loss.dtype)}


def detached_loss() -> Dict:
    """A detached loss fails the step on every rank before any gradient is written (the last
    rank raises LossFunctionError, the others stop)."""
    fresh = DistributedPipe(model(), chunks=3, timeout=30)
    try:
        fresh.train_step(*data(10), lambda o, t: nn.functional.mse_loss(o, t).detach())
        error = None
    except Exception as caught:  # noqa: BLE001 - reported to the test
        error = type(caught).__name__
    return {"detached": error, "untouched": all(p.grad is None for p in fresh.parameters())}


def data_parallel(schedule: str = "1f1b", steps: int = 2) -> Dict:
    """Pipeline 2 x data 2: gradients equal the plain model's on the global batch, over steps
    with an optimizer (so replicas must stay identical)."""
    mesh = init_mesh(pipeline=2, data=2)
    pp, dp = mesh  # the two-group form
    replica = mesh.coordinate("data")  # rank = stage * 2 + replica (pipeline outermost)
    assert replica == dist.get_rank() % 2
    plain = model()
    opt_ref = torch.optim.SGD(plain.parameters(), lr=0.1)
    pipe = DistributedPipe(model(), chunks=3, schedule=schedule, process_group=pp,
                           data_parallel_group=dp, timeout=30)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        x, y = data(10, seed=step)  # the global batch; replica r reads half r
        ref_loss, ref = reference_grads(plain, x, y)
        half = slice(5 * replica, 5 * replica + 5)
        opt.zero_grad(set_to_none=True)
        loss = pipe.train_step(x[half], y[half], nn.functional.mse_loss)
        torch.testing.assert_close(loss, ref_loss, **TOL)
        check_grads(pipe, ref, f"data parallel step {step}")
        opt.step()
        opt_ref.step()
        losses.append(loss.item())
    x, targets = padded(12)  # a token-mean step: counts differ between the replicas' halves
    ref_loss = token_mean_of(plain, x, targets)
    plain.zero_grad(set_to_none=True)
    ref_loss.backward()
    half = slice(6 * replica, 6 * replica + 6)
    opt.zero_grad(set_to_none=True)
    loss = pipe.train_step(x[half], (targets[0][half], targets[1][half]), token_loss)
    torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
    check_grads(pipe, {n: p.grad for n, p in plain.named_parameters()}, "data-parallel tokens")
    return {"losses": losses}


def padded(batch: int, seed: int = 3) -> tuple:
    """Inputs and (targets, mask): a different number of counted positions per sample."""
    x, y = data(batch, seed)
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, y.shape[1] + 1, (batch,), generator=generator)
    return x, (y, (torch.arange(y.shape[1]) < lengths[:, None]).float())


def token_loss(out: torch.Tensor, targets: tuple) -> tuple:
    y, mask = targets
    return ((out - y) ** 2 * mask).sum(), mask.sum()


def token_mean_of(plain: nn.Module, x: torch.Tensor, targets: tuple) -> torch.Tensor:
    total, count = token_loss(plain(x), targets)
    return total / count


def token_mean(schedules: List[List[Any]]) -> Dict:
    """(loss_sum, count) losses across ranks: the loss and the gradients are the plain model's
    mean over every counted position of the batch."""
    for name, v, mode in schedules:
        plain = model(depth=max(8, 2 * dist.get_world_size() * v))
        x, targets = padded(10)
        ref_loss = token_mean_of(plain, x, targets)
        ref_loss.backward()
        pipe = DistributedPipe(model(depth=max(8, 2 * dist.get_world_size() * v)), chunks=4,
                               schedule=name, virtual_stages=v, checkpoint=mode, timeout=30)
        loss = pipe.train_step(x, targets, token_loss)
        torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
        check_grads(pipe, {n: p.grad for n, p in plain.named_parameters()}, f"{name} tokens")
    return {"ok": True}


class Trim(nn.Module):
    """Shortens the sequence depending on the micro-batch size: shapes change per micro-batch."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, : x.shape[1] - x.shape[0] % 3]


def seq_model() -> nn.Sequential:
    torch.manual_seed(99)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), Trim(), nn.Linear(WIDTH, WIDTH),
                         nn.Tanh(), nn.Linear(WIDTH, 4))


def seq_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out.mean(1) - y) ** 2).mean()


def variable_shapes(schedule: str = "1f1b") -> Dict:
    """Sequence lengths that change across steps and across the micro-batches of a step."""
    plain = seq_model()
    pipe = DistributedPipe(seq_model(), chunks=4, schedule=schedule, balance=[3, 3], timeout=30)
    for step, (batch, length) in enumerate([(13, 7), (10, 5), (13, 9), (7, 7)]):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(batch, length, WIDTH, generator=g), torch.randn(batch, 4, generator=g)
        sizes = [len(c) for c in torch.chunk(torch.arange(batch), 4)]
        plain.zero_grad(set_to_none=True)
        ref_loss = sum(seq_loss(plain(xi), yi) * (len(xi) / batch)
                       for xi, yi in zip(x.split(sizes), y.split(sizes)))
        ref_loss.backward()
        ref = {n: p.grad.clone() for n, p in plain.named_parameters()}
        pipe.zero_grad(set_to_none=True)
        loss = pipe.train_step(x, y, seq_loss)
        torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
        check_grads(pipe, ref, f"step {step} (batch {batch}, length {length})")
    return {"ok": True}


class UserBoom(ValueError):
    """A user's own exception type: it must reach the caller as itself."""


class Boom(nn.Module):
    """Raises in the forward of the micro-batch whose first element is tagged."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1:
            raise UserBoom("boom in a user layer")
        return x


class Hang(nn.Module):
    """Stalls (longer than the pipe's timeout) on a micro-batch of one sample."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1:
            time.sleep(8.0)
        return x


class Die(nn.Module):
    """Kills its process (no Python cleanup) when it sees a micro-batch of one sample."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1:
            os._exit(17)
        return x


def failure(kind: str, failing_rank: int, timeout: float = 20.0, linger: float = 0.0) -> Dict:
    """One rank raises (or dies) mid-step; every other rank must stop with an error naming it
    well within ``timeout``. ``linger``: the failing rank stays alive that long after raising
    (its peers must not rely on its process exiting)."""
    layers = list(model(depth=6))
    bad = {"raise": Boom, "die": Die, "hang": Hang}[kind]()
    per = len(layers) // dist.get_world_size()
    layers.insert(failing_rank * per + 1, bad)
    balance = [per] * dist.get_world_size()
    balance[failing_rank] += 1
    balance[-1] += len(layers) - sum(balance)
    pipe = DistributedPipe(nn.Sequential(*layers), chunks=4, schedule="1f1b", balance=balance,
                           timeout=timeout)
    x, y = data(7)  # micro-batches of 2, 2, 2, 1: the last one fails
    start = time.monotonic()
    try:
        pipe.train_step(x, y, nn.functional.mse_loss)
    except Exception as error:  # noqa: BLE001 - reported to the test
        seconds = time.monotonic() - start
        if dist.get_rank() == failing_rank:
            time.sleep(linger)
        return {"error": type(error).__name__, "message": str(error)[:600], "seconds": seconds,
                "notes": list(getattr(error, "__notes__", []))}
    return {"error": None, "seconds": time.monotonic() - start}


class _DieInBackward(torch.autograd.Function):
    """Identity whose backward kills the process on the micro-batch of one sample."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        if grad.shape[0] == 1:
            os._exit(19)
        return grad


class DieInBackward(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _DieInBackward.apply(x)


def blame(kind: str, failing_rank: int, schedule: str = "1f1b", timeout: float = 3.0) -> Dict:
    """A rank never builds its pipe (``never``: it stalls past the others' timeout first;
    ``never_exit``: it exits at once), or dies in the backward of the step's last micro-batch
    (``die_in_backward``, after its peers have run all their actions): every surviving rank must
    fail in that step, naming it, with its parameters and optimizer untouched."""
    rank = dist.get_rank()
    if rank == failing_rank and kind == "never":
        time.sleep(timeout + 6.0)
        return {"error": None, "built": False}
    if rank == failing_rank and kind == "never_exit":
        os._exit(23)
    layers = list(model(depth=6))
    per = len(layers) // dist.get_world_size()
    dying = kind == "die_in_backward" and rank == failing_rank
    layers.insert(failing_rank * per + 1, DieInBackward() if dying else nn.Identity())
    balance = [per] * dist.get_world_size()
    balance[failing_rank] += 1
    balance[-1] += len(layers) - sum(balance)
    pipe = DistributedPipe(nn.Sequential(*layers), chunks=4, schedule=schedule, balance=balance,
                           timeout=timeout)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    before = [p.detach().clone() for p in pipe.parameters()]
    x, y = data(7)  # micro-batches of 2, 2, 2, 1: the last one's backward is the rank's last
    start = time.monotonic()
    try:
        loss = pipe.train_step(x, y, nn.functional.mse_loss, optimizer=optimizer)
    except Exception as error:  # noqa: BLE001 - reported to the test
        return {"error": type(error).__name__, "message": str(error)[:1500],
                "seconds": time.monotonic() - start,
                "untouched": all(torch.equal(a, p) for a, p in zip(before, pipe.parameters()))}
    return {"error": None, "loss": float(loss)}


def traced_gpt2(schedules: List[List[Any]]) -> Dict:
    """A Hugging Face GPT-2, untouched, across ranks (split_points='auto'): loss and every local
    gradient (the tied embedding's included) equal the plain model's, under its own names."""
    import transformers
    transformers.utils.logging.set_verbosity_error()
    config = transformers.GPT2Config(n_layer=4, n_embd=16, n_head=2, vocab_size=50,
                                     n_positions=16, use_cache=False, bos_token_id=0,
                                     eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 50, (7, 8), generator=generator)
    inputs = {"input_ids": ids, "attention_mask": torch.ones(7, 8, dtype=torch.long)}

    def build() -> nn.Module:
        torch.manual_seed(0)
        return transformers.GPT2LMHeadModel(config)

    def lm_loss(out: Any, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out.logits.flatten(0, 1), y.flatten())

    plain = build()
    ref_loss = lm_loss(plain(**inputs), ids)
    ref_loss.backward()
    expected = {n: p.grad for n, p in plain.named_parameters()}
    names = []
    for name, v, mode in schedules:
        pipe = DistributedPipe(build(), chunks=4 if v == 1 else 2, schedule=name,
                               virtual_stages=v, checkpoint=mode, split_points="auto",
                               example_inputs=inputs, timeout=60)
        loss = pipe.train_step(inputs, ids, lm_loss)
        torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
        for n, p in pipe.named_parameters():
            torch.testing.assert_close(p.grad, expected[n], **TOL, msg=lambda m: f"{n}: {m}")
        pipe.load_state_dict(plain.state_dict())  # a plain checkpoint loads as it is
        names = sorted(n for n, _ in pipe.named_parameters())
    with torch.device("meta"):  # a large model: each rank gives memory to its stage only
        meta = transformers.GPT2LMHeadModel(config)
    pipe = DistributedPipe(meta, chunks=4, split_points="auto", example_inputs=inputs,
                           init_weights=meta._init_weights, timeout=60)
    pipe.load_state_dict(plain.state_dict())
    loss = pipe.train_step(inputs, ids, lm_loss)
    torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
    for n, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, expected[n], **TOL, msg=lambda m: f"meta {n}: {m}")
    still_meta = sum(p.is_meta for p in meta.parameters())
    return {"names": names, "meta_left": still_meta}


def dcp_round_trip(path: str) -> Dict:
    """torch.distributed.checkpoint: a DistributedPipe's state (its own names, this rank's
    share) saved at one layout loads at another, and into the plain model in one process."""
    import torch.distributed.checkpoint as dcp
    torch.manual_seed(1)
    plain = model()
    pipe = DistributedPipe(model(), chunks=2, timeout=30)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.5)
    pipe.train_step(*data(6), nn.functional.mse_loss, optimizer=optimizer)  # weights moved
    dcp.save(pipe.state_dict(), checkpoint_id=path)
    other = DistributedPipe(model(), chunks=2, schedule="interleaved", virtual_stages=2,
                            timeout=30)
    state = other.state_dict()
    dcp.load(state, checkpoint_id=path)
    other.load_state_dict(state)
    dist.barrier()
    whole = plain.state_dict()
    dcp.load(whole, checkpoint_id=path, no_dist=True)  # the plain model, in this process alone
    plain.load_state_dict(whole)
    mine = dict(pipe.named_parameters())
    for name, p in other.named_parameters():
        if name in mine:
            torch.testing.assert_close(p, mine[name], rtol=0, atol=0)
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(plain.get_parameter(name), p, rtol=0, atol=0)
    return {"loaded": sorted(n for n, _ in other.named_parameters())}


def bad_targets() -> Dict:
    """Targets with a batch size other than the inputs' fail on the last rank before any
    backward, and the first rank stops too."""
    pipe = DistributedPipe(model(), chunks=2, timeout=20)
    x, y = data(8)
    if dist.get_rank() == dist.get_world_size() - 1:
        y = y[:6]
    start = time.monotonic()
    try:
        pipe.train_step(x, y, nn.functional.mse_loss)
    except Exception as error:  # noqa: BLE001
        return {"error": type(error).__name__, "message": str(error)[:600],
                "seconds": time.monotonic() - start,
                "grads": [p.grad is not None for p in pipe.parameters()]}
    return {"error": None}


def checkpoint_across_layouts() -> Dict:
    """Train on one layout, gather every rank's state dict (plain names), resume on another
    layout and in the plain model: the next step's loss is the same everywhere."""
    pipe = DistributedPipe(model(), chunks=3, balance=[4, 4], timeout=30)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    for step in range(2):
        x, y = data(9, seed=step)
        opt.zero_grad()
        pipe.train_step(x, y, nn.functional.mse_loss, optimizer=opt)
    parts: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, {k: v.clone() for k, v in pipe.state_dict().items()})
    merged = {k: v for part in parts for k, v in part.items()}
    plain = model()
    plain.load_state_dict(merged)  # strict: the pieces make exactly the plain model's keys
    other = DistributedPipe(model(), chunks=2, balance=[2, 6], timeout=30)
    other.load_state_dict(merged)
    x, y = data(9, seed=99)
    expected = nn.functional.mse_loss(plain(x), y)
    for label, resumed in (("same layout", pipe), ("other layout", other)):
        loss = resumed.train_step(x, y, nn.functional.mse_loss)
        torch.testing.assert_close(loss, expected.detach(), **TOL,
                                   msg=lambda m: f"{label}: {m}")
    return {"keys": len(merged)}


def exact_steps(pipe: DistributedPipe, steps: int, batch: int, seen: Callable[[], Any]) -> List:
    """Run ``steps`` training steps, each checked against the plain model (loss and every
    local gradient); returns ``seen()`` after each step."""
    plain = model()
    out = []
    for step in range(steps):
        x, y = data(batch, seed=step)
        ref_loss, ref = reference_grads(plain, x, y)
        pipe.zero_grad(set_to_none=True)
        loss = pipe.train_step(x, y, nn.functional.mse_loss)
        torch.testing.assert_close(loss, ref_loss, **TOL)
        check_grads(pipe, ref, f"step {step} (seen: {seen()})")
        out.append(seen())
    return out


def auto_chunks(steps: int = 8) -> Dict:
    """chunks='auto': the first rank searches, every rank follows the count it announces, and
    every step is exact whatever its count."""
    pipe = DistributedPipe(model(), chunks="auto", schedule="1f1b", timeout=30)
    counts = exact_steps(pipe, steps, batch=16, seen=lambda: pipe.chunks)
    search = pipe.chunk_search
    return {"counts": counts, "chosen": None if search is None else search.chosen}


def auto_schedule(steps: int = 3) -> Dict:
    """schedule='auto': the first step runs 1F1B, traced; every rank ranks the same gathered
    timeline and keeps the same schedule; every step is exact."""
    pipe = DistributedPipe(model(), chunks=4, schedule="auto", timeout=30)
    names = exact_steps(pipe, steps, batch=8, seen=lambda: pipe.schedule)
    return {"names": names, "ranked": [r.name for r in pipe.auto_ranking]}


def traced(schedule: str = "1f1b", v: int = 1) -> Dict:
    """pipe.trace() gives every rank the whole pipeline's measured timeline."""
    pipe = DistributedPipe(model(), chunks=4, schedule=schedule, virtual_stages=v, timeout=30)
    x, y = data(8)
    with pipe.trace() as t:
        pipe.train_step(x, y, nn.functional.mse_loss)
    timeline = t.timeline
    per_stage = [sum(1 for e in timeline.events if e.stage == s)
                 for s in range(dist.get_world_size())]
    return {"per_stage": per_stage, "bubble": timeline.bubble_fraction,
            "makespan": timeline.makespan}


def doctored(path: str, wait: float = 0.2) -> Dict:
    """A traced step that waited ``wait`` seconds for its input, written by the first rank to
    ``path`` for ``python -m fastpipe doctor``; every rank's ``last_step``."""
    pipe = DistributedPipe(model(), chunks=4, schedule="1f1b", timeout=30)
    x, y = data(8)
    pipe.train_step(x, y, nn.functional.mse_loss)
    with pipe.trace() as t:
        time.sleep(wait)
        pipe.train_step(x, y, nn.functional.mse_loss)
    if dist.get_rank() == 0:
        t.write(path)
    stats = pipe.last_step
    return {"samples": stats.samples, "stages": stats.stages, "bubble": stats.bubble_fraction,
            "rate": stats.samples_per_second}


def pipedream(steps: int = 2, tensor: int = 1) -> Dict:
    """schedule='pipedream' across processes: each rank steps its stage per micro-batch with
    the weight version that micro-batch's forward used; the parameters after each call equal
    (gathered, with ``tensor`` > 1: pipeline 2 x tensor parallel) those of the one-process Pipe
    running the same schedule."""
    local = fastpipe.Pipe(model(), chunks=4, balance=[4, 4], devices=["cpu", "cpu"],
                          schedule="pipedream")
    local_opt = torch.optim.SGD(local.parameters(), lr=0.05, momentum=0.9)
    layout: Dict[str, Any] = {"timeout": 30} if tensor == 1 else {
        "mesh": init_mesh(pipeline=2, tensor=tensor, timeout=60),
        "tensor_parallel": tp_plan(8), "timeout": 60}
    pipe = DistributedPipe(model(), chunks=4, balance=[4, 4], schedule="pipedream", **layout)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        x, y = data(8, seed=step)
        expected = local.train_step(x, y, nn.functional.mse_loss, optimizer=local_opt)
        loss = pipe.train_step(x, y, nn.functional.mse_loss, optimizer=opt)
        torch.testing.assert_close(loss, expected, **TOL)
        after = dict(local.named_parameters())
        for name, p in pipe.named_parameters():
            torch.testing.assert_close(full(p.detach()), after[name].detach(), **TOL,
                                       msg=lambda m: f"pipedream step {step}, {name}: {m}")
    start = dict(model().named_parameters())
    return {"moved": all(not torch.equal(full(p.detach()), start[n].detach())
                         for n, p in pipe.named_parameters())}


def boundary_mismatch() -> Dict:
    """A stage whose input does not fit what the previous stage sends fails at the first step,
    on every rank, naming the rank, the stage, the action and the micro-batch."""
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(2 * WIDTH, 4))
    pipe = DistributedPipe(model, chunks=2, balance=[2, 1], timeout=20)
    x, y = data(4)
    try:
        pipe.train_step(x, y, nn.functional.mse_loss)
    except Exception as error:  # noqa: BLE001 - reported to the test
        return {"error": type(error).__name__, "message": str(error)[:400],
                "notes": list(getattr(error, "__notes__", []))}
    return {"error": None}


def meta_and_factories() -> Dict:
    """A model built on the meta device, or from layer factories, is materialised per rank;
    after loading the plain state dict the step is exact; state_dict uses plain names."""
    plain = model()
    x, y = data(9)
    ref_loss, ref = reference_grads(plain, x, y)
    with torch.device("meta"):
        on_meta = model()
    factories = [lambda i=i: model()[i] for i in range(8)]
    try:  # a device the process group cannot carry is refused before anything is built
        DistributedPipe(model(), chunks=2, device="cuda")
        raise AssertionError("device='cuda' was accepted on a gloo group")
    except fastpipe.errors.ProcessGroupError as error:
        assert "no backend for cuda tensors" in str(error), error
    out = {}
    for label, source in (("meta", on_meta), ("factories", factories)):
        pipe = DistributedPipe(source, chunks=3, balance=[4, 4], timeout=30)
        assert all(p.device.type == "cpu" for p in pipe.parameters()), label
        pipe.load_state_dict(plain.state_dict())
        keys = sorted(pipe.state_dict())
        loss = pipe.train_step(x, y, nn.functional.mse_loss)
        torch.testing.assert_close(loss, ref_loss, **TOL)
        check_grads(pipe, ref, label)
        out[label] = keys
    return out


def tied_model() -> nn.Sequential:
    """First and last layers share one weight, as an embedding and an LM head do."""
    plain = model()
    plain[-1] = nn.Linear(WIDTH, WIDTH)
    plain[-1].weight = plain[0][0].weight
    return plain


def tied_weights(schedule: str = "1f1b", steps: int = 3) -> Dict:
    """The tied weight's copies on the first and last rank get the summed gradient and stay
    equal over optimizer steps (taken by ``train_step(optimizer=...)``), as in the plain model."""
    plain = tied_model()
    opt_ref = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    torch.manual_seed(5)  # the pipe's copy starts different on purpose: the broadcast fixes it
    source = tied_model()
    with torch.no_grad():
        for p in source.parameters():
            p.copy_(dict(plain.named_parameters())[_name(source, p)])
        if dist.get_rank() == dist.get_world_size() - 1:
            source[0][0].weight.add_(1.0)  # the last rank's copy must be overwritten
    pipe = DistributedPipe(source, chunks=3, schedule=schedule, timeout=30)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        x, y = data(7, seed=step)
        y = torch.cat([y, y], 1)
        opt_ref.zero_grad(set_to_none=True)
        ref_loss = nn.functional.mse_loss(plain(x), y)
        ref_loss.backward()
        ref = {n: p.grad.clone() for n, p in plain.named_parameters(remove_duplicate=False)}
        opt.zero_grad(set_to_none=True)
        loss = pipe.train_step(x, y, nn.functional.mse_loss, optimizer=opt)
        torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
        check_grads(pipe, ref, f"tied step {step}")
        opt_ref.step()
    after = dict(plain.named_parameters(remove_duplicate=False))
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p, after[name], **TOL)
    return {"names": [n for n, _ in pipe.named_parameters()]}


def compat() -> Dict:
    """torchgpipe users' cases across processes: layers with names (an OrderedDict) and a
    weight tied across ranks; a batch smaller than chunks; a short batch an interleaved
    schedule cannot split into its count; zbv without virtual_stages."""
    from collections import OrderedDict
    names = {}
    for case, (schedule, v, batch) in enumerate([("1f1b", None, 3), ("interleaved", 2, 13),
                                                 ("zbv", None, 5)]):
        plain = model(depth=8)
        named = nn.Sequential(OrderedDict((f"layer{i}", layer) for i, layer in enumerate(plain)))
        named.layer7 = nn.Linear(WIDTH, WIDTH)
        named.layer7.weight = named.layer0[0].weight
        source = copy.deepcopy(named)  # keeps the tie
        x, y = data(batch, seed=case)
        y = torch.cat([y, y], 1)
        ref_loss, _ = reference_grads(named, x, y)
        ref = {n: p.grad.clone() for n, p in named.named_parameters(remove_duplicate=False)}
        pipe = DistributedPipe(source, chunks=8, schedule=schedule, virtual_stages=v, timeout=30)
        loss = pipe.train_step(x, y, nn.functional.mse_loss)
        torch.testing.assert_close(loss, ref_loss, **TOL)
        check_grads(pipe, ref, f"compat {schedule} batch={batch}")
        names[schedule] = [n for n, _ in pipe.named_parameters()]
    return {"names": names, "virtual": pipe.virtual_stages}


def _name(module: nn.Module, param: nn.Parameter) -> str:
    return next(n for n, p in module.named_parameters() if p is param)


def bn_model() -> nn.Sequential:
    torch.manual_seed(3)
    # One batch norm, on the second rank (a batch norm after another one sees inputs that
    # depend on per-micro-batch statistics, so its running statistics cannot match exactly).
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH),
                         nn.BatchNorm1d(WIDTH), nn.Tanh(), nn.Linear(WIDTH, 4))


def deferred_batch_norm(steps: int = 3) -> Dict:
    """Running statistics on every rank equal the plain model's after several steps."""
    plain = bn_model()
    pipe = DistributedPipe(bn_model(), chunks=3, balance=[3, 3], deferred_batch_norm=True,
                           timeout=30)
    for step in range(steps):
        x, y = data(11, seed=step)
        nn.functional.mse_loss(plain(x), y).backward()
        pipe.train_step(x, y, nn.functional.mse_loss)
    expected = dict(plain.named_buffers())
    names = []
    for name, buffer in pipe.named_buffers():
        torch.testing.assert_close(buffer, expected[name], **TOL,
                                   msg=lambda m: f"running statistic {name}: {m}")
        names.append(name)
    return {"buffers": names}


def evaluate() -> Dict:
    """pipe.evaluate(x): eval mode (running statistics, no dropout) without autograd on every
    rank, the output on the last stage's rank, the training mode restored afterwards."""
    plain = bn_model()
    pipe = DistributedPipe(bn_model(), chunks=3, balance=[3, 3], deferred_batch_norm=True,
                           timeout=30)
    x, y = data(11)
    pipe.train_step(x, y, nn.functional.mse_loss)  # moves the running statistics
    plain(x)  # the same update, from the whole batch
    out = pipe.evaluate(x)
    if out is not None:
        torch.testing.assert_close(out, plain.eval()(x).detach(), **TOL)
        assert not out.requires_grad
    return {"has_output": out is not None, "training": pipe.training}


class InfGrad(nn.Module):
    """Identity whose backward turns every gradient into inf while ``armed``."""

    armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _InfBackward.apply(x) if InfGrad.armed else x


class _InfBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * float("inf")


def grad_scaler() -> Dict:
    """A GradScaler through train_step(scaler=, optimizer=): a finite step equals the unscaled
    plain step; a step with an inf gradient on the last rank only is skipped on every rank and
    every rank halves its scale alike."""
    def with_inf() -> nn.Sequential:
        layers = list(model(depth=6))
        return nn.Sequential(*layers[:5], InfGrad(), *layers[5:])
    plain, source = with_inf(), with_inf()
    pipe = DistributedPipe(source, chunks=2, balance=[3, 4], timeout=30)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    opt_ref = torch.optim.SGD(plain.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    x, y = data(6)
    opt_ref.zero_grad()
    nn.functional.mse_loss(plain(x), y).backward()
    opt_ref.step()
    pipe.train_step(x, y, nn.functional.mse_loss, scaler=scaler, optimizer=opt)
    after = dict(plain.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p, after[name], **TOL)
    before = {n: p.detach().clone() for n, p in pipe.named_parameters()}
    InfGrad.armed = True
    opt.zero_grad()
    pipe.train_step(x, y, nn.functional.mse_loss, scaler=scaler, optimizer=opt)
    unchanged = all(torch.equal(p, before[n]) for n, p in pipe.named_parameters())
    return {"unchanged": unchanged, "scale": scaler.get_scale()}


def autocast_bf16() -> Dict:
    """bf16 autocast reaches every rank's stages: close to the plain model under autocast."""
    plain = model()
    x, y = data(8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_loss = nn.functional.mse_loss(plain(x).float(), y)
    pipe = DistributedPipe(model(), chunks=2, timeout=30)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = pipe.train_step(x, y, lambda out, t: nn.functional.mse_loss(out.float(), t))
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=2e-2, atol=2e-2)
    dtypes = sorted({str(p.grad.dtype) for p in pipe.parameters()})
    return {"loss": loss.item(), "ref": ref_loss.item(), "grad_dtypes": dtypes}


@fastpipe.skip.skippable(stash=["h"])
class StashH(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fastpipe.skip.stash("h", torch.tanh(x))
        return x


@fastpipe.skip.skippable(pop=["h"])
class AddH(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 2 * fastpipe.skip.pop("h")


@fastpipe.skip.skippable(stash=["e"])
class StashE(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fastpipe.skip.stash("e", x * 3)
        return x


@fastpipe.skip.skippable(pop=["e"])
class MulE(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * fastpipe.skip.pop("e").sigmoid()


def skip_model() -> nn.Sequential:
    """Skip "h" from the first layers to the last ones (across every rank in between), skip
    "e" from the middle to near the end."""
    torch.manual_seed(11)
    layers: List[nn.Module] = [nn.Linear(WIDTH, WIDTH), StashH()]
    for i in range(6):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
        if i == 2:
            layers.append(StashE())
    layers += [MulE(), AddH(), nn.Linear(WIDTH, 4)]
    return nn.Sequential(*layers)


def skip_connections(schedules: List[List[Any]]) -> Dict:
    """Skip tensors go straight from the producing rank to the consuming one, and their
    gradients back: loss and gradients equal the plain model's (where stash / pop act as a
    per-forward dictionary); the forward-only path too."""
    for name, v, mode in schedules:
        plain = skip_model()
        x, y = data(13)
        ref_loss, ref = reference_grads(plain, x, y)
        pipe = DistributedPipe(skip_model(), chunks=4, schedule=name, virtual_stages=v,
                               checkpoint=mode, timeout=30)
        loss = pipe.train_step(x, y, nn.functional.mse_loss)
        where = f"skips {name} v={v} {mode}"
        torch.testing.assert_close(loss, ref_loss, **TOL, msg=lambda m: f"{where}: loss {m}")
        check_grads(pipe, ref, where)
        out = pipe(x)
        if out is not None:
            torch.testing.assert_close(out, plain(x).detach(), **TOL)
    return {"ok": True}


def several(cases: List[List[Any]]) -> Dict:
    """Run several cases in the same processes (saves a start-up per case)."""
    return {name: CASES[name](**args) for name, args in cases}


def process_groups() -> Dict:
    """Process groups as users make them: a DeviceMesh dimension as the pipeline's group, a
    two-dimensional mesh refused, and ranks that disagree on the transport refused at step 1
    (before any message, instead of a hang)."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("pipeline",))
    x, y = data(6)
    plain = model()
    ref_loss, ref = reference_grads(plain, x, y)
    pipe = DistributedPipe(model(), chunks=3, process_group=mesh["pipeline"], timeout=30)
    loss = pipe.train_step(x, y, nn.functional.mse_loss)
    torch.testing.assert_close(loss, ref_loss, **TOL)
    check_grads(pipe, ref, "mesh dimension")
    out: Dict[str, Any] = {"mesh": pipe.p2p}
    two = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("data", "pipe"))
    try:
        DistributedPipe(model(), process_group=two)
        raise AssertionError("a 2-D mesh was accepted as process_group")
    except fastpipe.errors.ProcessGroupError as error:
        out["two_d"] = str(error)
    mixed = "grouped" if dist.get_rank() == 0 else "tagged"
    pipe = DistributedPipe(model(), chunks=3, timeout=30, p2p=mixed)
    before = [p.detach().clone() for p in pipe.parameters()]
    try:
        pipe.train_step(x, y, nn.functional.mse_loss)
        raise AssertionError("ranks on different transports ran a step")
    except (fastpipe.errors.ProcessGroupError, fastpipe.PipelineAborted) as error:
        out["mixed"] = [type(error).__name__, str(error)]
    out["untouched"] = all(torch.equal(a, b) and b.grad is None
                           for a, b in zip(before, pipe.parameters()))
    return out


CASES = {f.__name__: f for f in (process_groups, randomized, transparency, data_parallel, variable_shapes, failure, blame,
                                 loss_checks, detached_loss, traced_gpt2, token_mean,
                                 dcp_round_trip,
                                 bad_targets, boundary_mismatch, checkpoint_across_layouts,
                                 auto_chunks, auto_schedule, traced, doctored, pipedream,
                                 meta_and_factories, tied_weights,
                                 deferred_batch_norm, grad_scaler, autocast_bf16,
                                 skip_connections, compat, evaluate, several)}



# ------------------------------------------------------------- 3-D parallelism (fastpipe.parallel)
def tp_plan(depth: int) -> Dict[str, Any]:
    """Column- then row-parallel pairs of the test model's linears (the activation between a
    pair is sharded across the tensor-parallel group, after it replicated), and the last layer
    column-parallel with a replicated output."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    plan: Dict[str, Any] = {}
    for i in range(0, depth - 2, 2):
        plan[f"{i}.0"], plan[f"{i + 1}.0"] = ColwiseParallel(), RowwiseParallel()
    plan[str(depth - 1)] = ColwiseParallel(output_layouts=Replicate())
    return plan


def full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (a collective over its mesh), a tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def check_full_grads(pipe: nn.Module, expected: Dict[str, torch.Tensor], where: str) -> float:
    """check_grads for sharded (DTensor) parameters: every rank of a shard's group gathers."""
    worst = 0.0
    for name, p in pipe.named_parameters():
        assert p.grad is not None, f"{where}: {name} has no gradient"
        grad = full(p.grad)
        torch.testing.assert_close(grad, expected[name], **TOL,
                                   msg=lambda m: f"{where}: gradient of {name}: {m}")
        worst = max(worst, (grad - expected[name]).abs().max().item())
    return worst


def mlp_kind(depth: int, tensor: int) -> tuple:
    """The test model, its plan, and the width of its output."""
    return model(depth), (tp_plan(depth) if tensor > 1 else None), 4


def skip_kind(depth: int, tensor: int) -> tuple:
    """skip_model (skips across ranks) with two column/row-parallel pairs."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    plan = {"2": ColwiseParallel(), "4": RowwiseParallel(), "9": ColwiseParallel(),
            "11": RowwiseParallel()}
    return skip_model(), (plan if tensor > 1 else None), 4


def tied_kind(depth: int, tensor: int) -> tuple:
    """tied_model (first and last layer share a weight, on different ranks); the tied layers
    stay replicated across the tensor-parallel group, the others are split."""
    plan = tp_plan(depth)
    del plan["0.0"], plan["1.0"], plan[str(depth - 1)]
    return tied_model(), (plan if tensor > 1 else None), 2 * 4


batch_of = data  # three_d's argument ``data`` (the mesh's data size) hides data()

KINDS = {"mlp": mlp_kind, "skip": skip_kind, "tied": tied_kind}


def count_fsdp_reductions() -> List[int]:
    """Count FSDP2's gradient reductions (one per FSDP unit per reduction) from now on."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group_module
    calls = [0]
    original = group_module.foreach_reduce

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return original(*args, **kwargs)
    group_module.foreach_reduce = counted
    return calls


def three_d(pipeline: int, schedules: List[List[Any]], data: int = 1, tensor: int = 1,
            shard: int = 1, data_parallel: str = "replicate", per_replica: int = 7,
            chunks: int = 3, steps: int = 2, balance: Any = None, kind: str = "mlp",
            keep_gathered: bool = True) -> Dict:
    """Pipeline x data x shard x tensor on one mesh: for every (schedule, virtual_stages,
    checkpoint), ``steps`` optimizer steps whose loss and (gathered) gradients equal the plain
    model's on the global batch (each replica reads its slice; uneven micro-batches), and
    parameters that stay equal to the plain model's after each SGD step. With FSDP, the
    number of gradient reductions per step (one per FSDP unit when they are deferred)."""
    mesh = init_mesh(pipeline=pipeline, data=data, tensor=tensor, shard=shard, timeout=60)
    replicas, replica = mesh.replicas, mesh.replica
    reductions = count_fsdp_reductions() if data_parallel == "fsdp" else [0]
    worst, shapes, per_step, boundaries = 0.0, {}, {}, {}
    for name, v, mode in schedules:
        depth = max(8, 2 * pipeline * v)
        plain, _, width = KINDS[kind](depth, tensor)
        opt_ref = torch.optim.SGD(plain.parameters(), lr=0.1)
        source, plan, _ = KINDS[kind](depth, tensor)
        pipe = DistributedPipe(source, chunks=chunks, schedule=name, virtual_stages=v,
                               checkpoint=mode, balance=balance, mesh=mesh, tensor_parallel=plan,
                               data_parallel=data_parallel, timeout=60)
        if not keep_gathered:  # FSDP2's own policy: reshard and reduce every micro-batch
            pipe.parallel.sharded_stages.set_keep_gathered(False)
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        last = len(pipe.balance) - 1
        units = sum(1 for m in pipe.module.modules() if type(m).__name__.startswith("FSDP"))
        counts = []
        for step in range(steps):
            x, y = batch_of(replicas * per_replica, seed=step)
            y = y.repeat(1, width // 4)
            plain.zero_grad(set_to_none=True)
            ref_loss = nn.functional.mse_loss(plain(x), y)
            ref_loss.backward()
            ref = {n: p.grad.clone() for n, p in plain.named_parameters(remove_duplicate=False)}
            mine = slice(replica * per_replica, (replica + 1) * per_replica)
            opt.zero_grad(set_to_none=True)
            before = reductions[0]
            loss = pipe.train_step(x[mine] if 0 in pipe.stages else None,
                                   y[mine] if last in pipe.stages else None,
                                   nn.functional.mse_loss)
            counts.append(reductions[0] - before)
            where = f"{kind} {name} v={v} {mode} step {step}"
            torch.testing.assert_close(loss, ref_loss.detach(), **TOL,
                                       msg=lambda m: f"{where}: loss {m}")
            worst = max(worst, check_full_grads(pipe, ref, where))
            opt.step()
            opt_ref.step()
            after = dict(plain.named_parameters(remove_duplicate=False))
            for n, p in pipe.named_parameters():
                torch.testing.assert_close(full(p.detach()), after[n].detach(), **TOL,
                                           msg=lambda m: f"{where}: parameter {n}: {m}")
        out = pipe(x[mine])  # forward only: the last stage's output, replicated over TP
        if out is not None:
            torch.testing.assert_close(out, plain(x[mine]).detach(), **TOL)
        shapes[name] = sorted({str(tuple(getattr(p, "to_local", lambda: p)().shape))
                               for p in pipe.parameters()})
        per_step[name] = {"reductions": counts, "units": units}
        boundaries[name] = {str(k): b for k, b in pipe.parallel.report().items()}
    return {"worst": worst, "coordinates": mesh.coordinates, "local_shapes": shapes,
            "fsdp": per_step, "boundaries": boundaries}


def three_d_checkpoint(path: str) -> Dict:
    """torch.distributed.checkpoint across 3-D layouts (4 ranks): trained at pipeline 2 x
    tensor 2, saved (DTensor shards under plain names), loaded at pipeline 2 x FSDP 2, at
    pipeline 4 without a mesh and into the plain model; saved again from the FSDP layout and
    loaded back into a tensor-parallel one. A plain-model state dict loads into sharded
    parameters too (load_state_dict). Every loaded layout's next step equals the plain model's."""
    import torch.distributed.checkpoint as dcp
    depth = 8
    mesh_tp = init_mesh(pipeline=2, tensor=2, timeout=60)
    mesh_fsdp = init_mesh(pipeline=2, shard=2, timeout=60)
    trained = DistributedPipe(model(depth), chunks=2, mesh=mesh_tp,
                              tensor_parallel=tp_plan(depth), timeout=60)
    opt = torch.optim.SGD(trained.parameters(), lr=0.5)
    trained.train_step(*data(6), nn.functional.mse_loss, optimizer=opt)  # weights moved
    dcp.save(trained.state_dict(), checkpoint_id=f"{path}/tp")
    plain = model(depth)
    whole = plain.state_dict()
    dcp.load(whole, checkpoint_id=f"{path}/tp", no_dist=True)  # the plain model, alone
    plain.load_state_dict(whole)
    moved = not torch.equal(plain[0][0].weight, model(depth)[0][0].weight)
    x, y = data(6, seed=9)
    expected = nn.functional.mse_loss(plain(x), y).detach()
    sharded = DistributedPipe(model(depth), chunks=3, mesh=mesh_fsdp, data_parallel="fsdp",
                              timeout=60)
    state = sharded.state_dict()
    dcp.load(state, checkpoint_id=f"{path}/tp")
    sharded.load_state_dict(state)
    flat = DistributedPipe(model(depth), chunks=2, schedule="gpipe", balance=[2, 2, 2, 2],
                           timeout=60)
    state = flat.state_dict()
    dcp.load(state, checkpoint_id=f"{path}/tp")
    flat.load_state_dict(state)
    for n, p in flat.named_parameters():
        torch.testing.assert_close(p, plain.get_parameter(n), rtol=0, atol=0)
    for n, p in sharded.named_parameters():
        torch.testing.assert_close(full(p.detach()), plain.get_parameter(n), rtol=0, atol=0)
    dcp.save(sharded.state_dict(), checkpoint_id=f"{path}/fsdp")
    again = DistributedPipe(model(depth), chunks=2, mesh=mesh_tp, tensor_parallel=tp_plan(depth),
                            timeout=60)
    state = again.state_dict()
    dcp.load(state, checkpoint_id=f"{path}/fsdp")
    again.load_state_dict(state)
    from_plain = DistributedPipe(model(depth), chunks=2, mesh=mesh_fsdp, data_parallel="fsdp",
                                 timeout=60)
    from_plain.load_state_dict(plain.state_dict())  # full tensors cut into this rank's shards
    losses = {}
    for label, pipe, replicas in (("fsdp", sharded, 2), ("flat", flat, 1), ("tp", again, 1),
                                  ("plain into fsdp", from_plain, 2)):
        r = pipe.mesh.replica if pipe.mesh is not None else 0
        part = slice(r * 6 // replicas, (r + 1) * 6 // replicas)
        loss = pipe.train_step(x[part], y[part], nn.functional.mse_loss)
        torch.testing.assert_close(loss, expected, **TOL, msg=lambda m: f"{label}: {m}")
        losses[label] = loss.item()
    return {"moved": moved, "losses": losses, "expected": expected.item(),
            "keys": sorted(trained.state_dict())}


def three_d_errors() -> Dict:
    """Bad 3-D arguments (4 ranks): each raises a typed error naming the argument and the fix,
    before any work, with the model untouched (same parameter objects and values)."""
    from torch.distributed.tensor.parallel import ColwiseParallel
    mesh = init_mesh(pipeline=2, tensor=2, timeout=60)
    fsdp_mesh = init_mesh(pipeline=2, shard=2, timeout=60)
    pp, _ = init_mesh(pipeline=4)  # the two-group form still unpacks
    narrow = nn.Sequential(nn.Linear(WIDTH, 6), nn.Tanh(), nn.Linear(6, 4), nn.Tanh())
    cases = {
        "mesh_size": (lambda m: init_mesh(pipeline=3), None),
        "not_a_mesh": (lambda m: DistributedPipe(m, mesh=mesh.device_mesh,
                                                 tensor_parallel=tp_plan(8)), model()),
        "missing_submodule": (lambda m: DistributedPipe(
            m, mesh=mesh, tensor_parallel={"0.0": ColwiseParallel(), "9.0": ColwiseParallel()}),
            model()),
        "width": (lambda m: DistributedPipe(
            m, mesh=init_mesh(pipeline=1, tensor=4), tensor_parallel={"0": ColwiseParallel()}),
            narrow),
        "pipedream_fsdp": (lambda m: DistributedPipe(m, schedule="pipedream", mesh=fsdp_mesh,
                                                     data_parallel="fsdp"), model()),
        "mesh_and_group": (lambda m: DistributedPipe(m, mesh=mesh, process_group=pp,
                                                     tensor_parallel=tp_plan(8)), model()),
        "no_plan": (lambda m: DistributedPipe(m, mesh=mesh), model()),
        "shard_without_fsdp": (lambda m: DistributedPipe(m, mesh=fsdp_mesh), model()),
        "fsdp_tied": (lambda m: DistributedPipe(m, mesh=fsdp_mesh, data_parallel="fsdp"),
                      tied_model()),
        "tp_tied": (lambda m: DistributedPipe(m, mesh=mesh, tensor_parallel=tp_plan(8)),
                    tied_model()),
        "plan_without_mesh": (lambda m: DistributedPipe(m, tensor_parallel=tp_plan(8)),
                              model()),
        "bad_mode": (lambda m: DistributedPipe(m, mesh=fsdp_mesh, data_parallel="zero3"),
                     model()),
    }
    out = {}
    for label, (build, source) in cases.items():
        before = ([(p, p.detach().clone()) for p in source.parameters()]
                  if source is not None else [])
        try:
            build(source)
            out[label] = {"error": None}
            continue
        except Exception as error:  # noqa: BLE001 - reported to the test
            out[label] = {"error": type(error).__name__, "message": str(error)}
        if source is not None:
            now = list(source.parameters())
            out[label]["untouched"] = len(now) == len(before) and all(
                p is q and type(p) is nn.Parameter and torch.equal(p, v)
                for p, (q, v) in zip(now, before))
    return out


def three_d_pipedream(steps: int = 2) -> Dict:
    """schedule='pipedream' on pipeline 2 x tensor 2 (see ``pipedream``)."""
    return pipedream(steps, tensor=2)


def three_d_token_mean(tensor: int = 1, shard: int = 1) -> Dict:
    """(loss_sum, count) losses on a mesh: counts differ between the batch slices; the loss
    and the gathered gradients are the plain model's mean over every counted position."""
    mesh = init_mesh(pipeline=2, tensor=tensor, shard=shard, timeout=60)
    plain = model()
    x, targets = padded(12)
    ref_loss = token_mean_of(plain, x, targets)
    ref_loss.backward()
    pipe = DistributedPipe(model(), chunks=3, mesh=mesh,
                           tensor_parallel=tp_plan(8) if tensor > 1 else None,
                           data_parallel="fsdp" if shard > 1 else "replicate", timeout=60)
    part = 12 // mesh.replicas
    mine = slice(mesh.replica * part, (mesh.replica + 1) * part)
    loss = pipe.train_step(x[mine], (targets[0][mine], targets[1][mine]), token_loss)
    torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
    check_full_grads(pipe, {n: p.grad for n, p in plain.named_parameters()}, "token mean")
    return {"ok": True}


def three_d_runs(runs: List[Dict[str, Any]]) -> Dict:
    """Several three_d runs in the same processes, each result kept (in order)."""
    return {"runs": [three_d(**args) for args in runs]}


CASES.update({f.__name__: f for f in (three_d, three_d_runs, three_d_checkpoint,
                                      three_d_errors, three_d_pipedream, three_d_token_mean)})

def main(cases: Dict[str, Callable[..., Dict]] = CASES) -> None:
    """Run the case named on the command line (from ``cases``) on this rank."""
    case, args = sys.argv[1], json.loads(sys.argv[2])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world + 1,
                          is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    torch.set_num_threads(1)
    result = cases[case](**args)
    print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
