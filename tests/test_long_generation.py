"""experiment=long_generation: the listed grid, the teacher-forced fidelity against the evicting cache fed token by
token, the task's records on a tiny model (the reference answers kept and read back, full's KV rising, a budget's
flat), the measures, and the page (headline, comparisons, figures) from records. Tiny random models; SmolLM2
nowhere."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from h2o import attach, make_policy
from h2o.assets.models import tiny_model
from h2o.pipeline.sweep import expand
from h2o.tasks import long_generation_measures as lm
from h2o.tasks.long_generation import LongGenerationTask

DECODING = ("h2o", "tova", "streaming_llm", "local", "knorm", "keydiff", "r_kv")
TEMPLATE = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")


def test_the_grid_lists_every_decoding_method_at_each_budget_and_schedule():
    sweep = expand(["experiment=long_generation", "runs_dir=/nonexistent-runs"], multirun=True)
    specs = list({p.path: p for p in sweep.specs}.values())  # full's one run serves both budgets
    cells = Counter((p.policy.name, p.policy.budget, p.policy.compress, p.policy.interval, p.task.prompts)
                    for p in specs)
    assert set(cells.values()) == {1}
    assert set(cells) == {("full", 1.0, "decode", None, 8)} | {
        (m, b, c, i, 8) for m in DECODING for b in (64, 128) for c, i in (("decode", None), ("interval", 32))} | {
        ("full", 1.0, "decode", None, 16), ("h2o", 64, "decode", None, 16), ("streaming_llm", 64, "decode", None, 16),
        ("full", 1.0, "decode", None, 32), ("h2o", 64, "interval", 32, 32), ("r_kv", 64, "interval", 32, 32)} | {
        (m, 64, "interval", 32, 8) for m in ("g_kv", "snapkv_d")}  # the 2026 baselines (triattention: its command)
    assert len(specs) == 37 and specs[0].policy.name == "full"
    first = [(p.policy.budget, p.task.prompts) for p in specs[1:15]]
    assert set(first) == {(64, 8)}  # every method and schedule at 64 tokens before 128, then the 16 prompts
    assert [p.task.prompts for p in specs[31:]] == [16] * 3 + [32] * 3  # the headline's cells, the replication's
    assert "prompts=16" in str(next(p.path for p in specs if p.task.prompts == 16))  # beside the grid's folders
    assert "prompts=32" in str(next(p.path for p in specs if p.task.prompts == 32))
    task = sweep.specs[0].task
    assert (task.prompts, task.passage_tokens, task.max_new_tokens, task.text, task.kind) == (
        8, 128, 512, "austen", "long_generation")
    assert len(sweep.refused) == 3  # full at interval: its one run serves both schedules


def stepwise_nll(model, policy, prompt: torch.Tensor, answer: list[int]) -> float:
    """The answer's summed NLL through the evicting cache: the prompt in one forward, then one token at a time."""
    ids = torch.cat([prompt, torch.tensor(answer)])[None]
    P = prompt.shape[0]
    with torch.no_grad(), attach(model, policy, mode="real") as h:
        cache = h.new_cache()
        logits = [model(ids[:, :P], cache=cache).logits[:, -1:]]
        logits += [model(ids[:, t:t + 1], cache=cache).logits for t in range(P, ids.shape[1] - 1)]
    return float(torch.nn.functional.cross_entropy(torch.cat(logits, 1)[0].float(), ids[0, P:], reduction="sum"))


@pytest.mark.parametrize("arch", ["llama_gqa", "opt"])
@pytest.mark.parametrize("name, options", [("h2o", {"compress": "decode"}), ("h2o", {"compress": "interval",
                                                                                         "interval": 5}),
                                           ("tova", {"compress": "interval", "interval": 3}),
                                           ("keydiff", {"compress": "decode"}), ("full", {})])
