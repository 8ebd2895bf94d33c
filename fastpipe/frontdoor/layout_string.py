"""Megatron-core's pipeline layout strings (``--pipeline-model-parallel-layout``), parsed.

A layout string lists each stage's contents, e.g. ``"E,t*3|t*4|t*3,L"``. The grammar is
Megatron's (``PipelineParallelLayerLayout.parse_str_to_list``), read exactly:

- letters: ``E`` the embedding, ``t`` one transformer block, ``m`` one multi-token-prediction
  layer, ``L`` the loss (final norm, head and loss); case matters, nothing else is a letter
  (a space neither);
- ``|`` ends a stage; stages may be empty (``"E||t"``): the stage count is one more than the
  ``|`` count;
- ``,`` is cosmetic and dropped everywhere before anything else is read (``"t*1,2"`` is
  ``"t*12"``);
- ``X*N`` repeats the letter (or ``|``) just before ``*`` N times (N decimal, 0 allowed);
  ``(...)*N`` repeats a group, which may hold letters, ``|`` and ``X*N`` but no other group
  (Megatron's pattern cannot nest groups), and must be followed by ``*N``. A repetition cannot
  be repeated again (``t*2*3``: Megatron reads it inconsistently, so it is refused).

Pure logic, no torch: :func:`parse` gives a :class:`ParsedLayout` whose letters remember their
column (counting from 1, in the string as given) and stage (counting from 0); every error is a
:class:`LayoutStringError` (a ``ValueError``) naming the first column and stage that fail, with
the string and a caret under the column. :func:`check_traced` / :func:`check_sequential` check
a parsed layout against a model (Megatron's rules: ``E`` first, ``L`` last, each exactly once
for a traced model), and :func:`block_starts` / :func:`balance_of` turn it into the block each
stage begins with, or the layer count of each stage.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, NamedTuple, Optional, Tuple

__all__ = ["LETTERS", "Letter", "LayoutStringError", "ParsedLayout", "balance_of",
           "block_starts", "check_no_empty", "check_sequential", "check_traced", "parse"]

LETTERS = {"E": "the embedding", "t": "a transformer block",
           "m": "a multi-token-prediction layer", "L": "the loss: final norm, head and loss"}
KNOWN = ", ".join(f"{letter} ({what})" for letter, what in LETTERS.items())


class LayoutStringError(ValueError):
    """A layout string that does not parse, or does not fit the model: ``column`` (from 1, in
    the string as given) and ``stage`` (from 0) name the first place that fails."""

    def __init__(self, text: str, column: int, stage: Optional[int], problem: str) -> None:
        where = f"column {column}" + ("" if stage is None else f" (stage {stage})")
        caret = " " * (column - 1) + "^"
        super().__init__(f"layout={text!r}: {where}: {problem}\n    {text}\n    {caret}")
        self.text, self.column, self.stage = text, column, stage


class Letter(NamedTuple):
    """One layer of the expanded layout: its letter, its column and its stage."""

    kind: str
    column: int
    stage: int


@dataclass(frozen=True)
class ParsedLayout:
    """A layout string's stages, each a tuple of letters, in model order; ``opens[k]`` is the
    column of the ``|`` that begins stage ``k`` (1 for stage 0)."""

    text: str
    stages: Tuple[Tuple[Letter, ...], ...]
    opens: Tuple[int, ...]

    @property
    def letters(self) -> List[Letter]:
        """Every letter, in order."""
        return [letter for stage in self.stages for letter in stage]

    def error(self, column: int, stage: Optional[int], problem: str) -> LayoutStringError:
        return LayoutStringError(self.text, column, stage, problem)

    @property
    def end(self) -> int:
        """The column just past the string, where a missing letter would go."""
        return len(self.text) + 1


# ---------------------------------------------------------------------------- parsing
class _Reader:
    """The string without its commas, each character with its column in the string given."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.chars = [(c, i + 1) for i, c in enumerate(text) if c != ","]
        self.pos = 0

    def peek(self) -> Tuple[str, int]:
        """The next character and its column; ``('', end)`` past the end."""
        if self.pos < len(self.chars):
            return self.chars[self.pos]
        return "", len(self.text) + 1

    def error(self, column: int, stage: int, problem: str) -> LayoutStringError:
        return LayoutStringError(self.text, column, stage, problem)


