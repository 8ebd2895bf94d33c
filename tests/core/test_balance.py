"""Tests for the partition solver and the layer profilers."""

import ast
import itertools
import math
import random
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from torch import nn

from fastpipe.balance import by_size, by_time, profile_sizes, profile_times, solve

# -- solve: known answers ------------------------------------------------------------------


@pytest.mark.parametrize(
    "costs, partitions, expected",
    [
        ([1, 1, 1, 1], 2, [2, 2]),
        ([5, 1, 1, 1, 1, 1], 2, [1, 5]),
        ([1, 1, 1, 1, 1, 5], 2, [5, 1]),
        ([1, 2, 3, 4, 5], 1, [5]),
        ([1, 2, 3, 4, 5], 5, [1, 1, 1, 1, 1]),
        ([1, 2, 3, 4, 5], 2, [3, 2]),  # 6 | 9
        ([1, 2, 3, 4, 5], 3, [3, 1, 1]),  # 6 | 4 | 5
        ([7, 2, 5, 10, 8], 2, [3, 2]),  # 14 | 18
        ([1] * 9 + [10], 3, [4, 5, 1]),  # max 10; then most even split of the ones
        ([1, 1, 1], 2, [1, 2]),  # tie: earlier stage gets fewer layers
        ([0, 0, 0, 0], 3, [1, 1, 2]),
        ([3], 1, [1]),
        ([0.5, 0.25, 0.25], 2, [1, 2]),
        # exact arithmetic: float 0.1 + float 0.2 is a hair above float 0.3
        ([0.1, 0.2, 0.3], 2, [2, 1]),
    ],
)
def test_solve_known_answers(costs, partitions, expected):
    assert solve(costs, partitions) == expected


def test_solve_accepts_any_real_sequence():
    assert solve((2.0, 2, True, 1), 2) == [1, 3]
    assert solve(range(1, 5), 2) == [3, 1]


# -- solve: brute force comparison ----------------------------------------------------------


def brute_force(costs, partitions):
    """All compositions, ranked by (max group, sum of squares, balance) with exact sums."""
    n = len(costs)
    exact = [Fraction(c) for c in costs]
    best = None
    for cuts in itertools.combinations(range(1, n), partitions - 1):
        bounds = (0, *cuts, n)
        sums = [sum(exact[a:b]) for a, b in zip(bounds, bounds[1:])]
        balance = [b - a for a, b in zip(bounds, bounds[1:])]
        key = (max(sums), sum(s * s for s in sums), balance)
        best = key if best is None or key < best else best
    return best[2]


@pytest.mark.parametrize("seed", range(40))
def test_solve_matches_brute_force_on_floats(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    costs = [rng.uniform(0, 10) for _ in range(n)]
    partitions = rng.randint(1, n)
    assert solve(costs, partitions) == brute_force(costs, partitions)


@pytest.mark.parametrize("seed", range(40))
def test_solve_matches_brute_force_with_many_ties(seed):
    rng = random.Random(1000 + seed)
    n = rng.randint(1, 10)
    costs = [rng.randint(0, 3) for _ in range(n)]
    partitions = rng.randint(1, n)
    assert solve(costs, partitions) == brute_force(costs, partitions)


@pytest.mark.parametrize("seed", range(5))
def test_solve_optimum_on_larger_inputs(seed):
    rng = random.Random(seed)
    costs = [rng.expovariate(1.0) for _ in range(60)]
    balance = solve(costs, 7)
    assert len(balance) == 7 and sum(balance) == 60 and min(balance) >= 1
    # the optimum equals the smallest limit a greedy packing fits in 7 groups
    assert greedy_groups(costs, group_max(costs, balance)) <= 7
    tighter = math.nextafter(group_max(costs, balance), 0)
    assert greedy_groups(costs, tighter) > 7


def group_max(costs, balance):
    bounds = list(itertools.accumulate([0, *balance]))
    return max(math.fsum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))


