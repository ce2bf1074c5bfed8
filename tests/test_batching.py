"""Batch size ``auto`` (h2o.tasks.batching): bad values fail before anything loads; the CUDA rule (measured cost of
one sequence, free memory, one checked batch, halved on out-of-memory) with a stand-in for torch.cuda; the CPU
rule; and no metric changes between batch 1 and ``auto`` (perplexity, lm-eval multiple choice, greedy
summarization), the size used and how it was chosen in metrics.json."""
from __future__ import annotations

import json

import pytest
import torch

from h2o.core.policies import make_policy
from h2o.core.validate import ConfigError
from h2o.tasks import batching
from h2o.tasks.batching import CPU_BATCH, HEADROOM, check_batch_size, choose, from_free_memory
from tests.refusal import refusal

MIB = 2**20


class FakeCuda:
    """torch.cuda's memory calls for ``devices``: ``free`` bytes free each, a batch-1 step peaking ``per`` above the
    allocated base; ``fits_up_to``: a larger ``step`` raises torch.OutOfMemoryError (see :meth:`step`)."""

    def __init__(self, free: dict, per: dict, fits_up_to: int = 10**9):
        self.free, self.per, self.fits_up_to, self.calls = free, per, fits_up_to, []

    def empty_cache(self):
        pass

    def memory_allocated(self, d):
        return 5 * 2**30  # the weights

    def memory_reserved(self, d):
        return 5 * 2**30 + 64 * MIB  # 64 MiB cached by the allocator, free for reuse

    def reset_peak_memory_stats(self, d):
        pass

    def max_memory_allocated(self, d):
        return self.memory_allocated(d) + self.per[d]

    def mem_get_info(self, d):
        return self.free[d], 80 * 2**30

    def step(self, b):
        self.calls.append(b)
        if b > self.fits_up_to:
            raise torch.OutOfMemoryError(f"CUDA out of memory (batch {b})")


@pytest.mark.parametrize("value, schedule, ok", [
    (1, False, True), (64, False, True), ("auto", False, True), ("auto:4", True, True),
    (0, False, False), (-2, False, False), (True, False, False), (1.5, False, False), (None, False, False),
    ("abc", False, False), ("auto:4", False, False), ("auto:0", True, False), ("auto:x", True, False),
    ("auto:", True, False), ("8", False, False)])
def test_check_batch_size(value, schedule, ok):
    if ok:
        check_batch_size(value, schedule=schedule)
        return
    with pytest.raises(ConfigError) as err:
        check_batch_size(value, schedule=schedule)
    assert str(err.value).startswith(f"task.batch_size={value!r}: allowed: a positive int, auto")
    assert ("auto:N" in str(err.value)) == schedule


def test_cuda_rule_estimates_from_free_memory_checks_and_halves():
    # 10 GiB free + 64 MiB cached, 300 MiB per sequence: 0.9 x 10304 MiB / 300 MiB = 30.9 -> 30
    fake = FakeCuda({"cuda:0": 10 * 2**30}, {"cuda:0": 300 * MIB})
    s = from_free_memory(fake.step, ["cuda:0"], 64, fake)
    assert (s.size, s.rule, fake.calls) == (30, "cuda_memory", [1, 30])
    assert "= 30, at most 64: 30" in s.how and "300.0 MiB per sequence" in s.how and "10.06 GiB free" in s.how
    # capped by the items; then out of memory at the check: halved until it fits
    fake = FakeCuda({"cuda:0": 10 * 2**30}, {"cuda:0": 300 * MIB}, fits_up_to=7)
    s = from_free_memory(fake.step, ["cuda:0"], 20, fake)
    assert (s.size, fake.calls) == (5, [1, 20, 10, 5])
    assert "out of memory at 20, 10: 5" in s.how
    # a model over two GPUs is sized by the tighter one (free / cost)
    fake = FakeCuda({"cuda:0": 40 * 2**30, "cuda:1": 8 * 2**30}, {"cuda:0": 100 * MIB, "cuda:1": 400 * MIB})
    s = from_free_memory(fake.step, ["cuda:0", "cuda:1"], 64, fake)
    assert s.size == int(HEADROOM * (8 * 1024 + 64) / 400) == 18 and s.how.startswith("auto on cuda:1")
    # an error other than out-of-memory is not swallowed
    def broken(b):
        if b > 1:
            raise ValueError("not memory")
    with pytest.raises(ValueError):
        from_free_memory(broken, ["cuda:0"], 64, FakeCuda({"cuda:0": 2**30}, {"cuda:0": MIB}))


