"""The doctor's advice weighed against the noise, moved with the layers, and read against the
hardware: synthetic traces of several steps (simulated timelines relabelled as measured, each
step's costs scaled by a planted factor), so every planted problem and every spread is exact."""
from __future__ import annotations

import dataclasses

import pytest

from fastpipe.diagnosis.confidence import Noise, weigh
from fastpipe.diagnosis.findings import Memory
from fastpipe.diagnosis.report import doctor
from fastpipe.runtime.observe.trace import Trace
from fastpipe.schedule import get_schedule
from fastpipe.schedule.simulator import Costs, simulate
from fastpipe.schedule.timeline import Event, Timeline
from fastpipe.schedule.trace_file import StepContext, TraceFileError, load_trace

MS = 1e-3
QUIET = (1.0, 1.004, 0.997, 1.002, 0.999)  # five steps of a quiet machine
BUSY = (1.0, 1.4, 0.75, 1.3, 0.8)  # five steps sharing the cores with other work
SLOW_LAYER = (1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 5.0)  # ms of F per layer; B is twice that


def step(stage_costs, chunks=8, name="1f1b", factor=1.0, gap=0.0):
    """A 'measured' step: ``stage_costs`` (F seconds per stage; B twice that) times
    ``factor``, each action starting ``gap`` after it could."""
    schedule = get_schedule(name, len(stage_costs), chunks)
    forward = [c * factor for c in stage_costs]
    costs = Costs(forward=forward, backward=[2 * c for c in forward], weight=0.0)
    events = [Event(e.stage, e.action, e.start + gap, e.end)
              for e in simulate(schedule, costs).timeline.events]
    return Timeline(len(stage_costs), events, "measured", "s")


def grouped(layers, balance):
    out, start = [], 0
    for count in balance:
        out.append(sum(layers[start:start + count]) * MS)
        start += count
    return out


def trace_of(factors, stage_costs, wait=0.0, chunks=8, **context):
    """A ``Trace`` of one step per factor, each with ``context`` (and ``wait`` seconds of
    input before it)."""
    trace = Trace()
    for index, factor in enumerate(factors):
        timeline = step(stage_costs, factor=factor, chunks=chunks)
        trace.timelines.append(timeline)
        trace.contexts[index] = StepContext(step_start=timeline.start - wait,
                                            step_end=timeline.end, **context)
    return trace


def slow_layer_trace(factors, **context):
    return trace_of(factors, grouped(SLOW_LAYER, (4, 4)), balance=(4, 4), samples=64,
                    **context)


# ----------------------------------------------------------------------- planted problems
def test_one_slow_layer_moves_with_its_cost_when_the_layer_profile_is_known():
    diagnosis = doctor(slow_layer_trace(QUIET), layer_costs=SLOW_LAYER)
    finding = diagnosis.finding("imbalance")
    assert finding.stage == 1 and finding.balance == (6, 2)
    assert finding.confidence == "high" and "5 of 5 steps propose it" in finding.evidence
    # the prediction is the simulator's on the true layer costs regrouped: exact
    schedule = get_schedule("1f1b", 2, 8)
    true = grouped(SLOW_LAYER, (6, 2))
    after = simulate(schedule, Costs(forward=true, backward=[2 * c for c in true], weight=0.0))
    before = step(grouped(SLOW_LAYER, (4, 4))).makespan
    assert finding.gain == pytest.approx(before - after.makespan, rel=1e-6)
    assert "layer profile" in finding.fix


def test_without_a_profile_layers_are_spread_evenly_and_the_advice_says_so():
    finding = doctor(slow_layer_trace(QUIET)).finding("imbalance")
    assert finding.balance == (5, 3) and "spread evenly" in finding.fix


def test_too_few_microbatches_get_a_larger_chunks_with_confidence():
    trace = trace_of(QUIET, [2 * MS, 2 * MS], chunks=2, samples=64)
    finding = doctor(trace).finding("chunks")
    assert finding is not None and finding.chunks > 2 and finding.confidence == "high"


def test_an_input_bound_loader_is_found_with_confidence():
    trace = trace_of(QUIET, [2 * MS, 2 * MS], wait=40 * MS, samples=64, chunks=16)
    diagnosis = doctor(trace)
    assert diagnosis.findings[0].kind == "input"
    assert diagnosis.findings[0].confidence == "high"


def test_checkpointing_with_memory_to_spare_is_found_on_every_step():
    trace = trace_of(QUIET, [2 * MS, 2 * MS], checkpoint="always", chunks=16)
    diagnosis = doctor(trace, memory=Memory(peak=(1e9, 1e9), limit=(8e9, 8e9)))
    finding = diagnosis.finding("memory")
    assert finding is not None and finding.confidence is not None


