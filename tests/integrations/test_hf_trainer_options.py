"""What a pipelined ``Trainer`` refuses, and when: every ``Trainer`` option whose meaning the pipe
cannot keep raises ``UnsupportedTrainerOption`` naming it at construction, before the model is
touched; bad pipeline settings are typed errors naming the setting; the integration needs its
framework and says how to install it, and ``import fastpipe`` imports no framework."""
import os
import subprocess
import sys
import types

import pytest

pytest.importorskip("transformers",
                    reason="needs transformers (pip install 'fastpipe[transformers]')")

import torch  # noqa: E402

import hf_trainer_cases as cases  # noqa: E402
from dist_launch import ROOT  # noqa: E402
from fastpipe.integrations.transformers import (PipelineArguments,  # noqa: E402
                                                PipelineTrainer, UnsupportedTrainerOption)
from fastpipe.integrations.transformers.options import (refuse_arguments,  # noqa: E402
                                                        refuse_state)

PIPE = PipelineArguments(chunks=2, devices=["cpu", "cpu"])

REFUSED = {
    "fsdp": True, "fp16": True, "bf16": True, "fp16_full_eval": True, "bf16_full_eval": True,
    "torch_compile": True, "activation_checkpointing": True, "use_liger_kernel": True,
    "neftune_noise_alpha": 5.0, "label_smoothing_factor": 0.1, "push_to_hub": True,
    "auto_find_batch_size": True, "ddp_find_unused_parameters": False,
    "ddp_bucket_cap_mb": 10, "ddp_broadcast_buffers": False, "ddp_static_graph": True,
    "debug": "underflow_overflow", "optim": "lomo", "eval_use_gather_object": True,
}


def build(tmp_path, pipeline=PIPE, model=None, **changes):
    model = model if model is not None else cases.model("llama")
    options = changes.pop("keywords", {})
    return PipelineTrainer(model=model, args=cases.arguments(str(tmp_path), **changes),
                           train_dataset=cases.Examples("llama", 8, seed=1),
                           eval_dataset=cases.Examples("llama", 4, seed=2),
                           pipeline=pipeline, **options)


@pytest.mark.parametrize("option", sorted(REFUSED))
def test_an_option_the_pipe_cannot_honour_raises_naming_it(option, tmp_path):
    model = cases.model("llama")
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(UnsupportedTrainerOption, match=f"TrainingArguments.{option}="):
        build(tmp_path, model=model, **{option: REFUSED[option]})
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert not os.listdir(tmp_path)  # refused before the Trainer wrote its output directory


def test_gradient_checkpointing_is_refused_under_its_new_name(tmp_path):
    with pytest.warns(FutureWarning, match="gradient_checkpointing"), \
            pytest.raises(UnsupportedTrainerOption, match="activation_checkpointing=True.*"
                                                          "PipelineArguments\\(checkpoint"):
        build(tmp_path, gradient_checkpointing=True)


def test_load_best_model_at_end_is_refused(tmp_path):
    with pytest.raises(UnsupportedTrainerOption, match="load_best_model_at_end"):
        build(tmp_path, load_best_model_at_end=True, metric_for_best_model="loss")


@pytest.mark.parametrize("keyword", ["compute_loss_func", "model_init"])
def test_a_trainer_keyword_the_pipe_cannot_honour_raises_naming_it(keyword, tmp_path):
    value = (lambda outputs, labels, num_items_in_batch=None: outputs.loss) \
        if keyword == "compute_loss_func" else (lambda: cases.model("llama"))
    model = None if keyword == "model_init" else cases.model("llama")
    with pytest.raises(UnsupportedTrainerOption, match=f"{keyword}="):
        PipelineTrainer(model=model, args=cases.arguments(str(tmp_path)),
                        train_dataset=cases.Examples("llama", 8, seed=1),
                        eval_dataset=cases.Examples("llama", 4, seed=2), pipeline=PIPE,
                        **{keyword: value})


def test_an_optimizer_of_other_parameters_is_refused(tmp_path):
    stranger = torch.optim.SGD(cases.model("llama").parameters(), lr=0.1)
    with pytest.raises(UnsupportedTrainerOption, match="optimizers.*not the pipe's"):
        build(tmp_path, keywords={"optimizers": (stranger, None)})


