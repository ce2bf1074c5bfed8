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