def test_a_healthy_pipe_gets_no_advice():
    trace = trace_of(QUIET, [2 * MS, 2 * MS], balance=(2, 2), samples=256, chunks=32)
    diagnosis = doctor(trace)
    assert diagnosis.findings == () and "no problem found" in diagnosis.report()
    assert "5 steps, step-time spread" in diagnosis.report()


# ----------------------------------------------------------------------- noise
def test_a_noisy_trace_gets_no_balance_advice():
    diagnosis = doctor(slow_layer_trace(BUSY), layer_costs=SLOW_LAYER)
    assert diagnosis.finding("imbalance") is None  # the gain is under the steps' spread
    quiet = doctor(slow_layer_trace(QUIET), layer_costs=SLOW_LAYER).finding("imbalance")
    assert quiet.confidence == "high"  # the same costs without the noise


def test_a_gain_under_the_spread_is_withheld():
    noise = Noise(5, 10 * MS)
    assert noise.confidence(9 * MS, 5, 5) is None
    assert noise.confidence(12 * MS, 5, 5)[0] == "low"
    assert noise.confidence(20 * MS, 5, 5)[0] == "medium"
    assert noise.confidence(40 * MS, 5, 5)[0] == "high"
    assert noise.confidence(40 * MS, 4, 5)[0] == "medium"  # the steps disagree
    assert Noise(2, 10 * MS).confidence(40 * MS, 2, 2)[0] == "medium"  # two steps: at most


def test_one_step_says_the_noise_is_unknown_and_lowers_the_confidence():
    trace = slow_layer_trace((1.0,))
    diagnosis = doctor(trace, layer_costs=SLOW_LAYER)
    finding = diagnosis.finding("imbalance")
    assert finding.confidence == "low" and "noise unknown" in finding.evidence
    assert "1 step: noise unknown" in diagnosis.report()
    assert "low confidence" in diagnosis.report()


def _slow_stage_moves():
    """Five steps of three stages; the slow one is stage 1 in three steps, stage 2 in two."""
    trace = Trace()
    for index, slow in enumerate((1, 1, 1, 2, 2)):
        stages = [2 * MS, 2 * MS, 2 * MS]
        stages[slow] = 6 * MS
        trace.timelines.append(step(stages, chunks=8))
        trace.contexts[index] = StepContext(balance=(2, 2, 2), samples=64)
    return trace


def test_steps_proposing_different_balances_lower_the_confidence():
    """Weighed on the step-time spread alone (the stages' own spread unknown), the balance
    that three of five steps propose keeps its gain but not a high confidence."""
    per_step = [doctor(_slow_stage_moves(), step=i).findings for i in range(5)]
    finding = next(f for f in weigh(per_step, Noise(5, 1 * MS)) if f.kind == "imbalance")
    assert "3 of 5 steps propose it" in finding.evidence
    assert finding.confidence != "high"


def test_stage_costs_that_jump_between_steps_withhold_the_balance_advice():
    """The slow stage moves from step to step: each stage's compute time varies by far more
    than the gain a new balance promises, so no balance is advised, whatever the step
    spread (here about none)."""
    diagnosis = doctor(_slow_stage_moves())
    assert diagnosis.noise.stage_spread > 10 * diagnosis.noise.spread
    assert diagnosis.finding("imbalance") is None
    assert "stage spread" in diagnosis.report()


def test_a_single_step_can_be_chosen_and_a_bad_step_is_refused():
    trace = slow_layer_trace(QUIET)
    assert doctor(trace, step=2).noise.steps == 1
    with pytest.raises(TraceFileError, match="step=9"):
        doctor(trace, step=9)


def test_the_noise_travels_in_a_trace_file(tmp_path):
    trace = slow_layer_trace(QUIET)
    path = tmp_path / "trace.json"
    trace.write(path)
    timeline, context = load_trace(path)
    assert len(context.step_times) == 5
    diagnosis = doctor((timeline, context))
    # the noise is known; whether the other steps agree is not (their timelines stay behind)
    assert diagnosis.noise.steps == 5 and diagnosis.finding("imbalance").confidence == "medium"


def test_a_bad_layer_profile_is_refused_before_any_work():
    trace = slow_layer_trace(QUIET)
    with pytest.raises(TraceFileError, match="layer_costs has 3 entries.*8 layers"):
        doctor(trace, layer_costs=[1, 2, 3])
    with pytest.raises(TraceFileError, match="layer_costs must be"):
        doctor(trace, layer_costs="fast")


# ----------------------------------------------------------------------- hardware
def hardware(trace, **facts):
    for index, context in trace.contexts.items():
        trace.contexts[index] = dataclasses.replace(context, **facts)
    return doctor(trace, layer_costs=SLOW_LAYER)


