"""Only amp_fx/ir/meta.py spells an ``amp_fx.`` string: every other module names keys through its accessors."""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

import pytest
import torch.fx as fx

from amp_fx.ir import meta

ROOT = Path(__file__).resolve().parents[2]
OWNER = ROOT / "amp_fx" / "ir" / "meta.py"
PREFIX = "amp_fx."


def _spelled(token: str) -> bool:
    """The string token's value starts with ``amp_fx.``, or quotes such a string inside it (a key in a docstring,
    a ``node.meta.get('amp_fx...')`` inside an f-string)."""
    try:
        tree = ast.parse(token.strip(), mode="eval")
    except SyntaxError:  # not a whole literal on its own: judge the raw text
        return any(q + PREFIX in token for q in ("'", '"'))
    texts = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    return any(t.startswith(PREFIX) or f'"{PREFIX}' in t or f"'{PREFIX}" in t for t in texts)


def spelled_keys(path: Path) -> list[str]:
    """``file:line`` of every string token in ``path`` that spells an ``amp_fx.`` string."""
    found = []
    with open(path, "rb") as handle:
        tokens = tokenize.tokenize(handle.readline)
        for token in tokens:
            if token.type == tokenize.STRING and _spelled(token.string):
                where = path.relative_to(ROOT) if ROOT in path.parents else path
                found.append(f"{where}:{token.start[0]}: {token.string[:70]}")
    return found


def _sources() -> list[Path]:
    return sorted(p for folder in ("amp_fx", "passes") for p in (ROOT / folder).rglob("*.py") if p != OWNER)


def test_no_module_but_meta_spells_an_amp_fx_string():
    sources = _sources()
    assert len(sources) > 50 and any(p.parent.name == "passes" for p in sources)  # the scan sees the tree
    found = [hit for path in sources for hit in spelled_keys(path)]
    assert not found, "amp_fx. strings outside amp_fx/ir/meta.py:\n" + "\n".join(found)


@pytest.mark.parametrize("code, hit", [
    ('x = "amp_fx.decision"\n', True),
    ("x = f\"{node.meta.get('amp_fx.reason', '')} more\"\n", True),
    ('"""Reads ``node.meta["amp_fx.op"]``."""\n', True),
    ('x = "see amp_fx.convert"\n', False),
    ('x = f"{PACKAGE}.convert(model)"\n', False),
])
def test_the_scan_finds_what_it_should(tmp_path, code, hit):
    path = tmp_path / "probe.py"
    path.write_text(code)
    assert bool(spelled_keys(path)) is hit


def test_meta_defines_every_key_it_documents():
    keys = {name: getattr(meta, name) for name in meta.__all__ if isinstance(getattr(meta, name), meta.Key)}
    assert len(keys) >= 26 and all(str(k).startswith(PREFIX) for k in keys.values())
    assert len(set(keys.values())) == len(keys)  # no two names share a key
    table = meta.__doc__
    missing = [name for name in keys if f"``{name}``" not in table]
    assert not missing, f"keys missing from meta.py's docstring table: {missing}"
    for new in ("KEEP_FP32", "REGION", "GRAD_READ", "CHECKPOINT", "CHECKPOINT_OPTIONS", "TRAINING_FLAG",
                "REGION_SEAL", "TRACE_NOTES"):
        assert new in keys, new


def test_a_key_is_its_string_and_reads_and_writes_node_meta():
    graph = fx.Graph()
    node = graph.placeholder("x")
    assert not meta.DECISION.on(node) and meta.DECISION.get(node, "none") == "none"
    meta.DECISION.set(node, "low")
    assert node.meta["amp_fx.decision"] == "low" and meta.DECISION.get(node) == "low" and meta.DECISION.on(node)
    assert all(type(k) is str for k in node.meta)  # the dict holds plain strings (pickles need no amp_fx class)
    assert meta.DECISION.pop(node) == "low" and not meta.DECISION.on(node) and meta.DECISION.pop(node) is None
