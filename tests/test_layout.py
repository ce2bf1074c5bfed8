"""The package's rooms import only downwards (core <- cli <- store <- assets <- tasks <- bench, parity <- pipeline;
analysis: none). store reads one thing of assets: the project's conf/ (h2o.assets.paths: a record folder names the
settings that differ from their group file's defaults)."""
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BELOW = {"core": {"core"}, "cli": {"core", "cli"}, "store": {"core", "cli", "store", "assets.paths"},
         "assets": {"core", "cli", "store", "assets"}, "tasks": {"core", "cli", "store", "assets", "tasks"},
         "bench": {"core", "cli", "store", "assets", "tasks", "bench"},
         "parity": {"core", "cli", "store", "assets", "parity"},
         "pipeline": {"core", "cli", "store", "assets", "tasks", "bench", "pipeline"}}
IMPORT = re.compile(r"^\s*(?:from|import)\s+h2o\.(\w+)(\.paths)?", re.M)


def imports(path: Path) -> set[str]:
    """The rooms a file imports (``assets.paths`` named apart from the rest of assets)."""
    found = IMPORT.findall(path.read_text(encoding="utf-8"))
    return {room + (sub if room == "assets" else "") for room, sub in found}


def test_every_module_lives_in_a_room_and_imports_only_below_it():
    loose = [p.name for p in (REPO / "h2o").glob("*.py") if p.name != "__init__.py"]
    assert loose == []
    allowed = {room: below | ({"assets.paths"} if "assets" in below else set()) for room, below in BELOW.items()}
    upward = {str(p.relative_to(REPO)): sorted(imports(p) - allowed[room])
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


# the code folders' files that are not Python: the analysis package's own metadata and table, the parity venv script
NOT_PYTHON = {"analysis/pyproject.toml", "analysis/paper_results.csv", "tools/parity/setup_venv.sh"}
OUTPUTS = {"__pycache__", "analysis/out", "analysis/build"}  # written by Python, `make tables`/`figures`, pip (git-ignored)


def test_code_folders_hold_code_only():
    """h2o/, analysis/ and tools/ hold code; a study's records, samples and pages live in studies/<study>/."""
    found = []
    for folder in ("h2o", "analysis", "tools"):
        for p in sorted((REPO / folder).rglob("*")):
            rel = p.relative_to(REPO).as_posix()
            skipped = any(part in OUTPUTS or part.endswith(".egg-info") for part in p.relative_to(REPO).parts) \
                or any(rel == o or rel.startswith(o + "/") for o in OUTPUTS)
            if p.is_file() and p.suffix != ".py" and not skipped:
                found.append(rel)
    assert sorted(set(found) - NOT_PYTHON) == []
    assert NOT_PYTHON <= set(found)  # the exceptions are real files, not stale names


def test_each_study_has_one_home():
    """studies/<study>/ holds a study's study.yaml (the page's source) beside its records; docs/results/ only the
    pages made from them."""
    homes = sorted(p.parent.name for p in (REPO / "studies").glob("*/study.yaml"))
    assert {"default", "methods", "models", "niah", "quant", "ruler", "streaming_study"} <= set(homes)
    pages = {p.stem for p in (REPO / "docs" / "results").glob("*.md")} - {"index", "parity", "leaderboard"}  # leaderboard: all studies
    assert pages == set(homes)
    assert (REPO / "studies" / "parity" / "prompts.json").is_file()  # make parity's records, its page by h2o.parity
