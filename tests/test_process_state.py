"""Process state a test or an entry point must leave as it found it (h2o.cli.process; docs/testing.md), and the
module-level caches that must not depend on which test ran first."""
import io
import logging
import os
import sys

import torch

from h2o.cli.process import CurrentStream, changed, import_submitit, kept, snapshot
from h2o.core.policies.base import const


def test_kept_puts_back_what_an_entry_point_changes(tmp_path):
    before = snapshot()
    root, threads = logging.getLogger(), torch.get_num_threads()
    with kept():
        root.addHandler(logging.StreamHandler(io.StringIO()))  # Hydra's logging config
        root.setLevel(logging.DEBUG)
        sys.argv = ["h2o-run", "task=x"]
        os.environ["H2O_TEST_LEAK"] = "1"
        os.chdir(tmp_path)
        torch.set_num_threads(1 if threads > 1 else 2)
        torch.set_default_dtype(torch.float64)
    assert changed(before, snapshot()) == []
    assert "H2O_TEST_LEAK" not in os.environ and torch.get_default_dtype() == torch.float32


def test_changed_names_each_leak_and_a_handler_on_a_closed_stream():
    before = snapshot()
    stream, handler = io.StringIO(), None
    try:
        os.environ["H2O_TEST_LEAK"] = "1"
        handler = logging.StreamHandler(stream)
        logging.getLogger("h2o.test.fresh").addHandler(handler)  # a logger created now: no change while open
        assert changed(before, snapshot()) == ["environ (H2O_TEST_LEAK)"]
        stream.close()  # pytest closes a test's captured stream after it
        assert changed(before, snapshot()) == ["environ (H2O_TEST_LEAK)", "logger 'h2o.test.fresh'"]
    finally:
        del os.environ["H2O_TEST_LEAK"]
        logging.getLogger("h2o.test.fresh").removeHandler(handler)


def test_submitit_logs_to_the_stream_current_at_each_line(monkeypatch):
    import_submitit()
    handlers = logging.getLogger("submitit").handlers
    assert handlers and all(isinstance(h.stream, CurrentStream) for h in handlers)
    out = io.StringIO()
    monkeypatch.setattr(sys, "stderr", out)
    logging.getLogger("submitit").warning("a line")
    assert "a line" in out.getvalue()


def test_const_made_under_inference_mode_enters_a_recorded_forward():
    """The cached constant, first made under torch.inference_mode (a task's run), still enters a forward that
    autograd records (the README's block, run after a task in the same process)."""
    with torch.inference_mode():
        c = const(0.123, torch.float32, torch.device("cpu"))
    x = torch.ones(3, requires_grad=True)
    (x * c).sum().backward()
    assert not c.is_inference() and torch.allclose(x.grad, torch.full((3,), 0.123))


ABSL_SEQUENCE = """
import io, logging.config, sys
first = io.StringIO()  # the stderr of the moment rouge-score (and with it absl) is imported
sys.stderr = first
if sys.argv[1] == "package":
    from h2o.cli.process import rouge_scorer
    rouge_scorer()
else:
    from rouge_score import rouge_scorer
sys.stderr = io.StringIO()  # a later moment's stderr (pytest: the next test's capture)
logging.config.dictConfig({"version": 1, "disable_existing_loggers": False,  # what Hydra does at every run
                           "handlers": {"c": {"class": "logging.StreamHandler", "stream": "ext://sys.stdout"}},
                           "root": {"handlers": ["c"]}})
print(first.closed)
"""


def test_rouge_scorer_leaves_the_stderr_of_its_import_open_when_logging_shuts_down():
    """absl, which rouge-score imports, closes the stream of its import when logging shuts its handlers down unless
    it is the sys.stderr of that later moment: under pytest the captured stderr of a whole worker. The package's
    import (h2o.cli.process.rouge_scorer) points absl's handler at the current stderr instead; the plain import does
    not, which is what makes this test able to fail."""
    import subprocess

    def closed(way: str) -> str:
        return subprocess.run([sys.executable, "-c", ABSL_SEQUENCE, way], capture_output=True, text=True,
                              check=True).stdout.strip()

    assert (closed("package"), closed("plain")) == ("False", "True")