Token = Tuple[str, int]  # a letter or '|', and its column
MAX_LAYERS = 1_000_000  # a repetition beyond this is a typo, not a model


def parse(text: Any) -> ParsedLayout:
    """A layout string, parsed as Megatron reads it (see the module's docstring); raises
    :class:`LayoutStringError` at the first column that fails."""
    if not isinstance(text, str):
        raise TypeError(f"layout must be a string such as 'E,t*3|t*4|t*3,L' (Megatron-core's "
                        f"--pipeline-model-parallel-layout), got {type(text).__name__}")
    reader = _Reader(text)
    tokens = _sequence(reader, 0, inside=False)
    stages: List[List[Letter]] = [[]]
    opens = [1]
    for char, column in tokens:
        if char == "|":
            stages.append([])
            opens.append(column)
        else:
            stages[-1].append(Letter(char, column, len(stages) - 1))
    if not any(stages):
        raise LayoutStringError(text, 1, 0, f"the layout names no layer; list each stage's "
                                            f"layers with the letters {KNOWN}")
    return ParsedLayout(text, tuple(tuple(s) for s in stages), tuple(opens))


def _sequence(reader: _Reader, stage: int, inside: bool) -> List[Token]:
    """Units (a letter, ``|`` or a group, each maybe repeated) up to the end, or up to the
    ``)`` closing a group (``inside``); ``stage``: the stage the sequence starts in."""
    out: List[Token] = []
    while True:
        char, column = reader.peek()
        if char == "" or char == ")":
            if inside and char == "":
                raise reader.error(column, stage, "'(' is never closed; close the group and "
                                                  "repeat it: (...)*N")
            if char == ")" and not inside:
                raise reader.error(column, stage, "')' closes no group")
            return out
        if char == "(":
            if inside:
                raise reader.error(column, stage, "groups do not nest (Megatron's grammar "
                                                  "reads one level of parentheses); expand one")
            reader.pos += 1
            if reader.peek()[0] == ")":
                raise reader.error(column, stage, "an empty group '()'; put letters in it or "
                                                  "drop it")
            unit = _sequence(reader, stage, inside=True)
            _close(reader, column, stage)
        else:
            unit = [_single(reader, char, column, stage)]
        count = _repeat(reader, stage)
        if len(out) + len(unit) * count > MAX_LAYERS:
            raise reader.error(column, stage, f"the layout expands to more than {MAX_LAYERS} "
                                              f"letters")
        out += unit * count
        stage += count * sum(1 for c, _ in unit if c == "|")


def _single(reader: _Reader, char: str, column: int, stage: int) -> Token:
    """A letter or ``|``, consumed; any other character is an error naming it."""
    if char in LETTERS or char == "|":
        reader.pos += 1
        return char, column
    if char == "*":
        raise reader.error(column, stage, "'*' repeats nothing: put a letter, '|' or a group "
                                          "(...) before it")
    if char.isdigit():
        raise reader.error(column, stage, f"a count {char!r} without '*' before it; write X*N")
    raise reader.error(column, stage, f"unknown letter {char!r}; the letters are {KNOWN}, "
                                      f"'|' ends a stage, X*N and (...)*N repeat, ',' is cosmetic")


def _close(reader: _Reader, column: int, stage: int) -> None:
    """The ``)`` of the group opened at ``column``, consumed, and the ``*`` it needs after."""
    reader.pos += 1
    char, after = reader.peek()
    if char != "*":
        raise reader.error(after if char else column, stage,
                           "a group must be followed by *N (Megatron's grammar), e.g. (tt|)*4; "
                           "without a repetition, drop the parentheses")


def _repeat(reader: _Reader, stage: int) -> int:
    """The ``*N`` after a unit, consumed (1 when there is none)."""
    char, column = reader.peek()
    if char != "*":
        return 1
    reader.pos += 1
    digits = ""
    while reader.peek()[0].isdigit():
        digits += reader.peek()[0]
        reader.pos += 1
    if not digits:
        raise reader.error(column, stage, "'*' needs a count after it, e.g. t*4")
    char, after = reader.peek()
    if char == "*":
        raise reader.error(after, stage, f"a repetition repeated again; write one count "
                                         f"(e.g. t*{int(digits) * 2} for t*{int(digits)}*2)")
    return int(digits)