def test_options_for_several_pipeline_ranks_are_checked_with_them(tmp_path):
    """Options that only go wrong when a replica's pipeline ranks are several processes."""
    args = cases.arguments(str(tmp_path), include_num_input_tokens_seen="all")
    refuse_arguments(args, {}, pipeline_ranks=1)
    with pytest.raises(UnsupportedTrainerOption, match="include_num_input_tokens_seen"):
        refuse_arguments(args, {}, pipeline_ranks=2)
    args = cases.arguments(str(tmp_path), save_on_each_node=True)
    with pytest.raises(UnsupportedTrainerOption, match="save_on_each_node"):
        refuse_arguments(args, {}, pipeline_ranks=2)


def test_what_accelerate_launch_turned_on_is_refused_too():
    """An Accelerate configuration can switch on what the arguments did not."""
    def trainer(**changes):
        state = dict(deepspeed=False, fsdp=False, precision="no", backend="NO")
        state.update(changes)
        accelerator = types.SimpleNamespace(
            mixed_precision=state["precision"],
            state=types.SimpleNamespace(dynamo_plugin=types.SimpleNamespace(
                backend=state["backend"])))
        return types.SimpleNamespace(is_deepspeed_enabled=state["deepspeed"],
                                     is_fsdp_enabled=state["fsdp"], accelerator=accelerator)

    refuse_state(trainer())
    for changes, named in [({"deepspeed": True}, "DeepSpeed"), ({"fsdp": True}, "FSDP"),
                           ({"precision": "bf16"}, "mixed_precision='bf16'"),
                           ({"backend": "INDUCTOR"}, "dynamo backend")]:
        with pytest.raises(UnsupportedTrainerOption, match=named):
            refuse_state(trainer(**changes))


def test_a_trainer_without_the_hooks_it_overrides_is_refused(monkeypatch, tmp_path):
    """The pipelined loop relies on the installed ``Trainer`` calling each method it
    overrides (private ones included): one that is gone raises, naming it."""
    import transformers
    monkeypatch.delattr(transformers.Trainer, "_get_grad_norm")
    with pytest.raises(ImportError, match="_get_grad_norm.*transformers 5"):
        build(tmp_path)


def test_pipeline_settings_are_checked(tmp_path):
    with pytest.raises(ValueError, match="devices="):
        build(tmp_path, pipeline=PipelineArguments(chunks=2))
    with pytest.raises(TypeError, match="unknown settings \\['chunk'\\]"):
        build(tmp_path, pipeline={"chunk": 2, "devices": ["cpu", "cpu"]})
    with pytest.raises(ValueError, match="data_parallel=2"):
        PipelineArguments(data_parallel=2, devices=["cpu"]).pipeline_ranks(3)
    with pytest.raises(TypeError, match="pipeline= must be"):
        build(tmp_path, pipeline=["cpu", "cpu"])


def test_the_trainer_s_model_becomes_the_pipe(tmp_path):
    """What the ``Trainer`` loop touches is the pipe; the model stays reachable, and the pipe
    shows its config (read by ``Trainer`` code) and Accelerate's mark (no DDP around it)."""
    run = build(tmp_path)
    assert run.model is run.pipe and run.model_wrapped is run.pipe
    assert run.plain_model.__class__.__name__ == "LlamaForCausalLM"
    assert run.pipe.config is run.plain_model.config
    assert run.accelerator.prepare_model(run.pipe) is run.pipe


def test_the_integration_names_its_extra_when_its_framework_is_missing():
    code = ("import sys; sys.modules['transformers'] = None\n"
            "try:\n    import fastpipe.integrations.transformers\n"
            "except ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=120).stdout
    assert "pip install 'fastpipe[transformers]'" in out


def test_import_fastpipe_imports_no_framework():
    code = ("import sys, fastpipe, fastpipe.checkpoint\n"
            "print(sorted(m for m in ('transformers', 'accelerate', 'lightning', 'peft', 'trl')"
            " if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=120).stdout
    assert out.strip() == "[]"