def test_teacher_forcing_scores_what_the_evicting_cache_holds(arch, name, options):
    model = tiny_model(arch)
    g = torch.Generator().manual_seed(7)
    prompt, answer = torch.randint(3, 200, (14,), generator=g), torch.randint(3, 200, (30,), generator=g).tolist()
    policy = make_policy(name, budget=10, **options) if name != "full" else make_policy("full")
    task = LongGenerationTask(name="long_generation")
    nll, top1 = task.teacher_forced(model, policy, prompt, answer)
    assert nll == pytest.approx(stepwise_nll(model, policy, prompt, answer), rel=1e-5, abs=1e-4)
    assert 0 <= top1 <= len(answer)
    if name != "full":  # the budget bites
        assert nll != pytest.approx(task.teacher_forced(model, make_policy("full"), prompt, answer)[0], rel=1e-4)


def test_the_measures_of_an_answer():
    assert lm.first_departure([5, 6, 7, 8], [5, 6, 9, 8]) == 2
    assert lm.first_departure([5, 6], [5, 6, 7]) == 2 and lm.first_departure([5, 6], [5, 6]) == 2
    assert lm.distinct([1, 2, 1, 2, 1, 2], 2) == pytest.approx(2 / 5) and lm.distinct([1, 2], 4) is None
    out = torch.tensor([[9, 9, 4, 2, 5, 5], [9, 9, 4, 4, 4, 4]])  # width 2; EOS 2 ends the first answer
    assert lm.answers(out, 2, {2}) == [[4, 2], [4, 4, 4, 4]]
    samples = [{"tf_nll_per_token": 1.0, "tf_top1": 0.5, "first_departure": 3, "gen_tokens": 4, "distinct_4": 1.0,
                "kv_bytes_peak": 10, "kv_bytes_end": 10, "time_s": 1.0, "at_limit": True, "identical": False},
               {"tf_nll_per_token": 2.0, "tf_top1": 0.7, "first_departure": 5, "gen_tokens": 4, "distinct_4": 0.5,
                "kv_bytes_peak": 20, "kv_bytes_end": 10, "time_s": 1.0, "at_limit": False, "identical": True}]
    m = lm.metrics(samples, 4)
    assert m["tf_nll_per_token"] == 1.5 and m["tf_nll_per_token_stderr"] == pytest.approx(0.5)
    assert m["tf_nll_per_token_ci95_low"] == pytest.approx(1.5 - 1.96 * 0.5)
    assert (m["at_limit_share"], m["identical_share"], m["kv_bytes_peak"]) == (0.5, 0.5, 15)


def test_bad_settings_are_one_line():
    from h2o.core.validate import ConfigError

    with pytest.raises(ConfigError, match=r"task.max_new_tokens=0: allowed: an int >= 1"):
        LongGenerationTask(name="long_generation", max_new_tokens=0)
    with pytest.raises(ConfigError, match=r"task.text='pg19': allowed: austen, moby_dick"):
        LongGenerationTask(name="long_generation", text="pg19")


# ---------------------------------------------------------------------------------- the task on a tiny model
@pytest.fixture()
def tiny_lm(monkeypatch, tmp_path):
    from h2o.assets.model_spec import ModelSpec

    model, tok = ModelSpec("tiny-llama", "tiny:llama").load()
    monkeypatch.setattr(tok, "chat_template", TEMPLATE)
    monkeypatch.setattr("h2o.assets.paths.cache_dir", lambda: tmp_path / "cache")
    return model, tok


def test_a_base_model_without_a_template_is_prompted_with_the_plain_instruction(tiny_lm, monkeypatch):
    """Gemma-3-270m's tokenizer has no chat template: its prompt is the tokenizer's BOS, the instruction, a blank
    line, then the passage (the passages of the templated prompts), and the record says so."""
    from h2o.tasks.perplexity import book

    model, tok = tiny_lm
    task = LongGenerationTask(name="long_generation", prompts=2, passage_tokens=12, max_new_tokens=4, batch_size=2)
    _, starts = task.prompt_ids(tok)
    monkeypatch.setattr(tok, "chat_template", None)
    plain, same = task.prompt_ids(tok)
    head = tok("Continue this story in the same style, at length:\n\n", add_special_tokens=True).input_ids
    passages = [tok(book("austen")[c:c + 144], add_special_tokens=False).input_ids[:12] for c in starts]
    assert same == starts and plain.tolist() == [head + passage for passage in passages]
    assert task.run(model, tok, make_policy("full"), "real", 0).info["chat_template"] is False


