"""The streaming task's command line, re-exported from its home :mod:`h2o.tasks.streaming_cli` (run it as
``python -m h2o.bench.streaming``)."""
from h2o.tasks.streaming_cli import *  # noqa: F401,F403 (the older home of these names)
