"""``from h2o.pipeline.plan import prepare, build, Plan``: the names of :mod:`h2o.pipeline.spec` (one run's checked
config, ``Plan`` being its :class:`~h2o.pipeline.spec.RunSpec`) under this module too, for code that imports them
from here."""
from h2o.pipeline.spec import ConfigError, PolicyError, RunSpec, build, prepare

Plan = RunSpec

__all__ = ["Plan", "RunSpec", "prepare", "build", "ConfigError", "PolicyError"]
