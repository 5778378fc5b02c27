"""Every Python code block in README.md runs, in order, in one namespace (as a reader would paste them)."""

from __future__ import annotations

import pathlib
import re

import torch

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_the_readme_has_its_two_setup_commands_near_the_top():
    text = README.read_text()
    commands = re.findall(r"```bash\n(.*?)\n```", text, flags=re.S)
    assert commands[:2] == [
        "python -m pip install torch==2.13.0 && python -m pip install -e . && python examples/quickstart.py",
        'python -m pip install torch==2.13.0 && python -m pip install -e ".[test]" && python -m pytest -q',
    ]
    assert text.index(commands[1]) < 2000


def test_every_python_block_runs(capsys):
    blocks = python_blocks()
    assert len(blocks) >= 4
    namespace: dict = {}
    torch.manual_seed(0)
    for index, block in enumerate(blocks):
        try:
            exec(compile(block, f"README.md python block {index}", "exec"), namespace)
        except Exception as error:  # name the block that broke
            raise AssertionError(f"README python block {index} failed: {type(error).__name__}: {error}\n{block}") from error
    torch._dynamo.reset()
