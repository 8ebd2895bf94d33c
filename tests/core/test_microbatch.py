import pytest
import torch

from fastpipe import microbatch
from fastpipe.outputs import OutputRules, check_output_reduction


@pytest.mark.parametrize("total,chunks,sizes", [
    (8, 1, [8]), (8, 2, [4, 4]), (8, 3, [3, 3, 2]), (5, 4, [2, 2, 1]), (13, 8, [2] * 6 + [1]),
    (4, 4, [1, 1, 1, 1]), (24, 8, [3] * 8),
])
def test_split_sizes_follow_torch_chunk(total, chunks, sizes):
    assert microbatch.split_sizes(total, chunks) == sizes
    assert [len(c) for c in torch.arange(total).chunk(chunks)] == sizes


def test_batch_smaller_than_chunks_gives_fewer_microbatches_as_torch_chunk():
    assert microbatch.split_sizes(3, 4) == [1, 1, 1]
    with pytest.raises(ValueError, match="empty"):
        microbatch.split_sizes(0, 4)


def test_fitted_sizes_fall_back_to_a_count_the_schedule_runs():
    even = lambda m: m % 2 == 0  # noqa: E731
    assert microbatch.fitted_sizes(8, 4, even) == [2, 2, 2, 2]
    assert microbatch.fitted_sizes(7, 8, even) == [2, 2, 2, 1]  # 7 pieces -> 4
    assert microbatch.fitted_sizes(3, 4, even) == [2, 1]
    with pytest.raises(ValueError, match="cannot run any micro-batch count"):
        microbatch.fitted_sizes(1, 4, even)


def test_scatter_gather_nested_round_trip():
    batch = {"x": torch.randn(7, 3), "pair": (torch.arange(7), [torch.ones(7, 2, 2)]),
             "flag": True, "name": "abc", "scalar": torch.tensor(2.0)}
    sizes = microbatch.split_sizes(7, 3)
    parts = microbatch.scatter(batch, sizes)
    assert [p["x"].shape[0] for p in parts] == [3, 3, 1]
    assert all(p["flag"] is True and p["name"] == "abc" for p in parts)
    assert all(p["scalar"] is batch["scalar"] for p in parts)
    torch.testing.assert_close(parts[1]["pair"][0], torch.arange(3, 6))
    back = microbatch.gather([{k: v for k, v in p.items() if k != "scalar"} for p in parts])
    torch.testing.assert_close(back["x"], batch["x"])
    torch.testing.assert_close(back["pair"][1][0], batch["pair"][1][0])
    assert back["name"] == "abc"


def test_batch_size_mismatch_names_the_tensors():
    with pytest.raises(ValueError, match=r"different batch sizes.*inputs\[0\]: 4.*inputs\[1\]: 5"):
        microbatch.batch_size((torch.zeros(4, 2), torch.zeros(5, 2)))


def test_no_tensor_is_an_error():
    with pytest.raises(ValueError, match="no tensor with a batch dimension"):
        microbatch.batch_size({"a": 1, "b": torch.tensor(3.0)})


def test_gather_rejects_scalar_outputs_without_a_rule():
    with pytest.raises(ValueError, match=r"'output' is a 0-dim tensor.*output_reduction="):
        microbatch.gather([torch.tensor(1.0), torch.tensor(2.0)], [1, 1])


def test_gather_combines_scalar_outputs_by_their_rule():
    rules = OutputRules(check_output_reduction({"output": "mean"}), {})
    whole = microbatch.gather([torch.tensor(1.0), torch.tensor(4.0)], [2, 1], rules)
    torch.testing.assert_close(whole, torch.tensor(2.0))  # (1 * 2 + 4 * 1) / 3
