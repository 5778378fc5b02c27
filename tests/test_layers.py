"""The import layers (pyproject.toml's import-linter contract) hold on the installed layout, and an upward import breaks them."""

import pathlib
import shutil
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]


def _installed_layout(tmp_path: pathlib.Path) -> pathlib.Path:
    """amp_fx/ with passes/ placed at amp_fx/passes, as pip installs it (import-linter walks folders)."""
    # (amp_fx/passes is the checkout's link to passes/, for lint-imports at the root: copy the folder itself.)
    shutil.copytree(REPO / "amp_fx", tmp_path / "amp_fx", ignore=shutil.ignore_patterns("__pycache__", "passes"))
    shutil.copytree(REPO / "passes", tmp_path / "amp_fx" / "passes", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def _lint(root: pathlib.Path) -> subprocess.CompletedProcess:
    command = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run([sys.executable, "-c", command, str(REPO / "pyproject.toml"), "--no-cache"],
                          cwd=root, env={"PYTHONPATH": str(root), "PATH": ""}, capture_output=True, text=True)


def test_every_module_imports_only_from_layers_below_its_own(tmp_path):
    result = _lint(_installed_layout(tmp_path))
    assert result.returncode == 0, ("an import goes up a layer (docs/design.md, 'Layers': a module imports only "
                                    "from layers below its own):\n" + result.stdout + result.stderr)
    assert "1 kept, 0 broken" in result.stdout


def test_an_upward_import_breaks_the_contract(tmp_path):
    root = _installed_layout(tmp_path)
    meta = root / "amp_fx" / "ir" / "meta.py"
    meta.write_text(meta.read_text() + "\nfrom amp_fx.converter import api  # upward: the IR must not know the driver\n")
    result = _lint(root)
    assert result.returncode != 0
    assert "amp_fx.ir.meta -> amp_fx.converter.api" in result.stdout
