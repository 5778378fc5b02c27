"""docs/design.md's map of the code holds: its folders, its layers and its module tables are checked against the tree."""

import pathlib
import re
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
DESIGN = (ROOT / "docs" / "design.md").read_text()
PACKAGE = ROOT / "amp_fx"


def _section(title: str) -> str:
    """The text of ``## title`` (or ``### title``) up to the next heading of any level."""
    match = re.search(rf"^#+ {re.escape(title)}\n(.*?)(?=^#+ )", DESIGN, flags=re.S | re.M)
    assert match, f"docs/design.md has no section {title!r}"
    return match.group(1)


def _code_blocks(text: str) -> list[str]:
    return re.findall(r"^```\n(.*?)^```", text, flags=re.S | re.M)


def _subpackages() -> set[str]:
    """amp_fx's folders (passes/ included: installed as amp_fx.passes) and errors.py."""
    found = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    return found | {"passes", "errors.py"}


def test_the_maps_tree_names_every_folder_of_the_package_and_no_other():
    tree = _code_blocks(_section("The map: the pipeline and where the parts live"))[1]
    named = {m.group(1).rstrip("/") for m in re.finditer(r"^ *([a-z_]+/|errors\.py) ", tree, flags=re.M)} - {"amp_fx"}
    assert len(_subpackages()) == 11
    assert named == _subpackages()


def test_the_layers_picture_is_pyprojects_contract_in_its_order():
    contract = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][0]
    picture = _code_blocks(_section("Layers"))[0]
    layers = []
    for line in picture.splitlines():
        if line and not line.startswith(" "):
            name = re.split(r" {2,}", line)[0]
            layers.append(name.replace("/", "").replace(".py", "").strip())
    assert len(contract["layers"]) == 10
    assert layers == contract["layers"]


def test_the_module_tables_have_one_row_per_module_of_the_frontend_and_the_driver():
    text = _section("The frontend and the driver, module by module")
    rows = re.findall(r"^\| `((?:frontend|converter)/\w+\.py)` \|", text, flags=re.M)
    modules = {f"{folder}/{p.name}" for folder in ("frontend", "converter")
               for p in (PACKAGE / folder).glob("*.py") if p.name != "__init__.py"}
    assert len(modules) >= 25
    assert len(rows) == len(set(rows)), "a module has two rows"
    assert set(rows) == modules, (f"no row: {sorted(modules - set(rows))}; a row for no module: "
                                  f"{sorted(set(rows) - modules)}")


def test_every_module_the_tables_section_names_exists():
    text = _section("The frontend and the driver, module by module")
    named = set(re.findall(r"`((?:[a-z_]+/)+\w+\.py)`", text))
    assert len(named) >= 28
    assert not {path for path in named if not ((PACKAGE / path).exists() or (ROOT / path).exists())}
