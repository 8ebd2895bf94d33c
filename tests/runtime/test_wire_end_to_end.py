"""The wire format end to end (two gloo ranks): a message of several tensors with odd byte
sizes (float32 and float16 parts of 24 and 20 bytes, each padded to 16-byte alignment in the
packed payload) crosses both transports, forward and backward, and the gradients equal the
plain model's (``wire_cases.py``)."""
import pytest
import torch.distributed as dist

from dist_launch import assert_all_ok, launch


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                    reason="needs torch.distributed with gloo")
def test_odd_sized_tensors_packed_together_cross_both_transports():
    results = assert_all_ok(launch("odd_sizes", 2, limit=120, script="wire_cases.py"))
    assert results[0]["tagged"] == results[0]["grouped"] == ["0.bias", "0.weight", "1.lin.bias",
                                                             "1.lin.weight"]
    assert results[1]["tagged"] == ["3.bias", "3.weight"]