def test_cpu_rule_and_fixed_sizes():
    cpu_model = torch.nn.Linear(2, 2)
    never = lambda b: pytest.fail("the CPU rule probes nothing")  # noqa: E731
    assert choose("auto", cpu_model, never, 100).size == CPU_BATCH
    assert choose("auto", cpu_model, never, 3).size == 3  # at most the items
    s = choose(5, cpu_model, never, 100)
    assert (s.size, s.rule) == (5, "fixed")
    assert batching.record("auto", []) == {"batch_size": None, "batch_sizing": {"requested": "auto", "rule": None,
                                                                                 "sizes": [], "how": ""}}


# ------------------------------------------------------------------------------ batch 1 == auto, tiny model
@pytest.fixture(scope="module")
def tiny():
    from h2o.assets.model_spec import ModelSpec

    return ModelSpec("tiny-llama", "tiny:llama").load()


@pytest.fixture
def fake_gpu(tiny, monkeypatch):
    """The tiny CPU model seen as on cuda:0 with 1 GiB free and 100 MiB per sequence (estimate 9), whose forward
    runs out of memory above 4 rows: ``auto`` checks 9 (or the item count), halves to 4."""
    model, _ = tiny
    fake = FakeCuda({"cuda:0": 2**30 - 64 * MIB}, {"cuda:0": 100 * MIB})
    for name in ("empty_cache", "memory_allocated", "memory_reserved", "reset_peak_memory_stats",
                 "max_memory_allocated", "mem_get_info"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    monkeypatch.setattr(batching, "cuda_devices", lambda m: ["cuda:0"])

    def oom_above_4(module, args, kwargs):
        ids = args[0] if args else kwargs.get("input_ids")
        if ids.shape[0] > 4:
            raise torch.OutOfMemoryError(f"CUDA out of memory ({ids.shape[0]} rows)")

    handle = model.register_forward_pre_hook(oom_above_4, with_kwargs=True)
    yield fake
    handle.remove()


def test_perplexity_batch_one_equals_auto(tiny, fake_gpu):
    from h2o.tasks.perplexity import PerplexityTask

    model, tok = tiny
    runs = {bs: PerplexityTask("austen_ppl", window=64, n_windows=10, stride=3, batch_size=bs).run(
        model, tok, make_policy("h2o", budget=0.3), "simulated", 0) for bs in (1, "auto")}
    assert runs[1].info["batch_size"] == 1 and runs[1].info["batch_sizing"]["rule"] == "fixed"
    auto = runs["auto"].info
    assert (auto["batch_size"], auto["batch_sizing"]["rule"]) == (4, "cuda_memory")
    assert auto["batch_sizing"]["how"].endswith("= 9, at most 10, out of memory at 9: 4")
    assert [s["nll"] for s in runs["auto"].samples] == pytest.approx([s["nll"] for s in runs[1].samples], rel=1e-5)
    assert runs["auto"].metrics == pytest.approx(runs[1].metrics, rel=1e-5)


def test_lm_eval_batch_one_equals_auto(tiny, fake_gpu):
    """lm-eval's scheduler asks H2OLM._detect_batch_size (auto:2: at 2 or 3 points, longest requests first)."""
    from h2o.tasks.multiple_choice import LmEvalTask

    model, tok = tiny
    runs = {bs: LmEvalTask("bb_piqa", "bb_piqa", "tasks", shots=0, limit=4, batch_size=bs).run(
        model, tok, make_policy("h2o", budget=0.3), "simulated", 0) for bs in (1, "auto:2")}
    one, auto = ([s["loglikelihoods"] for s in runs[bs].samples] for bs in (1, "auto:2"))
    assert torch.allclose(torch.tensor(sum(one, [])), torch.tensor(sum(auto, [])), atol=1e-4)
    assert runs["auto:2"].metrics == pytest.approx(runs[1].metrics, rel=1e-5)
    assert runs["auto:2"].info["mean_seq_len"] == runs[1].info["mean_seq_len"]  # the probe's rows not counted
    sizing = runs["auto:2"].info["batch_sizing"]
    # lm-eval sizes again every len(requests) // 2 requests: 2 or 3 sizings, each at most what is left
    assert sizing["requested"] == "auto:2" and sizing["rule"] == "cuda_memory" and len(sizing["sizes"]) in (2, 3)
    assert sizing["sizes"][0] == 4 and all(1 <= s <= 4 for s in sizing["sizes"])  # out of memory above 4
    first = sizing["how"].split("; ")[0]  # the longest requests: estimate 9, at most the requests, halved to 4
    assert "= 9, at most " in first and ", out of memory at " in first and first.endswith(": 4")
    assert runs["auto:2"].info["batch_size"] == 4


def test_greedy_summarization_batch_one_equals_auto(tiny, fake_gpu):
    from h2o.tasks.summarization import SummarizationTask

    model, tok = tiny
    task = lambda bs: SummarizationTask("bb_xsum", "bb_xsum", shots=0, limit=3, max_new_tokens=4,  # noqa: E731
                                        doc_max_words=40, greedy=True, batch_size=bs)
    runs = {bs: task(bs).run(model, tok, make_policy("h2o", budget=0.5), "real", 0) for bs in (1, "auto")}
    assert (runs["auto"].info["batch_size"], runs["auto"].info["batch_sizing"]["rule"]) == (3, "cuda_memory")
    assert runs["auto"].info["batch_sizing"]["how"].endswith("= 9, at most 3: 3")
    assert [s["generation"] for s in runs["auto"].samples] == [s["generation"] for s in runs[1].samples]


def test_run_records_the_batch_size_used(tmp_path, monkeypatch):
    from h2o.pipeline.run import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("H2O_RUNS", raising=False)
    assert main(["model=tiny-llama", "threads=1", "task=austen_ppl", "task.window=64", "task.n_windows=3",
                 "task.batch_size=auto", "policy.budget=0.5"]) == 0
    (record,) = [json.loads(p.read_text()) for p in (tmp_path / "runs").rglob("metrics.json")]
    assert record["batch_size"] == 3 and record["batch_sizing"]["requested"] == "auto"
    assert record["batch_sizing"]["rule"] == "cpu_default" and record["device"] == "cpu"


BAD = [("bb_copa", "0", "0"), ("bb_copa", "auto:0", "'auto:0'"), ("bb_copa", "null", "None"),
       ("austen_ppl", "abc", "'abc'"), ("austen_ppl", "auto:2", "'auto:2'"), ("bb_xsum", "-1", "-1")]


@pytest.mark.parametrize("task, value, shown", BAD, ids=[f"{t}-{v}" for t, v, _ in BAD])
def test_bad_batch_size_one_line_exit_2_before_load(task, value, shown, tmp_path, monkeypatch, capsys):
    import h2o.assets.models as models
    from h2o.pipeline.run import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("loaded before the bad input"))
    assert main(["model=tiny-llama", f"task={task}", f"task.batch_size={value}"]) == 2
    err = refusal(capsys)
    assert err.startswith(f"error: task.batch_size={shown}: allowed: a positive int, auto"), err
    assert len(err.splitlines()) == 1
    assert ("auto:N" in err) == (task == "bb_copa")  # lm-eval's auto:N: multiple choice only
    assert not (tmp_path / "runs").exists()


def test_lm_eval_cli_bad_batch_size(tmp_path, monkeypatch, capsys):
    from lm_eval.models.huggingface import HFLM

    from h2o.tasks import lm_eval_cli

    monkeypatch.setattr(HFLM, "__init__", lambda *a, **k: pytest.fail("model loaded"))
    monkeypatch.setattr("sys.argv", ["lm_eval_cli", "--model", "h2o", "--model_args", "pretrained=tiny:llama",
                                     "--tasks", "bb_copa", "--include_path", "tasks", "--batch_size", "auto:0",
                                     "--output_path", str(tmp_path / "out")])
    assert lm_eval_cli.main() == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: --batch_size='auto:0': allowed: a positive int, auto, auto:N (N >= 1 sizings as the " \
                  "requests get shorter)"
