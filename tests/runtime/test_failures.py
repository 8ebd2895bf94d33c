"""A failing or stuck stage stops the whole step with an error saying where; nothing hangs."""
import threading
import time

import pytest
import torch
from torch import nn

import fastpipe
from fastpipe.errors import PipelineTimeout

pytestmark = pytest.mark.timeout(60)


class Boom(nn.Module):
    def __init__(self, at_microbatch_size=None):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("boom in user code")
        return self.lin(x)


class Sleepy(nn.Module):
    def __init__(self, seconds):
        super().__init__()
        self.seconds = seconds

    def forward(self, x):
        time.sleep(self.seconds)
        return x


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_stage_error_names_stage_action_and_microbatch(schedule):
    model = nn.Sequential(nn.Linear(4, 4), Boom(), nn.Linear(4, 4))
    pipe = fastpipe.Pipe(model, chunks=4, balance=[1, 1, 1], devices=["cpu"] * 3,
                         schedule=schedule, timeout=10)
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        pipe.train_step(torch.randn(8, 4), torch.randn(8, 4), nn.MSELoss())
    assert time.monotonic() - start < 5
    assert type(info.value) is RuntimeError  # the user's exception itself, not a wrapper
    assert info.value.__notes__ == ["raised in the pipeline at stage 1, action 1F1 "
                                    "(micro-batch 1)"]
    assert info.value.pipeline_location == {"rank": None, "stage": 1, "action": "1F1",
                                            "microbatch": 1}
    # the pipe stays usable after a failed step
    model[1].calls = -100
    pipe.train_step(torch.randn(8, 4), torch.randn(8, 4), nn.MSELoss())


def test_waiting_stage_times_out_with_a_clear_error():
    model = nn.Sequential(Sleepy(1.5), nn.Linear(4, 4))
    pipe = fastpipe.Pipe(model, chunks=2, balance=[1, 1], devices=["cpu"] * 2, timeout=0.3)
    with pytest.raises(PipelineTimeout, match=r"stage 1 timed out after 0.3s waiting for the input "
                                              r"of action 1F0 \(micro-batch 0\)") as info:
        pipe.train_step(torch.randn(4, 4), torch.randn(4, 4), nn.MSELoss())
    assert (info.value.stage, info.value.action, info.value.microbatch) == (1, "1F0", 0)


def test_stages_run_concurrently_on_the_cpu():
    """Stage 0 on micro-batch 1 and stage 1 on micro-batch 0 must meet at a barrier: this only
    completes if the two stages really run at the same time."""
    barrier = threading.Barrier(2, timeout=10)

    class Meet(nn.Module):
        def __init__(self, microbatch_index):
            super().__init__()
            self.target, self.seen = microbatch_index, -1

        def forward(self, x):
            self.seen += 1
            if self.seen == self.target:
                barrier.wait()
            return x * 1.0

    model = nn.Sequential(Meet(1), Meet(0))
    pipe = fastpipe.Pipe(model, chunks=2, balance=[1, 1], devices=["cpu"] * 2,
                         checkpoint="never", cpu_workers=2)
    with torch.no_grad():
        out = pipe(torch.ones(4, 2))
    torch.testing.assert_close(out, torch.ones(4, 2))
