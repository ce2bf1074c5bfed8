"""``make gpu-check`` runs on a GPU; here its checks run small on the CPU, and bad input fails at once."""
import json

from h2o.bench import gpu_check


def test_gpu_check_quick_on_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--device", "cpu", "--quick", "--json", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["ok"] and rec["equivalence_ok"] and rec["finished"]
    assert {r["dtype"] for r in rec["equivalence"]} == {"fp32", "bf16"}
    assert len(rec["equivalence"]) == 4 * 2 * 2  # archs x dtypes x (h2o, local)
    assert all(r["syncs_per_step"] == 1 for r in rec["launches"]["decode"])
    assert set(rec["speed"]["decode_vs_sdpa"]) == {"h2o", "local"}
    assert rec["speed"]["sdpa_dynamic_s_per_step"] > 0
    mb = rec["max_batch"]  # on the CPU an estimate, labelled so; full and h2o side by side with the KV-only figure
    assert mb["method"] == "estimate" and set(mb["policies"]) == {"full 1", "h2o 0.2"}
    full, h2o = mb["policies"]["full 1"], mb["policies"]["h2o 0.2"]
    assert h2o["kv_bytes_per_seq"] < full["kv_bytes_per_seq"] and full["kv_only_batch"] >= full["largest_batch"] >= 1
    assert [r["config"] for r in rec["prefill"]["rows"]] == ["sdpa", "eager", "full", "h2o", "snapkv"]


def test_the_prefill_section_on_the_cpu():
    """Per length: transformers' sdpa and eager (no flash attention here), then the policies, run with sdpa;
    seconds, ratios to sdpa's, no GPU memory on the CPU; the model's attention as loaded afterwards."""
    from h2o.assets.models import tiny_model

    model = tiny_model("llama")
    rec = gpu_check.prefill(model, "tiny-llama", "cpu", lengths=(48, 96), policies=("knorm", "h2o"))
    rows = rec["rows"]
    assert [(r["prompt"], r["config"]) for r in rows] == [(n, c) for n in (48, 96)
                                                          for c in ("sdpa", "eager", "knorm", "h2o")]
    assert not rec["flash_attention"] and rec["policies_run_with"] == "sdpa"
    assert all(r["prefill_s"] > 0 and r["gpu_peak_added_mib"] is None for r in rows)
    assert [r["attention"] for r in rows[:4]] == ["sdpa", "eager", "sdpa", "sdpa"] and rows[0]["x_sdpa"] == 1
    assert model.config._attn_implementation == "eager"


def test_gpu_check_without_cuda_fails_in_one_line(tmp_path, capsys):
    out = tmp_path / "x.json"
    assert gpu_check.main(["--device", "tpu", "--json", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--device='tpu'" in err and err.count("\n") == 1 and not out.exists()


def test_gpu_check_records_a_failing_section_and_runs_the_others(tmp_path, monkeypatch):
    def broken(device):
        raise RuntimeError("triton: no kernel\nsecond line")
    monkeypatch.setattr(gpu_check, "launches", broken)
    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--device", "cpu", "--quick", "--json", str(out)]) == 1
    rec = json.loads(out.read_text())
    assert rec["launches"] == {"error": "RuntimeError: triton: no kernel"}
    assert rec["finished"] and not rec["ok"] and rec["equivalence_ok"]
    assert rec["speed"]["sdpa_dynamic_s_per_step"] > 0 and rec["max_batch"]["method"] == "estimate"
