"""Model dimensions: Hugging Face configs, known names, parameter counts, bad input."""
import json

import pytest

from fastpipe.planning.model_shape import KNOWN, ModelShape, from_hf_config, model_shape

LLAMA_8B = {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096,
            "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
            "vocab_size": 128256, "hidden_act": "silu", "tie_word_embeddings": False}
GPT2 = {"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257,
        "activation_function": "gelu_new", "tie_word_embeddings": True}
MIXTRAL = {"model_type": "mixtral", "num_hidden_layers": 32, "hidden_size": 4096,
           "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
           "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000,
           "hidden_act": "silu"}


def test_a_llama_config_reads_as_a_gated_gqa_decoder_of_8b_parameters():
    shape = from_hf_config(LLAMA_8B)
    assert (shape.layers, shape.hidden, shape.heads, shape.groups, shape.inner) == (
        32, 4096, 32, 8, 14336)
    assert shape.gated and not shape.tied
    assert shape.params() == pytest.approx(8.03e9, rel=0.01)  # Llama 3 8B


def test_gpt2_small_has_124m_parameters_with_tied_embeddings():
    shape = from_hf_config(GPT2)
    assert not shape.gated and shape.tied and shape.inner == 4 * 768
    # 124M less the 1024 x 768 learned positions the cost model does not count
    assert shape.params() == pytest.approx(124.4e6 - 1024 * 768, rel=0.01)


def test_a_mixture_of_experts_counts_every_expert_but_activates_top_k():
    shape = from_hf_config(MIXTRAL)
    assert (shape.experts, shape.top_k) == (8, 2)
    assert shape.params() == pytest.approx(46.7e9, rel=0.01)  # Mixtral 8x7B
    assert shape.active_params() == pytest.approx(12.9e9, rel=0.01)


def test_a_config_file_and_a_name_and_overrides(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA_8B))
    assert model_shape(str(path)) == from_hf_config(LLAMA_8B)
    assert model_shape("llama-3-405b") is KNOWN["llama-3-405b"]
    assert model_shape("llama-3-8b", layers=4).layers == 4


@pytest.mark.parametrize("bad, words", [
    ({"hidden_size": 64, "num_attention_heads": 4, "vocab_size": 10}, "layers"),
    ({"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4}, "vocab"),
])
def test_a_config_missing_a_dimension_is_named(bad, words):
    with pytest.raises(ValueError, match=words):
        from_hf_config(bad)


@pytest.mark.parametrize("kwargs, words", [
    (dict(layers=0, hidden=64, heads=4, vocab=10), "layers"),
    (dict(layers=2, hidden=65, heads=4, vocab=10), "multiple of heads"),
    (dict(layers=2, hidden=64, heads=4, vocab=10, experts=2, top_k=3), "top_k"),
])
def test_bad_dimensions_are_refused(kwargs, words):
    with pytest.raises(ValueError, match=words):
        ModelShape(**kwargs)


def test_an_unknown_model_names_the_known_ones():
    with pytest.raises(ValueError, match="llama-3-8b"):
        model_shape("no-such-model")
