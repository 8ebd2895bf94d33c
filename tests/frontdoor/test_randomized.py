"""Randomized transparency: seeded random layouts, schedules, checkpoint modes and uneven batches,
each trained for a few steps and compared with the plain model (loss and every gradient). Some
models are traced (a module with a block list, ``split_points='auto'``) and some losses come as
``(loss_sum, count)`` over masked targets, compared with the plain model's mean over the mask.

The configurations are drawn once from a fixed seed, so a failure names a reproducible case. A
wrong gradient that depends on the memory layout (a saved tensor mistaken for another) shows up
here as well as a wrong schedule does: steps repeat with fresh batches of changing sizes. Some
configurations clip by the global norm (``max_grad_norm``, against torch's clip on the plain
model), accumulate gradients over the steps without zeroing, or take AdamW steps and resume
from a ``fastpipe.checkpoint`` into a new pipe after the first step; some end with
``evaluate()`` against the plain model in eval mode.
"""
import copy
import random
from dataclasses import dataclass
from typing import List, Optional

import pytest
import torch
from torch import nn

import fastpipe
from fastpipe.microbatch import split_sizes
from fastpipe.schedule import ScheduleError
from helpers import assert_same_grads, grads_of

SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved": 2, "looped-bfs": 2, "zb-h1": 1, "zbv": 2,
             "dualpipev": 2}
MODES = ["never", "except_last", "always", "selective", "offload"]
BLOCKS = ["linear-norm-tanh", "linear-relu", "linear-dropout-gelu"]


@dataclass
class Config:
    schedule: str
    virtual: int
    checkpoint: str
    stages: int
    blocks: List[str]
    width: int
    chunks: int
    batches: List[int]
    dtype: torch.dtype
    seed: int
    traced: bool = False  # the model as a module with a block list, traced (split_points)
    token: bool = False  # loss_fn returns (loss_sum, count) over masked targets
    clip: Optional[float] = None  # train_step(max_grad_norm=...)
    accumulate: bool = False  # gradients accumulate over the steps (no zero_grad)
    resume: bool = False  # AdamW steps; saved after the first, resumed into a new pipe
    evaluate: bool = False  # pipe.evaluate(x) after the steps, against the plain model in eval

    def __str__(self) -> str:
        return (f"{self.schedule}-v{self.virtual}-{self.checkpoint}-p{self.stages}-"
                f"m{self.chunks}-b{'.'.join(map(str, self.batches))}-"
                f"{str(self.dtype)[6:]}{'-traced' if self.traced else ''}"
                f"{'-token' if self.token else ''}"
                f"{f'-clip{self.clip:g}' if self.clip is not None else ''}"
                f"{'-accumulate' if self.accumulate else ''}"
                f"{'-resume' if self.resume else ''}"
                f"{'-evaluate' if self.evaluate else ''}-{self.seed}")


def _draw(rng: random.Random, seed: int) -> Config:
    schedule = rng.choice(sorted(SCHEDULES))
    virtual = SCHEDULES[schedule]
    stages = rng.randint(1, 3) if virtual == 1 else rng.randint(1, 2)
    chunks = rng.choice([1, 2, 3, 4, 5, 8]) if schedule in ("gpipe", "1f1b", "zb-h1") \
        else stages * rng.randint(1, 3)
    config = Config(schedule, virtual, rng.choice(MODES), stages,
                    [rng.choice(BLOCKS) for _ in range(stages * virtual + rng.randint(0, 2))],
                    rng.choice([4, 5, 8]), chunks,
                    [_batch(rng, chunks, stages, virtual) for _ in range(3)],
                    rng.choice([torch.float32, torch.float64]), seed)
    config.traced = rng.random() < 0.25  # tracing costs about a second: a quarter of them
    config.token = rng.random() < 0.5
    config.clip = rng.choice([None, 0.05, 10.0])
    config.resume = rng.random() < 0.3
    config.accumulate = not config.resume and rng.random() < 0.5  # a resume starts with none
    config.evaluate = rng.random() < 0.5
    return config


def _batch(rng: random.Random, chunks: int, stages: int, virtual: int) -> int:
    """An uneven batch whose split (torch.chunk semantics) the schedule can run: interleaved
    and V-shaped schedules need a micro-batch count that is a multiple of the stage count."""
    while True:
        batch = chunks + rng.randint(0, 2 * chunks)
        count = len(split_sizes(batch, chunks))
        if virtual == 1 or count % stages == 0:
            return batch


CONFIGS = [_draw(random.Random(1000 + i), 1000 + i) for i in range(36)]


def _block(kind: str, width: int) -> List[nn.Module]:
    if kind == "linear-norm-tanh":
        return [nn.Linear(width, width), nn.LayerNorm(width), nn.Tanh()]
    if kind == "linear-relu":
        return [nn.Linear(width, width), nn.ReLU()]
    return [nn.Linear(width, width), nn.Dropout(0.2), nn.GELU()]


