"""Megatron layout strings, parsed (pure logic): Megatron's own examples, repetition, groups,
the errors with their column and stage, and the checks against a model's blocks or layers."""
import random
import re

import pytest

from fastpipe.frontdoor import layout_string as ls
from fastpipe.frontdoor.layout_string import LayoutStringError


def megatron(text):
    """Megatron-core's reading (``PipelineParallelLayerLayout.parse_str_to_list``, 0.16.1):
    commas dropped, ``(...)*N`` then ``X*N`` unrolled by regular expressions, stages split at
    ``|``, every character a known letter."""
    text = text.replace(",", "")
    for pattern in (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)"):
        text = re.sub(pattern, lambda x: x.group(1) * int(x.group(2)), text)
    stages = [list(stage) for stage in text.split("|")]
    if not all(c in "EtmL" for stage in stages for c in stage):
        raise AssertionError(f"invalid layer character in {text!r}")
    return stages


def kinds(text):
    return [[letter.kind for letter in stage] for stage in ls.parse(text).stages]


def test_megatron_documented_example():
    expected = [["E", "t", "t", "t"]] + [["t", "t"]] * 29 + [["m"], ["L"]]
    assert kinds("Ettt|(tt|)*29,m|L") == expected
    assert kinds("Et*3|(tt|)*29,m|L") == expected  # the same, with a letter repeated


@pytest.mark.parametrize("text,expected", [
    # the examples in Megatron's comments, with its letters: xy(ab|cd|ef)*2,pq ...
    ("Et(tm|mt|LL)*2,mE", [["E", "t", "t", "m"], ["m", "t"], ["L", "L", "t", "m"], ["m", "t"],
                           ["L", "L", "m", "E"]]),
    ("(tm)*3", [["t", "m"] * 3]),
    ("Et,(tm|)*2", [["E", "t", "t", "m"], ["t", "m"], []]),
    ("(|Et)*2,tm", [[], ["E", "t"], ["E", "t", "t", "m"]]),
    ("E,t*3|t*4|t*3,L", [["E", "t", "t", "t"], ["t"] * 4, ["t", "t", "t", "L"]]),
    ("t*1,2", [["t"] * 12]),  # commas go first: a count may span one
    ("Et*0|L", [["E"], ["L"]]),  # a count of 0
    ("E|*2L", [["E"], [], ["L"]]),  # '|' repeated
    ("(t*2|)*2L", [["t", "t"], ["t", "t"], ["L"]]),  # a repetition inside a group
    ("t*010", [["t"] * 10]),  # leading zeros, as int()
    ("E||L", [["E"], [], ["L"]]),  # an empty stage parses (fitting it to a model does not)
])
def test_repetition_groups_and_commas_read_as_megatron_reads_them(text, expected):
    assert kinds(text) == expected
    assert megatron(text) == expected


def test_letters_remember_their_column_in_the_string_as_given_and_their_stage():
    parsed = ls.parse("E,t*2|(t|)*2,L")
    assert [(x.kind, x.column, x.stage) for x in parsed.letters] == [
        ("E", 1, 0), ("t", 3, 0), ("t", 3, 0), ("t", 8, 1), ("t", 8, 2), ("L", 14, 3)]
    assert parsed.opens == (1, 6, 9, 9)  # the '|' that begins each stage


@pytest.mark.parametrize("text,column,stage,match", [
    ("E,t*3|x", 7, 1, "unknown letter 'x'"),
    ("Et|T", 4, 1, "unknown letter 'T'"),  # case matters, as in Megatron
    ("Et| t", 4, 1, "unknown letter ' '"),
    ("t*", 2, 0, "needs a count"),
    ("*3t", 1, 0, "repeats nothing"),
    ("Et3", 3, 0, "without '\\*'"),
    ("t*2*3", 4, 0, "repeated again"),
    ("(tt)*2*3", 7, 0, "repeated again"),
    ("((t)*2)*3", 2, 0, "do not nest"),
    ("E|(tt)|L", 7, 1, "followed by \\*N"),
    ("E|(tt", 6, 1, "never closed"),
    ("E|(t|t", 7, 2, "never closed"),  # the stage counts the '|' inside the open group
    ("E|tt)", 5, 1, "closes no group"),
    ("E|()*2", 3, 1, "empty group"),
    ("", 1, 0, "names no layer"),
    ("|,|", 1, 0, "names no layer"),
    ("(tt|)*3x", 8, 3, "unknown letter"),  # the stage after a repeated group
])
def test_parse_errors_name_the_first_column_and_stage_that_fail(text, column, stage, match):
    with pytest.raises(LayoutStringError, match=match) as info:
        ls.parse(text)
    assert (info.value.column, info.value.stage) == (column, stage)
    assert isinstance(info.value, ValueError)
    assert f"column {column} (stage {stage})" in str(info.value)
    text_line, caret = str(info.value).splitlines()[-2:]
    assert caret.index("^") - 4 == column - 1 and text_line == "    " + text


def test_a_layout_that_is_not_a_string_is_a_type_error():
    with pytest.raises(TypeError, match="layout must be a string"):
        ls.parse([["E", "t"], ["t", "L"]])