def greedy_groups(costs, limit):
    groups, total = 1, 0.0
    for c in costs:
        if c > limit:
            return math.inf
        if total + c > limit:
            groups, total = groups + 1, 0.0
        total += c
    return groups


def test_solve_is_fast_enough_for_hundreds_of_layers():
    costs = [float(i % 7 + 1) for i in range(400)]
    balance = solve(costs, 8)
    assert sum(balance) == 400


# -- solve: errors ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "costs, partitions, error, words",
    [
        ([1, 2], 0, ValueError, ["partitions", ">= 1"]),
        ([1, 2], -1, ValueError, ["partitions", ">= 1"]),
        ([1, 2], 3, ValueError, ["partitions=3", "2 layers", "at most 2"]),
        ([], 1, ValueError, ["0 layers", "at least one"]),
        ([1, 2], 1.0, TypeError, ["partitions"]),
        ([1, 2], True, TypeError, ["partitions"]),
        ([1, -2], 1, ValueError, ["costs[1]=-2", ">= 0"]),
        ([float("nan"), 1], 1, ValueError, ["costs[0]=nan", "finite"]),
        ([1, float("inf")], 1, ValueError, ["costs[1]=inf", "finite"]),
        ([1, "x"], 1, TypeError, ["costs[1]='x'", "not a number"]),
        ([1, None], 1, TypeError, ["costs[1]=None"]),
    ],
)
def test_solve_errors(costs, partitions, error, words):
    with pytest.raises(error) as info:
        solve(costs, partitions)
    for word in words:
        assert word in str(info.value)


# -- profilers -------------------------------------------------------------------------------


def small_model():
    return nn.Sequential(
        nn.Linear(8, 32),
        nn.BatchNorm1d(32),
        nn.ReLU(),
        nn.Dropout(0.5),
        nn.Linear(32, 32),
        nn.Linear(32, 4),
    )


def snapshot(module):
    return {
        "state": {k: v.clone() for k, v in module.state_dict().items()},
        "grads": {
            k: None if p.grad is None else p.grad.clone() for k, p in module.named_parameters()
        },
        "training": [m.training for m in module.modules()],
        "requires_grad": [p.requires_grad for p in module.parameters()],
    }


def assert_same(before, after):
    assert before["state"].keys() == after["state"].keys()
    for k in before["state"]:
        assert torch.equal(before["state"][k], after["state"][k]), k
    for k, g in before["grads"].items():
        if g is None:
            assert after["grads"][k] is None, k
        else:
            assert torch.equal(g, after["grads"][k]), k
    assert before["training"] == after["training"]
    assert before["requires_grad"] == after["requires_grad"]


def prepared_model():
    model = small_model()
    model[0].weight.grad = torch.full_like(model[0].weight, 0.5)  # some grads set, some None
    model.train()
    model[3].eval()  # mixed training flags must survive
    return model


@pytest.mark.parametrize("partitions", [1, 2, 3, 6])
def test_by_time_returns_a_valid_balance_and_leaves_module_untouched(partitions):
    model, sample = prepared_model(), torch.randn(16, 8)
    before, rng = snapshot(model), torch.get_rng_state()
    balance = by_time(partitions, model, sample, timeout=0.5)
    assert len(balance) == partitions and sum(balance) == len(model) and min(balance) >= 1
    assert_same(before, snapshot(model))
    assert torch.equal(rng, torch.get_rng_state())
    assert not sample.requires_grad and sample.grad is None


@pytest.mark.parametrize("partitions", [1, 2, 3, 6])
def test_by_size_returns_a_valid_balance_and_leaves_module_untouched(partitions):
    model, sample = prepared_model(), torch.randn(16, 8)
    before = snapshot(model)
    balance = by_size(partitions, model, sample)
    assert len(balance) == partitions and sum(balance) == len(model) and min(balance) >= 1
    assert_same(before, snapshot(model))


def test_profile_times_are_positive_per_layer():
    times = profile_times(small_model(), torch.randn(4, 8), timeout=0.2, repeats=2)
    assert len(times) == 6 and all(t > 0 for t in times)


