"""python -m h2o.bench prefill: bad input exits 2 in one line before any model loads; the table's ratios and targets
come from the runs as measured (medians, sdpa's seconds at the same length, met by the CPU-time ratio)."""
import pytest

from h2o.bench import prefill
from h2o.bench.__main__ import main as bench_main


@pytest.mark.parametrize("args, needle", [
    (["--lengths", "0"], "--lengths='0'"),
    (["--policies", "h2o,nope"], "--policies: 'nope' unknown"),
    (["--baselines", "flash"], "--baselines: 'flash' unknown"),
    (["--budget", "1.5"], "--budget=1.5"),
    (["--threads", "0"], "--threads=0"),
])
def test_bad_input_exits_2_in_one_line(capsys, monkeypatch, args, needle):
    monkeypatch.setattr(prefill, "child", lambda *a: pytest.fail("measured despite bad input"))
    assert bench_main(["prefill", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err


def test_the_table_reads_the_runs():
    runs = [{"config": c, "prompt": 1024, "prefill_s": s, "prefill_cpu_s": cpu, "peak_added_mib": m}
            for c, s, cpu, m in [("sdpa", 2.0, 1.0, 10.0), ("sdpa", 4.0, 1.2, 12.0), ("h2o", 9.0, 2.2, 20.0),
                                 ("knorm", 3.0, 1.21, 10.0)]]
    runs.append({"config": "tova", "prompt": 1024, "error": "exit 1: boom"})
    rows = {r["config"]: r for r in prefill.summarize(runs)}
    assert rows["sdpa"]["prefill_s"] == 3.0 and rows["sdpa"]["ratio_sdpa"] == 1.0 and rows["sdpa"]["runs"] == 2
    assert rows["h2o"]["ratio_sdpa"] == 3.0 and rows["h2o"]["cpu_ratio_sdpa"] == 2.0 and rows["h2o"]["met"]
    assert rows["knorm"]["cpu_ratio_sdpa"] == 1.1 and rows["knorm"]["met"]  # 1.21 / 1.1
    assert rows["tova"]["error"] == "exit 1: boom"
    text = prefill.table(prefill.summarize(runs))
    assert "| 1,024 | h2o | 9.00 | 3.00 | 2.20 | 2.00 | 20.0 | <= 2.0x | yes |" in text
    assert "| 1,024 | tova | exit 1: boom |" in text
