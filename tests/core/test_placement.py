import pytest
import torch

from fastpipe.placement import worker_groups

CPU, GPU = torch.device("cpu"), torch.device("cuda", 0)


@pytest.mark.parametrize("devices,workers,groups", [
    ([CPU] * 4, 2, [[0, 1], [2, 3]]),
    ([CPU] * 5, 2, [[0, 1, 2], [3, 4]]),
    ([CPU] * 3, 8, [[0], [1], [2]]),
    ([CPU] * 3, 1, [[0, 1, 2]]),
    ([GPU, CPU, CPU, GPU], 1, [[0], [1, 2], [3]]),
])
def test_worker_groups(devices, workers, groups):
    assert worker_groups(devices, workers) == groups


class _Step:
    def __init__(self, busy, completed):
        self.busy, self.completed = busy, completed


def test_worker_policy_adapts_to_action_time_with_hysteresis():
    from fastpipe.autotune.workers import WorkerPolicy
    policy = WorkerPolicy([CPU] * 4, None)
    most = policy.current
    policy.observe(_Step([0.001, 0.001], 100))  # 20 us per action: one thread
    assert policy.current == 1
    policy.observe(_Step([0.03], 100))  # 300 us: between the thresholds, stay
    assert policy.current == 1
    policy.observe(_Step([0.05], 100))  # 500 us: one per core again
    assert policy.current == most
    fixed = WorkerPolicy([CPU] * 4, 2)
    fixed.observe(_Step([0.001], 100))
    assert fixed.current == 2