class Blocks(nn.Module):
    """The same layers as a module with a list of blocks and a head (not a Sequential)."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(*_block(kind, config.width))
                                    for kind in config.blocks)
        self.head = nn.Linear(config.width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _model(config: Config) -> nn.Module:
    torch.manual_seed(config.seed)
    if config.traced:
        return Blocks(config).to(config.dtype)
    layers = [layer for kind in config.blocks for layer in _block(kind, config.width)]
    return nn.Sequential(*layers, nn.Linear(config.width, 3)).to(config.dtype)


def token_sum(output: torch.Tensor, targets: tuple) -> tuple:
    """A masked squared error: its sum over the counted elements, and how many there are."""
    y, mask = targets
    return ((output - y) ** 2 * mask).sum(), mask.sum()


def token_mean(output: torch.Tensor, targets: tuple) -> torch.Tensor:
    total, count = token_sum(output, targets)
    return total / count


def _pipe(config: Config, model: nn.Module, example: torch.Tensor) -> fastpipe.Pipe:
    return fastpipe.Pipe(model, chunks=config.chunks, devices=["cpu"] * config.stages,
                         schedule=config.schedule, virtual_stages=config.virtual,
                         checkpoint=config.checkpoint,
                         split_points="auto" if config.traced else None,
                         example_inputs=example if config.traced else None)


def _resumed(config: Config, pipe: fastpipe.Pipe, optimizer: torch.optim.Optimizer,
             example: torch.Tensor, directory: str) -> tuple:
    """A new pipe (of a model initialised otherwise) and optimizer, loaded from a checkpoint
    of ``pipe`` and ``optimizer``."""
    fastpipe.checkpoint.save(directory, pipe, optimizer)
    torch.manual_seed(config.seed + 1)
    model = _model(config)
    if config.traced:
        model = model.to(config.dtype)
    other = _pipe(config, model, example)
    other_optimizer = torch.optim.AdamW(other.parameters(), lr=1e-2)
    fastpipe.checkpoint.load(directory, other, other_optimizer)
    return model, other, other_optimizer


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_random_configuration_matches_the_plain_model(config, tmp_path):
    model = _model(config)
    plain = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(config.seed)
    example = torch.randn(config.batches[0], config.width, dtype=config.dtype)
    try:
        pipe = _pipe(config, model, example)
    except (ValueError, ScheduleError) as error:  # a layout this schedule cannot run
        pytest.skip(f"layout refused as expected by the schedule: {error}")
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2) if config.resume else None
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2) if config.resume else None
    dropout = "linear-dropout-gelu" in config.blocks
    tolerance = dict(rtol=1e-5, atol=1e-6) if config.dtype == torch.float32 else \
        dict(rtol=1e-10, atol=1e-12)
    for step, batch in enumerate(config.batches):
        x = torch.randn(batch, config.width, generator=generator, dtype=config.dtype)
        y = torch.randn(batch, 3, generator=generator, dtype=config.dtype)
        mask = (torch.rand(batch, 3, generator=generator) < 0.6).to(config.dtype)
        mask[0, 0] = 1.0  # at least one counted element
        if config.resume and step == 1:
            model, pipe, optimizer = _resumed(config, pipe, optimizer, example,
                                              str(tmp_path / "checkpoint"))
        if dropout:  # the plain model cannot replay per-micro-batch dropout: compare in eval
            pipe.eval(), plain.eval()
        if not config.accumulate:
            pipe.zero_grad(set_to_none=True)
            plain.zero_grad(set_to_none=True)
        targets, loss_fn, plain_loss = ((y, mask), token_sum, token_mean) if config.token \
            else (y, nn.MSELoss(), nn.MSELoss())
        expected_loss = plain_loss(plain(x), targets)
        expected_loss.backward()
        if config.clip is not None:
            expected_norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), config.clip)
        loss = pipe.train_step(x, targets, loss_fn, max_grad_norm=config.clip,
                               optimizer=optimizer)
        assert loss.dtype == config.dtype
        torch.testing.assert_close(loss, expected_loss.detach(), **tolerance)
        if config.clip is not None:
            assert pipe.last_step.grad_norm == pytest.approx(float(expected_norm), rel=1e-6)
        assert_same_grads(grads_of(model), grads_of(plain), **tolerance)
        if plain_optimizer is not None:
            plain_optimizer.step()
            for (name, p), q in zip(pipe.named_parameters(), plain.parameters()):
                torch.testing.assert_close(p, q, **tolerance, msg=lambda m: f"{name}: {m}")
    if config.evaluate:  # eval mode on every stage, whatever mode the steps ran in
        pipe.train(), plain.train()
        output = pipe.evaluate(x)
        assert pipe.training
        with torch.no_grad():
            torch.testing.assert_close(output, plain.eval()(x), **tolerance)
