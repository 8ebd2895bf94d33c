"""A LoRA Llama (a ``PeftModel``) on a ``DistributedPipe`` of 2 gloo ranks and on 2 pipeline x
2 data ranks (``peft_cases.py``), under a hard time limit: every loss and every weight equal to
the plain PeftModel's loop (gradient accumulation, clipping, AdamW, a schedule), the frozen base
weights without gradients and unchanged, data parallelism reducing the adapters' gradients
only, the tied (frozen) embedding not summed across ranks, and the adapter written from every
rank's share loading with ``PeftModel.from_pretrained``."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft", reason="needs PEFT (pip install 'fastpipe[peft]')")
pytest.importorskip("transformers", reason="needs transformers (the Llama)")

from dist_launch import assert_all_ok, launch  # noqa: E402

import peft_models as models  # noqa: E402  (pytest puts this folder on the path)


@pytest.mark.parametrize("world, replicas", [(2, 1), pytest.param(4, 2, marks=pytest.mark.slow)],
                         ids=["pipeline-2", "2x2"])
def test_lora_across_ranks_equals_the_plain_peft_model(world, replicas, tmp_path):
    import peft
    results = assert_all_ok(launch("lora", world, limit=400.0, script="integrations/peft_cases.py",
                                   args={"replicas": replicas, "directory": str(tmp_path)}))
    names = sorted({n for r in results for n in r["names"]})
    plain = models.lora_llama()
    models.plain_run(plain, models.STEPS, models.ACCUMULATE, models.MAX_NORM)
    trained = models.adapter_state(plain)
    assert names == sorted(trained)  # the ranks' adapters together are the model's
    for r in results:
        assert r["trainable"] == 8 and r["frozen"] >= 19  # each rank: two layers' adapters
        if replicas == 1:  # nothing reduced but the loss (the tied embedding is frozen)
            assert r["largest_reduction"] <= 2
        else:  # one bucket a step: the stage's adapter gradients, nothing frozen
            assert r["largest_reduction"] == r["trainable_numel"]
            assert r["reduced"] - models.STEPS * r["trainable_numel"] <= 2 * 4  # + loss sums
    loaded = peft.PeftModel.from_pretrained(models.lora_llama().get_base_model(),
                                            results[0]["path"])
    got = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
    assert set(got) == set(trained)
    for name, value in trained.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"{name}: {m}")