def test_the_task_records_fidelity_length_and_kv_against_the_full_cache(tiny_lm, tmp_path):
    from h2o.tasks.kv_held import geometry

    model, tok = tiny_lm
    task = LongGenerationTask(name="long_generation", prompts=3, passage_tokens=12, max_new_tokens=20, batch_size=2,
                              trace_every=4)
    full = task.run(model, tok, make_policy("full"), "real", 0)
    assert full.info["reference"]["batches_computed"] == 0 and full.info["reference"]["batches_read"] == 2
    kept = sorted(p.name for p in (tmp_path / "cache" / "long_generation").rglob("*.json"))
    assert kept == ["batch0.json", "batch2.json"]
    layers, heads, dim, _ = geometry(model)
    per_token = layers * heads * 2 * dim * 4
    for s in full.samples:  # full is its own reference: it never departs, its KV rises by each token
        assert s["identical"]
        assert s["first_departure"] == s["gen_tokens"] and s["tf_tokens"] == s["gen_tokens"]
        steps = [b - a for a, b in zip(s["kv_trace"], s["kv_trace"][1:])]
        assert steps and set(steps) == {4 * per_token}
        assert s["kv_trace"][0] == full.info["prompt_tokens"] * per_token
    budget = make_policy("h2o", budget=10)
    h2o = task.run(model, tok, budget, "real", 0)
    assert h2o.info["reference"] == {**full.info["reference"], "batches_read": 2, "batches_computed": 0}
    for s, ref in zip(h2o.samples, full.samples):
        assert set(s["kv_trace"]) == {10 * per_token} and s["kv_bytes_peak"] == 10 * per_token
        assert s["tf_tokens"] == ref["gen_tokens"] and s["first_departure"] < ref["gen_tokens"]
        assert s["tf_nll_per_token"] > ref["tf_nll_per_token"]  # the compressed cache is further from full's answer
    assert h2o.metrics["tf_nll_per_token"] > full.metrics["tf_nll_per_token"]
    assert h2o.metrics["identical_share"] == 0 and full.metrics["identical_share"] == 1


