"""Package layout for setuptools (metadata: pyproject.toml). conf/ (Hydra configs) and tasks/ (lm-eval task YAMLs)
stay at the repository root for development and go into a wheel as h2o/conf and h2o/lm_tasks."""
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent


def data(folder: str) -> list[str]:
    return sorted(str(p.relative_to(ROOT / folder)) for p in (ROOT / folder).rglob("*") if p.is_file()
                  and "__pycache__" not in p.parts)


setup(
    packages=[*find_packages(include=["h2o", "h2o.*", "analysis", "analysis.*"]), "h2o.conf", "h2o.lm_tasks"],
    package_dir={"h2o.conf": "conf", "h2o.lm_tasks": "tasks"},
    package_data={"h2o.conf": data("conf"), "h2o.lm_tasks": data("tasks"), "analysis": ["paper_results.csv"]},
)
