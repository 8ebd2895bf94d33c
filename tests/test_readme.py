"""Every Python snippet of the README runs as shown, and so do its command lines."""
import importlib.util
import os
import re
import shlex
import textwrap

import pytest

from dist_launch import torchrun
from fastpipe.__main__ import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
SNIPPETS = [textwrap.dedent(block) for block in
            re.findall(r"^ *```python\n(.*?)^ *```", README, flags=re.S | re.M)]


def test_the_readme_has_its_snippets():
    assert len(SNIPPETS) >= 10


FRAMEWORKS = ("lightning", "transformers", "accelerate", "peft", "trl")  # optional extras


def _missing_framework(code):
    """The first optional framework a snippet imports that is not installed, or None."""
    for name in FRAMEWORKS:
        if re.search(rf"^\s*(?:import|from) {name}\b", code, flags=re.M) \
                and importlib.util.find_spec(name) is None:
            return name
    return None


@pytest.mark.parametrize("index", range(len(SNIPPETS)))
def test_readme_snippet_runs(index, tmp_path, monkeypatch):
    code = SNIPPETS[index]
    missing = _missing_framework(code)
    if missing is not None:
        pytest.skip(f"the snippet needs {missing} (pip install {missing})")
    monkeypatch.chdir(tmp_path)  # a snippet may write files (a checkpoint)
    if "torchrun" in code:
        _torchrun(code, tmp_path)
    else:
        exec(compile(code, f"README.md snippet {index}", "exec"), {"__name__": "__main__"})


def _torchrun(code, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(code)
    ranks = re.search(r"--nproc_per_node=(\d+)", code)  # as the snippet says to run it
    torchrun(str(script), [], cwd=str(tmp_path), nproc=int(ranks.group(1)) if ranks else 2,
             limit=180.0)


COMMANDS = sorted(set(re.findall(r"python -m fastpipe ((?:schedule|simulate)[^`\[]*)",
                                 README.replace("\n", " "))))


@pytest.mark.parametrize("command", COMMANDS)
def test_readme_command_runs(command, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(shlex.split(command)) == 0
    assert capsys.readouterr().out


def test_readme_lists_its_commands():
    assert any(c.startswith("schedule") for c in COMMANDS)
    assert any(c.startswith("simulate") for c in COMMANDS)
