"""Without a GPU, Triton kernels run under the interpreter (set before anything imports triton); every test leaves
the process as it found it (the last fixture)."""
import inspect
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.register_assert_rewrite("tests.golden", "tests.two_paths")  # their shared checks fail with pytest's detail


def patch_language_once_per_launch() -> None:
    """Triton 3.9's interpreter re-patches ``triton.language`` (``inspect.getmembers`` over the module) on every
    device-function call, ``tl.sum`` and ``tl.max`` included: half the time of tests/test_row_kernel.py (the
    topk_h2 kernel's bisection sums 33 times a row). A nested call sees the language its launch patched already
    (the interpreter never undoes a nested patch), so patch each language once per launch. Without these internals
    (another Triton): nothing changes."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    patch, launch = getattr(interpreter, "_patch_lang", None), getattr(interpreter.GridExecutor, "__call__", None)
    if patch is None or launch is None or not hasattr(interpreter, "_LangPatchScope"):
        return
    patched: list[set] = []  # inside a launch: the language sets (tl, tl.core) it has patched

    def patch_once(fn):
        langs = frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))
        if patched and langs in patched[-1]:
            return interpreter._LangPatchScope()  # nothing to undo
        if patched:
            patched[-1].add(langs)
        return patch(fn)

    def launch_fresh(self, *args, **kwargs):
        patched.append(set())
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.pop()

    interpreter._patch_lang = patch_once
    interpreter.GridExecutor.__call__ = launch_fresh


if os.environ.get("TRITON_INTERPRET") == "1":
    patch_language_once_per_launch()


# Libraries that configure log handlers on the streams of the moment, or set the environment, when first imported
# (datasets, transformers, huggingface_hub, submitit, lm-eval, scikit-learn, absl through rouge-score): imported here, at
# collection, not inside a test (whose captured streams close after it); submitit's and absl's handlers then write to
# the stream current at each line (h2o.cli.process)
import datasets  # noqa: E402,F401  (sets its logger's level on import: a test that imports it first changed it)
import lm_eval  # noqa: E402,F401  (also sets HF_XET_HIGH_PERFORMANCE in the environment on import)
import sklearn  # noqa: E402,F401  (lm-eval's metrics import it; it sets KMP_DUPLICATE_LIB_OK, KMP_INIT_AT_FORK)
import transformers  # noqa: E402,F401
import transformers.generation.utils  # noqa: E402,F401  (its continuous batching module adds a stderr handler)

from h2o.cli.process import import_submitit, rouge_scorer  # noqa: E402

import_submitit()
rouge_scorer()

# BIG-bench's task files: every test reads stand-ins written here in BIG-bench's format (tests/bigbench_standins.py),
# named in H2O_BIGBENCH for this process and every process a test starts; the real files (the user's H2O_BIGBENCH or
# <cache>/bigbench, where present) are read only by the tests that ask for them (the real_bigbench fixture)
import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

from h2o.assets.fetch import BIGBENCH_ENV, bigbench_here  # noqa: E402
from tests import bigbench_standins  # noqa: E402

# the user's own H2O_BIGBENCH, kept for the xdist workers (which inherit the stand-ins' value from the controller)
os.environ.setdefault("H2O_TEST_REAL_BIGBENCH", os.environ.get(BIGBENCH_ENV, ""))
_REAL_BIGBENCH, _REAL_MISSING = bigbench_here(os.environ["H2O_TEST_REAL_BIGBENCH"])  # as h2o.assets.fetch reads them
_REAL_BIGBENCH = None if _REAL_MISSING else _REAL_BIGBENCH
_STANDINS = bigbench_standins.write(Path(tempfile.mkdtemp(prefix="h2o-bigbench-standins-")))
atexit.register(shutil.rmtree, _STANDINS, True)
os.environ[BIGBENCH_ENV] = str(_STANDINS)


@pytest.fixture
def real_bigbench(monkeypatch):
    """The real BIG-bench task files, named in H2O_BIGBENCH for this test; skipped (one line) where they are absent."""
    if _REAL_BIGBENCH is None:
        pytest.skip(f"BIG-bench's real task files are not here: set {BIGBENCH_ENV}=<dir> to check them "
                    f"(docs/testing.md)")
    monkeypatch.setenv(BIGBENCH_ENV, str(_REAL_BIGBENCH))
    return _REAL_BIGBENCH


@pytest.fixture(autouse=True)
def leaves_the_process_as_it_found_it(request):
    """Fail the test that leaves process state changed (log handlers, sys.argv and streams, environment, working
    folder, torch's threads and default dtype: h2o.cli.process), then put it back so the next test starts clean.
    Autouse, so it is set up first and torn down last: monkeypatch and capsys have undone their changes by then."""
    from h2o.cli.process import changed, restore, snapshot

    before = snapshot()
    yield
    after = snapshot()
    diff = changed(before, after)
    if diff:
        restore(before)
        pytest.fail(f"{request.node.nodeid} left process state changed: {', '.join(diff)} (an entry point runs "
                    f"inside h2o.cli.process.kept; a test restores what it changes, e.g. with monkeypatch)",
                    pytrace=False)


@pytest.fixture
def hydra_ctx():
    """Hydra's compose API on the project's configs, for one test only: a module-wide context would still be open
    when a later test of the module (in shuffled order) calls h2o-run's main, which must start Hydra itself."""
    from hydra import initialize_config_dir

    from h2o.assets.paths import CONF

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        yield
