"""The needle heatmaps (analysis/niah.py) draw one protocol each: records of one policy and budget at two
compression timings, or with the question inside and after the compressed prompt, make separate figures, each with
its own record's values; two records of one key are picked by the cell rule, and the panel says so."""
import json

import pytest

import analysis.niah as niah
from analysis.protocol import annotate
from analysis.records import load_runs

LENGTHS, DEPTHS = (512, 1024), (0.1, 0.5, 0.9)


def record(root, policy, budget, found, compress=None, question=None, limit=None, name="a"):
    """A finished niah record (metrics.json, samples.jsonl) whose samples are found where ``found(length, depth)``;
    ``compress`` / ``question`` at the top level only where they are not the default, as the runner writes them."""
    samples = [{"doc_id": i, "length": n, "depth": d, "acc": float(found(n, d))}
               for i, (n, d) in enumerate((n, d) for n in LENGTHS for d in DEPTHS)]
    options = {"budget": budget, "compress": compress}
    rec = {"experiment": "methods", "model": "smollm2-135m", "task": "niah", "task_kind": "retrieval",
           "policy": policy, "budget": budget, "heavy": budget / 2, "recent": budget / 2, "shots": 0,
           "semantics": "real", "seed": 0, "evicts": policy != "full", "limit": limit, "policy_options": options,
           **({"compress": compress} if compress else {}), "scoring": None, "add_bos_token": False,
           "protocol": {"lm_eval_task": "niah", "lengths": list(LENGTHS), "limit": limit,
                        **({"question": question} if question else {})},
           "n_samples": len(samples), "metrics": {"acc": sum(s["acc"] for s in samples) / len(samples)},
           "lm_eval_task": "niah", **({"question": question} if question else {})}
    folder = root / policy / str(budget) / name
    folder.mkdir(parents=True)
    (folder / "metrics.json").write_text(json.dumps(rec))
    (folder / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))


@pytest.fixture
def drawn(monkeypatch):
    """{panel title: its table} of every panel drawn, by figure file name."""
    seen, real = {}, niah.heatmap_panel

    def panel(ax, table, title):
        seen.setdefault("current", {})[title] = table
        return real(ax, table, title)

    def save(fig, out, name):
        seen[name] = seen.pop("current")
        return [name]

    monkeypatch.setattr(niah, "heatmap_panel", panel)
    monkeypatch.setattr("analysis.plotting.save", save)
    return seen


def test_two_timings_of_one_policy_and_budget_are_two_heatmaps(tmp_path, drawn):
    record(tmp_path, "h2o", 0.2, lambda n, d: d > 0.5, name="decode")
    record(tmp_path, "h2o", 0.2, lambda n, d: n == 512, compress="prefill", name="prefill")
    assert niah.figure_niah(annotate(load_runs(tmp_path)), tmp_path / "fig") == \
        ["methods_niah_heatmap", "methods_niah_prefill_heatmap"]
    (title, decode), = drawn["methods_niah_heatmap"].items()
    (title2, prefill), = drawn["methods_niah_prefill_heatmap"].items()
    assert title == title2 == "H2O 20% (n=6)"
    assert decode.to_numpy().tolist() == [[0.0, 0.0, 1.0], [0.0, 0.0, 1.0]]  # rows 512, 1024; columns the depths
    assert prefill.to_numpy().tolist() == [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]