# ---------------------------------------------------------------------------- the model
def _check_order(parsed: ParsedLayout, required: bool) -> None:
    """Megatron's order: ``E`` only first and ``L`` only last, once each (both ``required``
    for a traced model); no ``m`` (fastpipe places no multi-token-prediction layers)."""
    letters = parsed.letters
    last = len(letters) - 1
    for i, (kind, column, stage) in enumerate(letters):
        if kind == "m":
            raise NotImplementedError(
                f"layout={parsed.text!r}: column {column} (stage {stage}): 'm' (a "
                f"multi-token-prediction layer) is not supported: fastpipe cuts a model into "
                f"E, t and L only; leave the MTP layers inside the L stage's module")
        if kind == "E" and i > 0:
            raise parsed.error(column, stage, "E (the embedding) may only be the first letter")
        if kind == "L" and i < last:
            raise parsed.error(column, stage, "L (the loss) may only be the last letter")
        if required and i == 0 and kind != "E":
            raise parsed.error(column, stage, f"the layout starts with {kind!r}: the first "
                                              f"letter must be E (the embedding), as Megatron's")
        if required and i == last and kind != "L":
            raise parsed.error(column, stage, f"the layout ends with {kind!r}: the last letter "
                                              f"must be L (the loss), as Megatron's")


def check_traced(parsed: ParsedLayout, blocks: int, name: str) -> None:
    """A layout for a traced model whose repeated blocks are ``blocks`` entries of ``name``:
    ``E`` first, ``L`` last, one ``t`` per block (a typed error at the first that fails)."""
    _check_order(parsed, required=True)
    ts = [letter for letter in parsed.letters if letter.kind == "t"]
    if len(ts) > blocks:
        extra = ts[blocks]
        raise parsed.error(extra.column, extra.stage,
                           f"t number {blocks + 1}, but {name} has {blocks} blocks; the layout "
                           f"has {len(ts)} t: give one t per block")
    if len(ts) < blocks:
        loss = parsed.letters[-1]
        raise parsed.error(loss.column, loss.stage,
                           f"L after {len(ts)} t, but {name} has {blocks} blocks: give one t "
                           f"per block ({blocks - len(ts)} more)")


def check_sequential(parsed: ParsedLayout, layers: int) -> None:
    """A layout for an ``nn.Sequential`` of ``layers`` layers: one letter per layer, in order
    (``E`` only first, ``L`` only last, each optional)."""
    _check_order(parsed, required=False)
    letters = parsed.letters
    if len(letters) > layers:
        extra = letters[layers]
        raise parsed.error(extra.column, extra.stage,
                           f"letter number {layers + 1}, but the model has {layers} layers; "
                           f"the layout names {len(letters)}: give one letter per layer")
    if len(letters) < layers:
        raise parsed.error(parsed.end, len(parsed.stages) - 1,
                           f"the layout ends after {len(letters)} letters but the model has "
                           f"{layers} layers: give one letter per layer")


def check_no_empty(parsed: ParsedLayout) -> None:
    """fastpipe's stages hold at least one layer: an empty stage is not supported."""
    for k, stage in enumerate(parsed.stages):
        if not stage:
            raise NotImplementedError(
                f"layout={parsed.text!r}: column {parsed.opens[k]} (stage {k}): the stage is "
                f"empty, and fastpipe does not support empty stages (every stage holds at "
                f"least one layer); drop a '|' around it, or move a layer into it")


def balance_of(parsed: ParsedLayout) -> List[int]:
    """Layers per stage (one layer per letter): a balance."""
    return [len(stage) for stage in parsed.stages]


def block_starts(parsed: ParsedLayout, blocks: int) -> List[int]:
    """For each stage after the first, the block it begins with (its index), or ``blocks``
    for a stage that begins with ``L`` (the first module after the blocks)."""
    starts: List[int] = []
    seen = 0
    for k, stage in enumerate(parsed.stages):
        if k > 0:
            starts.append(blocks if stage[0].kind == "L" else seen)
        seen += sum(1 for letter in stage if letter.kind == "t")
    return starts