def test_profile_sizes_counts_params_buffers_and_outputs():
    model = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU())
    sizes = profile_sizes(model, torch.randn(4, 8), param_scale=3.0)
    out = 4 * 32 * 4  # float32 output bytes of every layer
    linear = (8 * 32 + 32) * 4
    bn_params, bn_buffers = 2 * 32 * 4, 2 * 32 * 4 + 8  # running mean/var + int64 counter
    assert sizes == [3.0 * linear + out, 3.0 * bn_params + bn_buffers + out, float(out)]


def test_by_size_follows_parameter_weight():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 256), nn.Linear(256, 4))
    assert by_size(2, model, torch.randn(2, 4), param_scale=4.0) == [3, 1]


class Pair(nn.Module):
    """Takes and returns a tuple (x, mask) -- a nested sample."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, pair):
        x, mask = pair
        return self.lin(x) * mask, mask


class ToDict(nn.Module):
    def forward(self, pair):
        return {"x": pair[0], "ids": torch.arange(pair[0].shape[0])}


class FromDict(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 2)

    def forward(self, d):
        return self.lin(d["x"]) + d["ids"][:, None]


def test_profilers_handle_nested_samples():
    model = nn.Sequential(Pair(), Pair(), ToDict(), FromDict())
    sample = (torch.randn(3, 6), torch.ones(3, 6))
    before = snapshot(model)
    assert sum(by_time(2, model, sample, timeout=0.2)) == 4
    assert sum(by_size(2, model, sample)) == 4
    assert_same(before, snapshot(model))


def test_profilers_handle_integer_inputs_and_no_grad_layers():
    model = nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(12, 2))
    frozen = nn.Sequential(nn.ReLU(), nn.Identity())
    ids = torch.randint(0, 10, (5, 3))
    assert sum(by_time(3, model, ids, timeout=0.2)) == 3
    assert sum(by_time(2, frozen, torch.randn(2, 2), timeout=0.2)) == 2
    times = profile_times(nn.Sequential(nn.ReLU()), torch.arange(4), timeout=0.1)
    assert len(times) == 1 and times[0] >= 0


def test_profiling_works_under_no_grad():
    with torch.no_grad():
        assert sum(by_time(2, small_model(), torch.randn(4, 8), timeout=0.2)) == 6


def test_by_time_moves_copies_to_the_requested_device():
    assert sum(by_time(2, small_model(), torch.randn(4, 8), timeout=0.2, device="cpu")) == 6


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda m, x: by_time(7, m, x), ValueError, ["partitions=7", "6 layers"]),
        (lambda m, x: by_size(0, m, x), ValueError, ["partitions"]),
        (lambda m, x: by_time(2, m[0], x), TypeError, ["nn.Sequential", "Linear"]),
        (lambda m, x: by_size(2, [m[0]], x), TypeError, ["nn.Sequential"]),
        (lambda m, x: by_time(2, m, x, timeout=0), ValueError, ["timeout"]),
        (lambda m, x: by_time(2, m, x, repeats=0), ValueError, ["repeats"]),
        (lambda m, x: by_size(2, m, x, param_scale=-1.0), ValueError, ["param_scale"]),
    ],
)
def test_profiler_errors(call, error, words):
    model = small_model()
    before = snapshot(model)
    with pytest.raises(error) as info:
        call(model, torch.randn(4, 8))
    for word in words:
        assert word in str(info.value)
    assert_same(before, snapshot(model))


# -- no torch in the solver --------------------------------------------------------------


def test_solver_has_no_module_level_torch_import():
    source = Path(__file__).resolve().parents[2] / "fastpipe" / "balance.py"
    tree = ast.parse(source.read_text())
    for node in tree.body:  # module level only; profilers import torch lazily
        if isinstance(node, ast.Import):
            assert all(not a.name.startswith("torch") for a in node.names)
        if isinstance(node, ast.ImportFrom):
            assert not (node.module or "").startswith("torch")