def test_the_question_after_the_prompt_is_a_heatmap_of_its_own(tmp_path, drawn):
    record(tmp_path, "snapkv", 0.2, lambda n, d: True, compress="prefill", name="inside")
    record(tmp_path, "snapkv", 0.2, lambda n, d: d < 0.2, compress="prefill", question="after", name="after")
    assert niah.figure_niah(annotate(load_runs(tmp_path)), tmp_path / "fig") == \
        ["methods_niah_prefill_heatmap", "methods_niah_prefill_question-after_heatmap"]
    assert drawn["methods_niah_prefill_heatmap"]["SnapKV 20% (n=6)"].to_numpy().sum() == 6
    assert drawn["methods_niah_prefill_question-after_heatmap"]["SnapKV 20% (n=6)"].to_numpy().tolist() == \
        [[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]


def test_two_records_of_one_key_are_picked_by_the_cell_rule_and_the_panel_says_so(tmp_path, drawn):
    record(tmp_path, "full", 1.0, lambda n, d: True, name="full")
    record(tmp_path, "h2o", 0.2, lambda n, d: False, name="small", limit=3)  # another protocol: limit
    record(tmp_path, "h2o", 0.2, lambda n, d: n == 1024, name="big")
    (tmp_path / "h2o/0.2/small/samples.jsonl").write_text("".join(  # the smaller sample
        json.dumps({"doc_id": i, "length": 512, "depth": 0.1, "acc": 0.0}) + "\n" for i in range(3)))
    small = json.loads((tmp_path / "h2o/0.2/small/metrics.json").read_text())
    (tmp_path / "h2o/0.2/small/metrics.json").write_text(json.dumps({**small, "n_samples": 3}))
    assert niah.figure_niah(annotate(load_runs(tmp_path)), tmp_path / "fig") == ["methods_niah_heatmap"]
    panels = drawn["methods_niah_heatmap"]
    assert list(panels) == ["full 100% (n=6)", "H2O 20% (n=6, 1 of 2 records)"]  # the largest sample wins
    assert panels["H2O 20% (n=6, 1 of 2 records)"].to_numpy().tolist() == [[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]


def test_a_protocol_without_a_full_record_draws_the_full_cache_of_another_and_says_whose(tmp_path, drawn):
    """The full cache holds every token under either timing and, at 100%, the question inside or after the prompt
    generates the same tokens: its decode record answers the prefill and question-after figures, titled so."""
    record(tmp_path, "full", 1.0, lambda n, d: n == 512 or d < 0.2, name="full")
    record(tmp_path, "snapkv", 0.2, lambda n, d: False, compress="prefill", name="inside")
    record(tmp_path, "snapkv", 0.2, lambda n, d: True, compress="prefill", question="after", name="after")
    assert niah.figure_niah(annotate(load_runs(tmp_path)), tmp_path / "fig") == [
        "methods_niah_heatmap", "methods_niah_prefill_heatmap", "methods_niah_prefill_question-after_heatmap"]
    full = [[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]]  # rows 512, 1024; columns the depths
    assert {t: v.to_numpy().tolist() for t, v in drawn["methods_niah_prefill_heatmap"].items()} == {
        "full 100% (n=6)\nrecord of compress=decode\n(same tokens)": full, "SnapKV 20% (n=6)": [[0.0] * 3] * 2}
    after = drawn["methods_niah_prefill_question-after_heatmap"]
    assert list(after) == ["full 100% (n=6)\nrecord of compress=decode,\nquestion=prompt\n(same tokens)",
                           "SnapKV 20% (n=6)"]
    assert next(iter(after.values())).to_numpy().tolist() == full


def test_the_full_cache_of_other_task_settings_or_a_figure_with_its_own_is_not_borrowed(tmp_path, drawn):
    """A full record of another task setting (here limit=3) never stands in; a figure with a full record of its
    own protocol (question after, decode) draws that one."""
    other, own = tmp_path / "other", tmp_path / "own"
    record(other, "full", 1.0, lambda n, d: True, limit=3, name="full")
    record(other, "snapkv", 0.2, lambda n, d: False, compress="prefill", name="inside")
    assert niah.figure_niah(annotate(load_runs(other)), tmp_path / "fig") == [
        "methods_niah_heatmap", "methods_niah_prefill_heatmap"]
    assert list(drawn["methods_niah_prefill_heatmap"]) == ["SnapKV 20% (n=6)"]  # limit=None there, 3 here
    record(own, "full", 1.0, lambda n, d: d > 0.2, name="full_inside")
    record(own, "full", 1.0, lambda n, d: d < 0.2, question="after", name="full_after")
    record(own, "h2o", 0.2, lambda n, d: False, question="after", name="h2o_after")
    assert niah.figure_niah(annotate(load_runs(own)), tmp_path / "fig") == [
        "methods_niah_heatmap", "methods_niah_question-after_heatmap"]
    after = drawn["methods_niah_question-after_heatmap"]
    assert list(after) == ["full 100% (n=6)", "H2O 20% (n=6)"]
    assert after["full 100% (n=6)"].to_numpy().tolist() == [[1.0, 0.0, 0.0]] * 2
