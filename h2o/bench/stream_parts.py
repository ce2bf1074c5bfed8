"""The streaming task's model-free parts, re-exported from their home :mod:`h2o.tasks.streaming_parts`."""
from h2o.tasks.streaming_parts import *  # noqa: F401,F403 (the older home of these names)