def test_cpu_stages_without_free_cores_are_the_bottleneck_and_get_no_balance_advice():
    busy = hardware(slow_layer_trace(QUIET), devices=("cpu", "cpu"), threads=((0,), (1,)),
                    cores=2, load=4.0, intra_op_threads=1)
    found = busy.finding("hardware")
    assert found is not None and "CPU stages are the bottleneck" in found.message
    assert "load average 4.0" in found.message and busy.finding("imbalance") is None
    one_core = hardware(slow_layer_trace(QUIET), devices=("cpu", "cpu"), cores=1, load=0.0)
    assert one_core.finding("hardware") is not None and one_core.finding("imbalance") is None


def test_contention_measured_on_the_threads_overrides_a_stale_load_average():
    """Each stage's thread got its core during its actions (CPU time over wall time 0.97):
    the balance advice stands even though the one-minute load average reads 4.4 on 2 cores
    (other jobs that just ended); a stage whose thread got half a core withholds it, even
    on a load average of 0 -- for a DistributedPipe too, which records no devices."""
    had = hardware(slow_layer_trace(QUIET), devices=("cpu", "cpu"), threads=((0,), (1,)),
                   cores=2, load=4.4, intra_op_threads=1, cpu_busy=(0.97, 0.98))
    assert had.finding("hardware") is None and had.finding("imbalance").balance == (6, 2)
    short = hardware(slow_layer_trace(QUIET), cores=2, load=0.0, intra_op_threads=1,
                     cpu_busy=(0.97, 0.5))
    found = short.finding("hardware")
    assert found is not None and "stage 1 50% of a core" in found.message
    assert short.finding("imbalance") is None


def test_the_threads_own_time_is_not_read_with_several_intra_op_threads():
    """With several intra-op threads a stage's work runs on threads it does not time: the
    doctor falls back on the load average."""
    diagnosis = hardware(slow_layer_trace(QUIET), devices=("cpu", "cpu"), threads=((0,), (1,)),
                         cores=2, load=4.0, intra_op_threads=2, cpu_busy=(0.4, 0.4))
    assert "load average 4.0" in diagnosis.finding("hardware").message


def test_stable_stage_costs_keep_the_balance_advice_and_report_their_spread():
    diagnosis = doctor(slow_layer_trace(QUIET), layer_costs=SLOW_LAYER)
    assert diagnosis.noise.stage_spread is not None
    assert diagnosis.finding("imbalance").balance == (6, 2)
    assert "stage spread" in diagnosis.noise.describe()


def test_cores_to_spare_give_no_hardware_finding():
    quiet = hardware(slow_layer_trace(QUIET), devices=("cpu", "cpu"), threads=((0,), (1,)),
                     cores=4, load=2.0, intra_op_threads=2)
    assert quiet.finding("hardware") is None and quiet.finding("imbalance").balance == (6, 2)


def test_oversubscribed_intra_op_threads_qualify_the_balance_advice():
    diagnosis = hardware(slow_layer_trace(QUIET), devices=("cpu", "cpu"), cores=2, load=2.0,
                         intra_op_threads=2)
    assert "torch.set_num_threads(1)" in diagnosis.finding("hardware").fix
    imbalance = diagnosis.finding("imbalance")
    assert imbalance.balance == (6, 2) and "hardware finding" in imbalance.fix


def test_stages_sharing_a_gpu_are_named_and_their_balance_advice_withheld():
    diagnosis = hardware(slow_layer_trace(QUIET), devices=("cuda:0", "cuda:0"))
    found = diagnosis.finding("hardware")
    assert "stages 0, 1 share cuda:0" in found.message and diagnosis.finding("imbalance") is None
    apart = hardware(slow_layer_trace(QUIET), devices=("cuda:0", "cuda:1"))
    assert apart.finding("hardware") is None and apart.finding("imbalance") is not None


def test_stages_sharing_a_worker_thread_get_no_balance_advice():
    diagnosis = hardware(slow_layer_trace(QUIET), threads=((0, 1),))
    assert "shared a worker thread" in diagnosis.finding("hardware").message
    assert diagnosis.finding("imbalance") is None
    assert "[hardware]" in diagnosis.report()


def test_stages_that_all_share_one_thread_get_no_chunks_advice_either():
    """Stages run one at a time have no bubble to shrink: more micro-batches only add cost."""
    few = trace_of(QUIET, [2 * MS, 2 * MS], chunks=2, samples=64)
    assert doctor(few).finding("chunks") is not None
    shared = hardware(trace_of(QUIET, [2 * MS, 2 * MS], chunks=2, samples=64),
                      threads=((0, 1),))
    assert shared.finding("hardware") is not None and shared.finding("chunks") is None


def test_more_microbatches_are_advised_with_their_assumption_named():
    finding = doctor(trace_of(QUIET, [2 * MS, 2 * MS], chunks=2, samples=64)).finding("chunks")
    assert "in proportion to its micro-batch" in finding.fix
