"""``python -m h2o.bench.streaming``: the streaming task's command line (:mod:`h2o.tasks.streaming_cli`).

The streaming task is a task, not a measurement: it lives in :mod:`h2o.tasks.streaming` (with its model-free
parts in :mod:`h2o.tasks.streaming_parts`). Its names are re-exported here, where they lived before, so code and
run configs that name ``h2o.bench.streaming.StreamingTask`` keep working.
"""
import sys

from h2o.tasks.streaming import *  # noqa: F401,F403 (the older home of these names)

if __name__ == "__main__":
    from h2o.tasks.streaming_cli import main

    sys.exit(main())
