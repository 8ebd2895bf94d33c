"""Distributed cases: models and training features beyond a plain stack of layers.

A traced Hugging Face GPT-2 (meta-device too), weights tied across ranks, torchgpipe-style
models, skip connections across ranks, deferred batch norm, evaluation, a GradScaler and bf16
autocast, each against the plain model.
"""
from __future__ import annotations

import copy
from typing import Any, Dict, List

import torch
import torch.distributed as dist
from dist_common import (TOL, WIDTH, DistributedPipe, check_grads, data, model,
                         reference_grads, skip_model, tied_model)
from torch import nn


def tiny_gpt2() -> tuple:
    """A four-layer GPT-2 configuration without dropout, and a batch of seven sequences of
    eight tokens: (config, inputs, token ids)."""
    import transformers
    transformers.utils.logging.set_verbosity_error()
    config = transformers.GPT2Config(n_layer=4, n_embd=16, n_head=2, vocab_size=50,
                                     n_positions=16, use_cache=False, bos_token_id=0,
                                     eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 50, (7, 8), generator=generator)
    inputs = {"input_ids": ids, "attention_mask": torch.ones(7, 8, dtype=torch.long)}
    return config, inputs, ids


def traced_gpt2(schedules: List[List[Any]]) -> Dict:
    """A Hugging Face GPT-2, untouched, across ranks (split_points='auto'): loss and every local
    gradient (the tied embedding's included) equal the plain model's, under its own names."""
    import transformers
    config, inputs, ids = tiny_gpt2()

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


def _name(module: nn.Module, param: nn.Parameter) -> str:
    return next(n for n, p in module.named_parameters() if p is param)


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
