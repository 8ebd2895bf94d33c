"""What every rank's distributed cases share (the cases live in ``dist_*_cases`` modules).

The test models (plain, with tied weights, with skips across ranks) and their data, the
in-process references the cases compare against (gradients, gathered gradients of sharded
parameters, token means), the tensor-parallel plan of the test model, ``DistributedPipe`` on
the transport the launch chose, and ``main``, which runs one case on this rank.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Any, Callable, Dict, List

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fastpipe  # noqa: E402
from fastpipe.distributed import DistributedPipe as _DistributedPipe  # noqa: E402

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


def tied_model() -> nn.Sequential:
    """First and last layers share one weight, as an embedding and an LM head do."""
    plain = model()
    plain[-1] = nn.Linear(WIDTH, WIDTH)
    plain[-1].weight = plain[0][0].weight
    return plain


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


def main(cases: Dict[str, Callable[..., Dict]]) -> None:
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