# ----------------------------------------------------------------------------------------------- the page
def record(root, policy, budget, compress, nll: list[float], kv: int, prompts: int | None = None,
           model: str = "smollm2-135m"):
    folder = root / f"{model}-{policy}-{budget}-{compress}{f'-{prompts}' if prompts else ''}"
    folder.mkdir(parents=True)
    interval = 32 if compress == "interval" else None
    samples = [{"doc_id": i, "tf_nll_per_token": v, "first_departure": 10 + i, "kv_trace": [kv, kv + 1, kv + 2],
                "gen_tokens": 500 + 2 * (policy == "h2o"), "distinct_4": 0.5} for i, v in enumerate(nll)]
    (folder / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    mean = sum(nll) / len(nll)
    options = {} if policy == "full" else {"budget": budget, "compress": compress,
                                           **({"interval": interval} if interval else {})}
    rec = {"experiment": "long_generation", "model": model, "task": "long_generation",
           "task_kind": "long_generation", "policy": policy, "budget": budget, "semantics": "real", "seed": 0,
           "n_samples": len(nll), "policy_options": options, "trace_every": 8, "cpu_s": 100.0,
           **({"protocol": {"prompts": prompts}} if prompts else {}),
           **({"compress": compress, "interval": interval} if interval else {}),
           "metrics": {"tf_nll_per_token": mean, "tf_nll_per_token_ci95_low": mean - 0.1,
                       "tf_nll_per_token_ci95_high": mean + 0.1, "gen_tokens": 512, "kv_bytes_peak": kv}}
    (folder / "metrics.json").write_text(json.dumps(rec))


def grid_records(tmp_path) -> Path:
    """full, and h2o, streaming_llm and tova at 64 tokens every step, over 4 prompts (tova mixed against H2O)."""
    root = tmp_path / "studies" / "long_generation" / "records"
    record(root, "full", 1.0, "decode", [0.5, 0.6, 0.4, 0.5], 900)
    record(root, "h2o", 64, "decode", [1.0, 1.2, 0.9, 1.1], 100)
    record(root, "streaming_llm", 64, "decode", [1.5, 1.6, 1.4, 1.7], 100)
    record(root, "tova", 64, "decode", [0.9, 1.3, 1.0, 1.0], 100)
    return root


def study_page(root: Path, spec: dict) -> tuple[str, Path]:
    """The page of the study whose records are ``root`` (<tmp>/studies/<name>/records), ``spec`` its study.yaml, as
    ``make docs-results`` writes it into <tmp>/docs; and that folder."""
    from analysis import results_pages

    (root.parent / "study.yaml").write_text(json.dumps(spec))
    out = root.parents[2] / "docs"
    assert results_pages.main(["--studies", str(root.parents[1]), "--out", str(out)]) == 0
    return (out / f"{root.parent.name}.md").read_text(), out


def test_the_page_comes_from_the_records(tmp_path):
    from analysis.long_generation import paired

    root = grid_records(tmp_path)
    record(root, "h2o", 64, "interval", [1.1, 1.2, 1.0, 1.1], 120)
    spec = {"title": "Long generation", "kind": "long_generation", "runs": 25,
            "headline": {"a": "h2o", "b": "streaming_llm", "budget": 64, "schedule": "every step"}}
    page, out = study_page(root, spec)
    assert "Runs finished: 5 of the committed grid's 25 (500 CPU-s in all, one thread each)." in page
    assert ("**Headline**: H2O against StreamingLLM at 64 tokens, every step, over the 4 prompts of "
            "task.prompts=4, paired over prompts") in page
    assert "Confirmatory replication" not in page
    assert ("- NLL per token of the full cache's answer teacher-forced through each cache: -0.500 [-0.575, -0.425] "
            "over 4 prompts (H2O lower on 4, StreamingLLM lower on 0): H2O lower: closer to the full cache at 95%") in page
    assert ("- tokens generated: +2.0 [+2.0, +2.0] over 4 prompts (H2O lower on 0, StreamingLLM lower on 4): H2O "
            "longer at 95%") in page
    assert "- distinct 4-gram share of the answer: +0.000 [+0.000, +0.000] over 4 prompts" in page
    assert "- 64 tokens, every step: H2O < StreamingLLM: -0.500" in page
    assert "- 64 tokens, every step: H2O ≈ TOVA: " in page
    assert "![long_generation_kv](long_generation/long_generation_kv.png)" in page
    assert sorted(p.name for p in (out / "long_generation").iterdir()) == ["long_generation_fidelity.png",
                                                                         "long_generation_kv.png"]
    assert "| H2O | 64 | every 32 | 4 | 1.100 [1.000, 1.200] |" in page
    tie = paired({0: {"x": 1.0}, 1: {"x": 2.0}}, {0: {"x": 2.0}, 1: {"x": 1.0}}, "x")
    assert tie["lo"] < 0 < tie["hi"] and tie["a_lower"] == tie["b_lower"] == 1


def test_the_headline_on_its_own_prompt_set_beside_the_grids(tmp_path):
    root = grid_records(tmp_path)
    record(root, "h2o", 64, "decode", [2.0, 2.0, 1.0, 1.0, 3.0, 3.0], 100, prompts=6)  # the headline's own set
    record(root, "streaming_llm", 64, "decode", [1.0, 1.0, 1.0, 1.0, 1.0, 1.0], 100, prompts=6)
    spec = {"title": "Long generation", "kind": "long_generation", "runs": 7,
            "headline": {"a": "h2o", "b": "streaming_llm", "budget": 64, "schedule": "every step", "prompts": 6}}
    page, _ = study_page(root, spec)
    assert "**Headline**: H2O against StreamingLLM at 64 tokens, every step, over the 6 prompts of task.prompts=6" in page
    assert ("- NLL per token of the full cache's answer teacher-forced through each cache: +1.000 [+0.333, +1.667] "
            "over 6 prompts (H2O lower on 0, StreamingLLM lower on 4): H2O higher: further from the full cache at "
            "95%") in page
    assert ("- secondary, over the 4 prompts of task.prompts=4 (other passages), NLL per token of the full cache's "
            "answer teacher-forced through each cache: -0.500") in page
    assert "- secondary, over the 4 prompts of task.prompts=4 (other passages), tokens generated: +2.0" in page
    assert ("- secondary, NLL per token of the full cache's answer teacher-forced through each cache pooled over "
            "every prompt set (6 + 4 distinct passages): +0.400 [") in page
    assert "over 10 prompts (H2O lower on 4, StreamingLLM lower on 4)" in page
    assert "- 64 tokens, every step: H2O < StreamingLLM: -0.500" in page  # cell by cell: the grid's prompts only
    assert "| H2O | 64 | every step | 6 | 2.000 [1.900, 2.100] |" in page
    assert "| H2O | 64 | every step | 4 | 1.050 [0.950, 1.150] |" in page


def test_a_second_model_gets_its_own_section_and_named_comparison(tmp_path):
    """Records of another model (study.yaml ``second_family``): the main model's lines read its records only; the
    other model's section has its comparison, its cell-by-cell lines, its figures and its table."""
    root = grid_records(tmp_path)
    gemma = "gemma3-270m"
    record(root, "full", 1.0, "decode", [2.0, 2.0, 2.0, 2.0], 900, model=gemma)
    record(root, "h2o", 64, "interval", [3.0, 3.1, 2.9, 3.0], 100, model=gemma)
    record(root, "r_kv", 64, "interval", [3.5, 3.6, 3.4, 3.7], 100, model=gemma)
    spec = {"title": "Long generation", "kind": "long_generation", "runs": 4,
            "headline": {"a": "h2o", "b": "streaming_llm", "budget": 64, "schedule": "every step"},
            "second_family": {"model": gemma, "a": "h2o", "b": "r_kv", "budget": 64, "schedule": "every 32",
                              "why": "Named first."}}
    page, out = study_page(root, spec)
    main, other = page.split(f"## {gemma}\n")
    assert "Runs finished: 4 of the committed grid's 4 (400 CPU-s in all, one thread each), smollm2-135m." in main
    assert "**Headline**: H2O against StreamingLLM" in main and "R-KV" not in main
    assert other.startswith("\nRuns finished: 3 (300 CPU-s in all, one thread each).")
    assert ("**Second family**: H2O against R-KV at 64 tokens, every 32, over the 4 prompts of task.prompts=4"
            in other and "Named first." in other)
    assert "- 64 tokens, every 32: H2O < R-KV: -0.550" in other
    assert f"![long_generation_kv_{gemma}](long_generation/long_generation_kv_{gemma}.png)" in other
    assert (out / "long_generation" / f"long_generation_fidelity_{gemma}.png").stat().st_size > 5_000
    assert "| R-KV | 64 | every 32 | 4 | 3.550 [3.450, 3.650] |" in other


def test_a_replication_named_after_the_headline_follows_it(tmp_path):
    """study.yaml's ``replication``: a second named comparison on its own prompt set, shown after the headline with
    its reason, and its secondary lines on the grid's prompts where both cells ran there."""
    root = grid_records(tmp_path)
    record(root, "h2o", 64, "interval", [1.0, 1.0, 1.0, 1.0], 100)
    record(root, "tova", 64, "interval", [1.5, 1.5, 1.5, 1.5], 100)
    record(root, "h2o", 64, "interval", [1.0, 1.1, 0.9, 1.0, 1.2, 0.8], 100, prompts=6)
    record(root, "tova", 64, "interval", [1.5, 1.6, 1.4, 1.5, 1.7, 1.3], 100, prompts=6)
    spec = {"title": "Long generation", "kind": "long_generation", "runs": 9,
            "headline": {"a": "h2o", "b": "streaming_llm", "budget": 64, "schedule": "every step"},
            "replication": {"a": "h2o", "b": "tova", "budget": 64, "schedule": "every 32", "prompts": 6,
                            "why": "Named before its runs."}}
    page, _ = study_page(root, spec)
    head, rest = page.split("**Confirmatory replication**: H2O against TOVA at 64 tokens, every 32, over the 6 "
                            "prompts of task.prompts=6, paired over prompts")
    assert "**Headline**: H2O against StreamingLLM" in head
    assert rest.startswith(" (H2O − TOVA, bootstrap 95% interval of the mean difference; the first line is the "
                           "comparison named, the other two the answer it writes). Named before its runs.")
    assert ("- NLL per token of the full cache's answer teacher-forced through each cache: -0.500 [-0.500, -0.500] "
            "over 6 prompts (H2O lower on 6, TOVA lower on 0): H2O lower: closer to the full cache at 95%") in rest
    assert ("- secondary, over the 4 prompts of task.prompts=4 (other passages), NLL per token of the full cache's "
            "answer teacher-forced through each cache: -0.500") in rest
    assert "pooled over every prompt set (6 + 4 distinct passages): -0.500 [-0.500, -0.500] over 10 prompts" in rest


def test_a_records_study_with_long_generation_gets_its_section_report_line_and_figures(tmp_path):
    """The default's third finding: long-generation records inside a records study (experiment=default) get their
    own section on its page (the study's headline named first, then H2O against each method, the two figures and
    the table), a line in REPORT.md's section of that experiment, and their figures from `make figures`, while the
    other records render as before."""
    from analysis.figures import all_figures
    from analysis.records import load_runs
    from analysis.report import report
    from test_analysis import perplexity

    root = tmp_path / "studies" / "default" / "records"
    record(root, "full", 1.0, "decode", [0.5, 0.6, 0.4, 0.5], 900)
    record(root, "h2o", 64, "interval", [1.0, 1.1, 0.9, 1.0], 100)
    record(root, "r_kv", 64, "interval", [1.2, 1.4, 1.1, 1.3], 100)
    for f in root.rglob("metrics.json"):  # the default's experiment name
        f.write_text(f.read_text().replace('"experiment": "long_generation"', '"experiment": "default"'))
    for policy in ("full", "h2o"):
        perplexity(root, policy, 1.0 if policy == "full" else 0.2)
    spec = {"title": "The default", "kind": "records",
            "headline": {"a": "h2o", "b": "r_kv", "budget": 64, "schedule": "every 32", "why": "Named first."}}
    page, _ = study_page(root, spec)
    section = page[page.index("## Long generation"):]
    assert section.index("**Named comparison**: H2O against R-KV at 64 tokens, every 32") < \
        section.index("- 64 tokens, every 32: H2O < R-KV: -0.250") < section.index("| R-KV | 64 | every 32 | 4 |")
    assert "Named first." in section and "![long_generation_kv](default/long_generation_kv.png)" in section
    assert "![default_policies](default/default_policies.png)" in page[:page.index("## Long generation")]
    df = load_runs(root)
    lines = report(df).splitlines()
    at = lines.index("## Experiment `default` (not a paper table)")
    assert any(line.startswith("- long_generation (smollm2-135m, NLL per token") for line in lines[at:])
    assert "  - 64 tokens, every 32: H2O < R-KV: -0.250 [-0.300, -0.200] nats per token (1.250 for R-KV)" in lines
    names = {p.name for p in all_figures(df, tmp_path / "fig")}
    assert {"default_policies.png", "long_generation_kv_default.png", "long_generation_fidelity_default.png"} <= names
