"""The largest-batch search (doubling, then bisection) against a fake run that runs out of memory above a threshold,
and the CPU estimate on the tiny model."""
import math

import pytest
import torch

from h2o.bench.max_batch import cpu_estimate, largest_batch_under_cap, search_largest
from h2o.bench.variants import Variant


def fake(threshold, calls):
    """A run that fits up to ``threshold`` sequences and raises CUDA's out-of-memory error above."""
    def try_batch(b):
        calls.append(b)
        if b > threshold:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory at batch {b}")
        return True
    return try_batch


@pytest.mark.parametrize("threshold", [1, 2, 3, 5, 8, 17, 100, 511, 1000])
def test_search_finds_the_exact_threshold(threshold):
    calls = []
    best, trials = search_largest(fake(threshold, calls), cap=1024)
    assert best == threshold
    assert [b for b, _ in trials] == calls and all(ok == (b <= threshold) for b, ok in trials)
    assert len(calls) <= 2 * math.ceil(math.log2(threshold + 1)) + 1  # doubling + bisection, no linear scan


def test_search_sequence_and_edges():
    calls = []
    assert search_largest(fake(5, calls), cap=64)[0] == 5
    assert calls == [1, 2, 4, 8, 6, 5]  # doubling to the first failure, then bisection between 4 and 8
    assert search_largest(fake(0, []), cap=64)[0] == 0  # batch 1 does not fit
    calls = []
    assert search_largest(fake(10**6, calls), cap=48)[0] == 48 and calls == [1, 2, 4, 8, 16, 32, 48]
    assert search_largest(lambda b: b <= 6, cap=64)[0] == 6  # a plain False works as well as the error


def test_search_lets_other_errors_through():
    def broken(b):
        raise RuntimeError("not an OOM")
    with pytest.raises(RuntimeError, match="not an OOM"):
        search_largest(broken)


def test_cpu_estimate_formula():
    est = cpu_estimate(limit=10_000, base=1_000, growth={1: 600, 3: 1_400}, kv_per_seq=100)
    assert est["bytes_per_seq"] == 400 and est["fixed_bytes"] == 200
    assert est["largest_batch"] == (10_000 - 1_000 - 200) // 400  # 22
    # a slope below the KV bytes of one sequence (noise) is raised to them
    assert cpu_estimate(10_000, 1_000, {1: 500, 2: 500}, 300)["bytes_per_seq"] == 300


def test_largest_batch_on_cpu_is_an_estimate():
    from h2o.assets.models import tiny_model
    model = tiny_model("llama_gqa")
    recs = largest_batch_under_cap(model, [Variant("policy", "full"), Variant("policy", "h2o", 0.2)], 40, 3,
                                   fraction=0.01)
    full, h2o = (r["metrics"] for r in recs)
    assert all(r["max_batch_method"] == "estimate" for r in recs)
    assert h2o["kv_bytes_per_seq"] < full["kv_bytes_per_seq"]
    for m in (full, h2o):
        assert m["kv_only_batch"] == m["limit_bytes"] // m["kv_bytes_per_seq"]
        assert m["largest_batch"] == max(0, (m["limit_bytes"] - m["base_bytes"] - m["fixed_bytes"])
                                         // m["bytes_per_seq"])
        assert m["bytes_per_seq"] >= m["kv_bytes_per_seq"]
        assert m["base_bytes"] == m["runtime_bytes"] + m["weight_bytes"] and m["runtime_bytes"] > 2**20


def test_the_cpu_estimate_does_not_read_what_ran_before_in_the_process():
    """The base is a fresh interpreter's resident memory (a subprocess) plus the weights, not this process's: with
    a ballast held here that puts the process above the limit, the estimate is unchanged and at least 1 (the
    flaky test_gpu_check_quick_on_cpu: a test worker's earlier tests made it 0)."""
    from h2o.assets.models import tiny_model
    from h2o.assets.resources import rss_bytes
    from h2o.bench.max_batch import machine_bytes, runtime_bytes

    model = tiny_model("llama")
    fraction = (runtime_bytes() + 64 * 2**20) / machine_bytes()  # room for 64 MiB of scratch and cache
    before = largest_batch_under_cap(model, [Variant("policy", "full")], 16, 2, fraction=fraction)[0]["metrics"]
    ballast = torch.ones(max(before["limit_bytes"] - rss_bytes(), 0) // 4 + 2**22)  # touched: resident
    after = largest_batch_under_cap(model, [Variant("policy", "full")], 16, 2, fraction=fraction)[0]["metrics"]
    assert after["rss_start_bytes"] > after["limit_bytes"] > after["base_bytes"]  # the old formula gave 0 here
    assert after["base_bytes"] == before["base_bytes"] and after["largest_batch"] >= 1 and before["largest_batch"] >= 1
    del ballast


def test_cuda_path_with_a_fake_gpu(monkeypatch):
    """The CUDA branch on the CPU: a fake GPU of 1000 bytes whose runs fail above 37 sequences; the cap is set for
    the search and set back to 1.0 afterwards (also when the search raises)."""
    from types import SimpleNamespace

    import h2o.bench.max_batch as mb
    calls, runs = [], []
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(mb, "gpu_devices", lambda model: [gpu])
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=1000))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d: calls.append((f, d)))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)

    def run_batch(model, v, P, G, b, seed=0, prefill_chunk=0):
        runs.append(b)
        if b > 37:
            raise torch.cuda.OutOfMemoryError("fake")
        return SimpleNamespace(kv_max=10 * b)

    monkeypatch.setattr(mb, "run_batch", run_batch)
    model = SimpleNamespace(parameters=lambda: iter([torch.zeros(5)]), buffers=lambda: iter([]))
    [rec] = largest_batch_under_cap(model, [Variant("policy", "full")], 16, 2, fraction=0.5, cap=1024)
    m = rec["metrics"]
    assert rec["max_batch_method"] == "measured" and m["largest_batch"] == 37 and rec["batch_size"] == 37
    assert m["limit_bytes"] == 500 and m["kv_only_batch"] == 50 and not m["capped"]
    assert runs[:1] == [1] and [b for b, _ in m["trials"]] == runs[1:]
    assert calls == [(0.5, gpu), (1.0, gpu)]
    calls.clear()
    monkeypatch.setattr(mb, "search_largest", lambda *a, **k: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        largest_batch_under_cap(model, [Variant("policy", "full")], 16, 2, fraction=0.25)
    assert calls == [(0.25, gpu), (1.0, gpu)]
