"""README.md as a reader uses it: every Python block runs, in order, in one namespace (as a reader would paste
them), and every ``amp_fx.a.b`` spelling in its prose and tables (and in docs/*.md) works after ``import amp_fx``."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
DOCS = sorted((README.parent / "docs").glob("*.md"))
# A dotted name that starts at amp_fx, not inside a path or a longer name (examples/amp_fx.py, my_amp_fx.x).
SPELLING = re.compile(r"(?<![\w/.-])amp_fx(?:\.[A-Za-z_]\w*)+")

# In one fresh interpreter: ``import amp_fx``, then one fork per spelling, so that no spelling
# resolves only because a module an earlier one imported is already loaded.
RESOLVE_EACH_IN_A_FORK = r"""
import json, os, sys, warnings
import amp_fx
light = sorted(m for m in sys.modules if m.startswith(("amp_fx.runtime", "amp_fx.inspection", "amp_fx.apex")))
failures = {}
for spelling in json.loads(sys.argv[1]):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        message = ""
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)  # old module paths still resolve, with a warning
                obj = amp_fx
                for part in spelling.split(".")[1:]:
                    obj = getattr(obj, part)
        except BaseException as error:
            message = f"{type(error).__name__}: {error}"
        os.write(write, message.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        message = pipe.read()
    os.waitpid(pid, 0)
    if message:
        failures[spelling] = message
print(json.dumps({"light": light, "failures": failures}))
"""


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_the_readme_has_its_two_setup_commands_near_the_top():
    text = README.read_text()
    commands = re.findall(r"```bash\n(.*?)\n```", text, flags=re.S)
    assert commands[:2] == [
        "python -m pip install torch==2.13.0 && python -m pip install -e . && python examples/quickstart.py",
        'python -m pip install torch==2.13.0 && python -m pip install -e ".[test]" && python -m pytest -q -n auto --dist loadfile',
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


def documented_spellings() -> dict[str, str]:
    """``{"amp_fx.runtime.convert_for_sharding": "README.md", ...}``: every dotted amp_fx name the docs write."""
    found: dict[str, str] = {}
    for path in (README, *DOCS):
        for match in SPELLING.finditer(path.read_text()):
            found.setdefault(match.group(0), path.name)
    return found


@pytest.mark.skipif(not hasattr(os, "fork"), reason="one fork per spelling keeps the check fast")
def test_every_documented_spelling_resolves_after_import_amp_fx_alone():
    """amp_fx.runtime.convert_for_sharding(...), as the README writes it, needs nothing but ``import amp_fx``."""
    spellings = documented_spellings()
    assert {"amp_fx.runtime.convert_for_sharding", "amp_fx.convert", "amp_fx.passes"} <= set(spellings)
    run = subprocess.run([sys.executable, "-c", RESOLVE_EACH_IN_A_FORK, json.dumps(sorted(spellings))],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["light"] == [], "import amp_fx must stay light: it loaded " + ", ".join(result["light"])
    broken = {f"{name} ({spellings[name]})": error for name, error in result["failures"].items()}
    assert not broken, broken


def test_every_relative_link_in_the_readme_and_docs_names_a_file_that_exists():
    """The README is short and points into docs/: a moved or renamed page must not leave a dead link behind."""
    pages = (README, *DOCS, *sorted((README.parent / "docs" / "frameworks").glob("*.md")))
    dead = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a web address or an anchor on the same page
            if not (page.parent / target.split("#")[0]).exists():
                dead.append(f"{page.relative_to(README.parent)} -> {target}")
    assert len(pages) > 10
    assert not dead, dead


def test_ci_runs_the_readme_test_command_printing_the_slowest_tests():
    """.ci/run installs and tests as the README's second command says, plus --durations=25 (issue 43)."""
    readme_command = re.findall(r"```bash\n(.*?)\n```", README.read_text(), flags=re.S)[1]
    steps = [step.strip() for step in readme_command.split("&&")]
    ci_lines = [line.strip() for line in (README.parent / ".ci" / "run").read_text().splitlines() if line.startswith("python")]
    assert len(steps) == len(ci_lines) == 3, (steps, ci_lines)
    assert [line.replace(" -q ", " ", 1) if "pip install" in line else line for line in ci_lines] == \
        steps[:2] + [steps[2] + " --durations=25"]
