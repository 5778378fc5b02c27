"""No import circle inside amp_fx, counting the imports written inside functions.

A lazy ``from amp_fx.converter.api import convert`` inside a function dodges Python's import-time
error but is a circle all the same: the two modules can no longer be read, tested or moved apart.
grimp (import-linter's graph builder) records every import statement, function-level ones included.
"""

from __future__ import annotations

import pathlib
import sys
import textwrap

import grimp
import networkx as nx
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def import_cycle(package: str) -> list[str] | None:
    """One import circle among ``package``'s modules, as [a, b, ..., a], or None where the graph is a DAG."""
    graph = grimp.build_graph(package, include_external_packages=False, cache_dir=None)
    edges = nx.DiGraph()
    edges.add_nodes_from(graph.modules)
    for module in graph.modules:
        edges.add_edges_from((module, imported) for imported in graph.find_modules_directly_imported_by(module))
    try:
        cycle = nx.find_cycle(edges)
    except nx.NetworkXNoCycle:
        return None
    return [a for a, _ in cycle] + [cycle[0][0]]


def _details(package: str, cycle: list[str]) -> str:
    graph = grimp.build_graph(package, include_external_packages=False, cache_dir=None)
    lines = []
    for importer, imported in zip(cycle, cycle[1:]):
        for detail in graph.get_import_details(importer=importer, imported=imported):
            lines.append(f"  {importer}:{detail['line_number']}: {detail['line_contents']}")
    return "\n".join(lines)


def test_amp_fx_imports_form_no_circle():
    sys.path.insert(0, str(ROOT))  # the checkout's amp_fx (amp_fx/passes links to passes/)
    try:
        cycle = import_cycle("amp_fx")
    finally:
        sys.path.remove(str(ROOT))
    assert cycle is None, ("an import circle in amp_fx: " + " -> ".join(cycle) + "\n" + _details("amp_fx", cycle)
                           + "\nbreak it by handing the lower module a callable (as ConversionRecipe.build) or by "
                             "moving the shared code into a module both import")


def test_a_circle_through_a_function_level_import_is_found(tmp_path, monkeypatch):
    """The check sees what the converter's old circle was: an import inside a function, back up to the caller."""
    package = tmp_path / "circle_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "api.py").write_text("from circle_pkg.rebuild import rebuild\n\ndef convert(m):\n    return m\n")
    (package / "rebuild.py").write_text(textwrap.dedent("""\
        def rebuild(m):
            from circle_pkg.api import convert
            return convert(m)
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    cycle = import_cycle("circle_pkg")
    assert cycle is not None and set(cycle) == {"circle_pkg.api", "circle_pkg.rebuild"}
    assert "from circle_pkg.api import convert" in _details("circle_pkg", cycle)
    (package / "rebuild.py").write_text("def rebuild(m, build):\n    return build(m)\n")
    assert import_cycle("circle_pkg") is None


@pytest.mark.parametrize("module", ["amp_fx.converter.live_hooks", "amp_fx.converter.specialisations"])
def test_the_rebuilding_modules_import_nothing_of_the_api(module):
    graph = grimp.build_graph("amp_fx", include_external_packages=False, cache_dir=None)
    assert "amp_fx.converter.api" not in graph.find_modules_directly_imported_by(module)
