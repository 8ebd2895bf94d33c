"""The planner against training runs nobody here made: every row of benchmarks/published/
recomputed from its configuration, with one calibrated efficiency per GPU type
(``fastpipe/planning/hardware.py``; fitted by ``benchmarks/published/calibrate.py``) and no
number tuned per row."""
import itertools
import os
import statistics
from collections import defaultdict

import pytest

from fastpipe.planning import published

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "..", "..", "benchmarks", "published")
MEAN_GOAL, ROW_GOAL, MEMORY_GOAL = 0.10, 0.20, 0.15


@pytest.fixture(scope="module")
def rows():
    return published.rows_in(DATA)


@pytest.fixture(scope="module")
def results(rows):
    return {e["id"]: e for e in published.errors(rows)}


def test_at_least_25_rows_from_at_least_4_sources_each_with_its_source(rows):
    assert len(rows) >= 25
    assert len({row.path for row in rows}) >= 4
    for row in rows:
        assert row.source["title"] and row.source["read"] and row.data["where"]
        assert row.source.get("arxiv") or row.source.get("url")
        assert published.measured_step(row) > 0


def test_mean_step_time_error_within_10_percent(results):
    errors = [abs(e["error"]) for e in results.values()]
    assert statistics.fmean(errors) <= MEAN_GOAL


def test_every_row_within_20_percent(results):
    worst = {k: f"{e['error']:+.1%}" for k, e in results.items() if abs(e["error"]) > ROW_GOAL}
    assert worst == {}


def test_peak_memory_within_15_percent_where_published(results):
    with_memory = [e for e in results.values() if "memory_measured" in e]
    assert len(with_memory) >= 25
    off = {e["id"]: (e["memory_predicted"], e["memory_measured"]) for e in with_memory
           if abs(e["memory_predicted"] / e["memory_measured"] - 1) > MEMORY_GOAL}
    assert off == {}


KNOWN_FLIPS = {
    # 14.6B on 16 A100s across two nodes: interleaved 1F1B (one layer per chunk, three chunks
    # per stage) measured 4.5-5% slower than ZB-1p; the planner predicts it 2% faster. Its
    # interleaved predictions run 5-8% fast on this and the 6.2B model (one-layer chunks),
    # within 3% on the others: a cost per action or per message the model lacks and no
    # source states. Kept as a known miss: this test fails if it changes either way.
    ("zb-t4-14.6B-m48-ZB-1p", "zb-t4-14.6B-m48-1F1B-I"),
    ("zb-t4-14.6B-m64-ZB-1p", "zb-t4-14.6B-m64-1F1B-I"),
}


def test_the_order_a_source_compares_is_kept(results):
    """Within each group a source compares on one model (schedules, GPU counts), every pair
    whose published step times differ by more than 2% keeps its order (but the known misses
    above)."""
    groups = defaultdict(list)
    for e in results.values():
        if e["compare"]:
            groups[e["compare"]].append(e)
    assert len(groups) >= 10
    flipped = []
    for members in groups.values():
        for a, b in itertools.combinations(members, 2):
            if abs(a["measured"] / b["measured"] - 1) <= 0.02:
                continue
            if (a["measured"] < b["measured"]) != (a["predicted"] < b["predicted"]):
                flipped.append((a["id"], b["id"]))
    assert set(flipped) == KNOWN_FLIPS