def test_a_huge_repetition_is_refused_before_it_is_unrolled():
    with pytest.raises(LayoutStringError, match="more than"):
        ls.parse("(t|)*999999999")


def _random_layout(rng):
    """A string of the grammar: letters, '|', X*N and (...)*N units, commas sprinkled."""
    def unit(inside):
        kind = rng.random()
        if kind < 0.2 and not inside:
            body = "".join(unit(True) for _ in range(rng.randint(1, 3)))
            return f"({body})*{rng.randint(0, 3)}"
        char = rng.choice("EtmL||t")
        return char + (f"*{rng.randint(0, 4)}" if rng.random() < 0.3 else "")
    parts = [unit(False) for _ in range(rng.randint(1, 6))]
    return "".join(p + ("," if rng.random() < 0.3 else "") for p in parts)


def test_random_layouts_parse_as_megatron_parses_them():
    rng = random.Random(0)
    checked = 0
    for _ in range(2000):
        text = _random_layout(rng)
        expected = megatron(text)
        if not any(expected):
            with pytest.raises(LayoutStringError, match="names no layer"):
                ls.parse(text)
            continue
        assert kinds(text) == expected, text
        checked += 1
    assert checked > 1000


def test_random_strings_are_refused_where_megatron_refuses_them():
    """Any string: where Megatron refuses, so does the parser; where only the parser refuses,
    it is a documented refusal (a repeated repetition, a nested group, no layer at all)."""
    rng = random.Random(1)
    refused_by_both = 0
    for _ in range(3000):
        text = "".join(rng.choice("EtL|(),*12x") for _ in range(rng.randint(1, 9)))
        try:
            expected = megatron(text)
        except AssertionError:
            expected = None
        try:
            got = kinds(text)
        except LayoutStringError as error:
            documented = re.search("repeated again|do not nest|names no layer", str(error))
            assert expected is None or documented, (text, expected, str(error))
            refused_by_both += expected is None
            continue
        assert got == expected, text
    assert refused_by_both > 1000


# ---------------------------------------------------------------------------- the model
@pytest.mark.parametrize("text,column,stage,match", [
    ("t*4|L", 1, 0, "must be E"),
    ("E,t*4|t", 7, 1, "must be L"),
    ("E,t*2|E,t*2,L", 7, 1, "E \\(the embedding\\) may only be the first"),
    ("E,t*2|L|t*2,L", 7, 1, "L \\(the loss\\) may only be the last"),
    ("E,t*3|t*2,L", 7, 1, "t number 5, but transformer.h has 4 blocks"),
    ("E,t|(t|)*4,L", 6, 4, "t number 5"),  # the fifth t: in the group's fourth copy
    ("E,t*3|L", 7, 1, "L after 3 t, but transformer.h has 4 blocks"),
])
def test_a_traced_models_layout_is_checked_at_the_first_place_that_fails(
        text, column, stage, match):
    with pytest.raises(LayoutStringError, match=match) as info:
        ls.check_traced(ls.parse(text), 4, "transformer.h")
    assert (info.value.column, info.value.stage) == (column, stage)


def test_mtp_layers_are_not_supported_and_say_where_they_are():
    with pytest.raises(NotImplementedError, match="column 7 \\(stage 1\\): 'm'"):
        ls.check_traced(ls.parse("E,t*4|m|L"), 4, "transformer.h")
    with pytest.raises(NotImplementedError, match="'m'"):
        ls.check_sequential(ls.parse("t|m"), 2)


def test_empty_stages_are_not_supported_and_say_which():
    parsed = ls.parse("E,t*2||t*2,L")
    ls.check_traced(parsed, 4, "h")  # the letters fit
    with pytest.raises(NotImplementedError, match="column 6 \\(stage 1\\): the stage is empty"):
        ls.check_no_empty(parsed)
    with pytest.raises(NotImplementedError, match="column 1 \\(stage 0\\)"):
        ls.check_no_empty(ls.parse("|t"))


def test_block_starts_name_the_block_each_stage_begins_with():
    assert ls.block_starts(ls.parse("E,t*3|t*4|t*3,L"), 10) == [3, 7]
    assert ls.block_starts(ls.parse("E|t*4|L"), 4) == [0, 4]  # 4: the module after the blocks
    assert ls.block_starts(ls.parse("Ettt|(tt|)*29,m|L"), 61) == list(range(3, 61, 2)) + [61, 61]


def test_a_sequential_layout_is_one_letter_per_layer():
    ls.check_sequential(ls.parse("t*2|t*3"), 5)
    ls.check_sequential(ls.parse("Et|ttL"), 5)  # E and L optional, one layer each
    assert ls.balance_of(ls.parse("Et|t*2,L")) == [2, 3]
    with pytest.raises(LayoutStringError, match="letter number 4, but the model has 3") as info:
        ls.check_sequential(ls.parse("t*2|t*2"), 3)
    assert (info.value.column, info.value.stage) == (5, 1)
    with pytest.raises(LayoutStringError, match="ends after 4 letters") as info:
        ls.check_sequential(ls.parse("t*2|t*2"), 5)
    assert (info.value.column, info.value.stage) == (8, 1)  # past the end
    with pytest.raises(LayoutStringError, match="E \\(the embedding\\) may only be the first"):
        ls.check_sequential(ls.parse("t|Et"), 3)
