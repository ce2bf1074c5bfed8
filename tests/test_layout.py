"""The package's rooms import only downwards (core <- cli <- assets <- tasks <- bench <- pipeline; analysis: none)."""
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BELOW = {"core": {"core"}, "cli": {"core", "cli"}, "assets": {"core", "cli", "assets"},
         "tasks": {"core", "cli", "assets", "tasks"}, "bench": {"core", "cli", "assets", "tasks", "bench"},
         "pipeline": {"core", "cli", "assets", "tasks", "bench", "pipeline"}}
IMPORT = re.compile(r"^\s*(?:from|import)\s+h2o\.(\w+)", re.M)


def imports(path: Path) -> set[str]:
    return set(IMPORT.findall(path.read_text(encoding="utf-8")))


def test_every_module_lives_in_a_room_and_imports_only_below_it():
    loose = [p.name for p in (REPO / "h2o").glob("*.py") if p.name != "__init__.py"]
    assert loose == []
    upward = {str(p.relative_to(REPO)): sorted(imports(p) - BELOW[p.relative_to(REPO / "h2o").parts[0]])
              for room in BELOW for p in (REPO / "h2o" / room).rglob("*.py")}
    assert {k: v for k, v in upward.items() if v} == {}


def test_analysis_imports_nothing_of_the_package():
    users = [str(p.relative_to(REPO)) for p in (REPO / "analysis").rglob("*.py")
             if re.search(r"^\s*(from|import)\s+h2o\b", p.read_text(encoding="utf-8"), re.M)]
    assert users == []


def test_room_docstrings_say_what_lives_there_and_what_it_may_import():
    for room in BELOW:
        doc = (REPO / "h2o" / room / "__init__.py").read_text(encoding="utf-8")
        assert doc.startswith('"""') and "import" in doc.lower(), room
