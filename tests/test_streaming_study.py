"""analysis.streaming_study: window samples -> table, blocks, figure (synthetic samples, values checked)."""
import json
import math

from analysis import streaming_study as ss


def samples(ppls, window=1000):
    return [{"tokens": window * (i + 1), "nll": math.log(p), "chunk_ppl": p} for i, p in enumerate(ppls)]


def write(root, label, budget, chunk, ppls):
    f = root / f"{label}_{budget}_c{chunk}.jsonl"
    f.write_text("".join(json.dumps(s) + "\n" for s in samples(ppls)))


def test_blocks_and_behind_from():
    base = samples([20.0] * 20)
    h2o = samples([19.0] * 10 + [22.0] * 10)  # ahead by 5% for 10 windows, then behind by 10%
    b = ss.blocks(h2o, base)
    assert [(lo, hi, k, w) for lo, hi, _, k, w in b] == [(0, 10000, 10, 10), (10000, 20000, 0, 10)]
    assert math.isclose(b[0][2], -5.0) and math.isclose(b[1][2], 10.0)
    assert ss.behind_from(h2o, base) == 12000  # the 3-window mean turns at the window ending at 12k
    assert ss.behind_from(base, h2o) is None
    assert math.isclose(ss.overall(h2o), math.sqrt(19.0 * 22.0))


def test_table_and_figure_use_common_windows(tmp_path):
    root = tmp_path / "live"
    root.mkdir()
    write(root, "streaming_llm", 96, 32, [20.0] * 12)
    write(root, "h2o", 96, 32, [19.0] * 6 + [21.0] * 8)  # 14 windows: only the 12 shared ones count
    write(root, "local", 96, 32, [40.0] * 12)
    data = ss.load(root)
    assert list(data) == [(32, 96)] and ss.common(data[(32, 96)]) == 12
    md = ss.table(data)
    assert "h2o vs streaming_llm: lower window perplexity in 6 of 12 windows; behind (3-window mean) from 8000" in md
    assert "0-10k: -1.0% (6/10 ahead); 10-12k: +5.0% (0/2 ahead)" in md
    assert ss.main([str(root), "--out", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "study.png").stat().st_size > 1000


def test_no_samples_is_an_error(tmp_path, capsys):
    assert ss.main([str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    assert "no streaming run records and no live window samples" in capsys.readouterr().err


def record(root, policy, chunk, ppls, times, **options):
    """A streaming run record as the runner writes it (metrics.json + samples.jsonl)."""
    d = root / policy / f"c{chunk}" / "_".join(f"{k}{v}" for k, v in options.items())
    d.mkdir(parents=True)
    rows = [{**s, "time_s": t} for s, t in zip(samples(ppls), times)]
    (d / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    proto = {"text": "austen", "tokens": 1000 * len(ppls), "chunk": chunk, "positions": "cache", "window": 1000,
             "shots": 0, "scoring": None, "add_bos_token": True}
    rec = {"experiment": "streaming", "model": "smollm2-135m", "task": "bench_streaming", "task_kind": "streaming",
           "policy": policy, "budget": 96, "heavy": 32, "recent": 64, "shots": 0, "semantics": "real", "seed": 0,
           "n_samples": len(ppls), "wall_s": sum(times), "protocol": proto,
           "policy_options": {"budget": 96, "heavy_share": 1 / 3, **options},
           "metrics": {"ppl": ss.overall(rows), "tokens": 1000 * len(ppls)}}
    (d / "metrics.json").write_text(json.dumps(rec))


def test_run_records_labels_chunk_comparison_and_the_token_by_token_pick(tmp_path):
    """The experiment's records: labelled by policy plus the settings that differ between that policy's records;
    each chunked run beside its token-by-token run; the tables' cell rule takes token by token over a newer
    chunked record of the same cell; a record of the former CLI (``--runs``) is still read."""
    from analysis.figures import one_each
    from analysis.records import load_runs

    root = tmp_path / "runs"
    record(root, "streaming_llm", 1, [20.0] * 3, [10.0] * 3)
    record(root, "h2o", 1, [19.0] * 3, [10.0] * 3, score="sum")
    record(root, "h2o", 1, [21.0] * 3, [10.0] * 3, score="mean")
    record(root, "h2o", 32, [18.0] * 3, [0.5] * 3, score="sum")
    data = ss.load(root)
    assert sorted(data) == [(1, 96), (32, 96)]
    assert sorted(data[(1, 96)]) == ["h2o:score=mean", "h2o:score=sum", "streaming_llm"]
    md = ss.chunk_comparison(data)
    assert "- h2o:score=sum at 96 tokens, chunks of 32 vs token by token: perplexity 18.000 vs 19.000 (-5.26%), " \
           "20.0x the speed (3 windows)" in md
    assert "h2o:score=sum vs streaming_llm: lower window perplexity in 3 of 3 windows" in ss.table(data)
    pick = one_each(load_runs(root), ["experiment", "policy", "budget", "policy_options.score"], "ppl")
    assert sorted(zip(pick["policy"], pick["protocol.chunk"])) == [("h2o", 1), ("h2o", 1), ("streaming_llm", 1)]
    old = root / "cli" / "h2o_heavy_share1-2_96_c32_cache"  # a record of the former CLI (--runs): still read
    old.mkdir(parents=True)
    (old / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in samples([17.0] * 3)))
    (old / "metrics.json").write_text(json.dumps({"task_kind": "streaming", "task": "austen", "policy": "h2o",
                                                  "label": "h2o:heavy_share=1/2", "budget": 96, "chunk": 32,
                                                  "model": "smollm2-135m", "metrics": {"ppl": 17.0}}))
    assert sorted(ss.load(root)[(32, 96)]) == ["h2o:heavy_share=1/2", "h2o:score=sum"]
