"""experiment=methods: the listed grid (refused combinations not run), the context-then-continuation perplexity
against the evicting cache (its logits and the KV it records as held), lm-eval log-likelihoods with the context
compressed once, and the analysis (table, figures, page) from records. Tiny random models; SmolLM2 nowhere."""
from __future__ import annotations

import json
import math
from collections import Counter

import pytest
import torch

from h2o import attach, make_policy
from h2o.assets.models import tiny_model
from h2o.core.policies.budget import PolicyError, Unsupported
from h2o.assets.paths import CONF
from h2o.pipeline.sweep import describe, expand
from h2o.tasks.kv_held import geometry, simulated_held
from h2o.tasks.perplexity import PerplexityTask

PREFILL_ONLY = {"snapkv", "pyramidkv", "adakv", "expected_attention"}
DECODING = {"local", "streaming_llm", "h2o", "tova", "scissorhands", "random", "knorm", "keydiff"}  # both timings


@pytest.fixture(scope="module")
def grid():
    """The grid at one of its budgets: the budgets are a plain cross product (checked from the file), and composing
    all 234 jobs costs three times as much."""
    return expand(["experiment=methods", "policy.budget=0.2", "runs_dir=/nonexistent-runs"], multirun=True)


def timing(spec) -> str:
    return spec.policy.compress


def test_the_grid_lists_every_method_at_each_timing_it_defines(grid):
    from omegaconf import OmegaConf

    params = OmegaConf.load(CONF / "experiment" / "methods.yaml").hydra.sweeper.params
    assert (params["policy.budget"], params["++policy.compress"]) == ("0.1,0.2,0.5", "decode,prefill")
    assert set(params.policy.split(",")) == DECODING | PREFILL_ONLY | {"full"}
    after = [p for p in grid.specs if getattr(p.task, "question", "prompt") == "after"]
    jobs = Counter((p.task.name, p.policy.name, timing(p)) for p in grid.specs if p not in after)
    assert set(jobs.values()) == {1}
    # the question after the compressed context: the needle at 20% with compress=prefill, each method that has it
    assert sorted((p.task.name, p.policy.name, timing(p)) for p in after) == sorted(
        ("niah", n, "prefill") for n in DECODING | PREFILL_ONLY)
    assert all("question=after" in p.path.name.split(",") for p in after)
    for task in ("austen_ctx", "niah"):  # a prompt: both timings where the method has them
        assert {(n, c) for t, n, c in jobs if t == task} == (
            {(n, c) for n in DECODING for c in ("decode", "prefill")} | {(n, "prefill") for n in PREFILL_ONLY}
            | {("full", "decode")})
    assert {(n, c) for t, n, c in jobs if t == "austen_ppl"} == {(n, "decode") for n in DECODING | {"full"}}
    assert len(grid.specs) == len({p.path for p in grid.specs}) == 51 + 12  # x3 budgets: 147 + 12 (full's one folder)
    refused, outside = Counter(), Counter()
    for job, why in grid.refused + grid.outside:
        given = dict(o.lstrip("+").split("=", 1) for o in job)
        if given["task.question"] == "after" and "outside the grid of experiment_name=methods" in why:
            outside[given["task"], given["policy"], given["policy.compress"]] += 1  # the question-after axis
            continue
        refused[given["task.question"], given["task"], given["policy"], given["policy.compress"]] += 1
    assert set(refused.values()) == set(outside.values()) == {1}
    assert len(outside) == 3 * 13 * 2 - 12 - 1  # less the 12 run and full at prefill (refused as it is today)
    assert {k[1:] for k in refused if k[0] == "after"} == {("niah", "full", "prefill")}
    assert {k[1:] for k in refused if k[0] == "prompt"} == {(t, n, "decode") for t in ("austen_ctx", "niah", "austen_ppl") for n in PREFILL_ONLY} | {
        ("austen_ctx", "full", "prefill"), ("niah", "full", "prefill")} | {
        ("austen_ppl", n, "prefill") for n in DECODING | PREFILL_ONLY | {"full"}}
    ctx = next(p for p in grid.specs if p.task.name == "austen_ctx")
    assert (ctx.task.window, ctx.task.context, ctx.task.n_windows, ctx.model.name) == (1152, 1024, 8, "smollm2-135m")
    text = describe(grid)
    assert text.count("   - refused ") == len(grid.refused) == 93 - len(grid.outside)
    assert text.endswith(f"; {len(grid.refused)} refused (not run); {len(grid.outside)} outside the experiment's "
                         f"grid_only cells (not run, not listed)")
    assert "compress=decode: pyramidkv is defined at the end of a prompt only" in text
    assert "compress=prefill: task austen_ppl scores sliding windows with no prompt" in text


def test_the_cluster_grid_crosses_the_papers_models_and_fig4_tasks_with_every_method(hydra_ctx):
    from omegaconf import OmegaConf

    params = OmegaConf.load(CONF / "experiment" / "methods_cluster.yaml").hydra.sweeper.params
    fig4 = OmegaConf.load(CONF / "experiment" / "fig4.yaml").hydra.sweeper.params
    assert (params.model, params.task) == (fig4.model, fig4.task)
    sweep = expand(["experiment=methods_cluster", "model=opt-6.7b", "task=copa", "runs_dir=/nonexistent-runs"],
                   multirun=True)  # one model x task cell of it
    assert len({p.path for p in sweep.specs}) == 1 + 8 * 3 * 2 + 4 * 3  # full, decoding methods at both
    assert len(sweep.refused) == 3 + 2 * 3  # full at prefill, pyramidkv and expected_attention at decode
    assert len(sweep.outside) == 2 * 3  # snapkv and adakv at decode: their prompt-end form only (grid_only)
    assert {(p.task.shots, p.semantics) for p in sweep.specs} == {(5, "simulated")}


def test_a_combination_that_does_not_exist_is_one_line_in_a_single_run(hydra_ctx):
    with pytest.raises(Unsupported, match="compress=prefill: task austen_ppl scores sliding windows"):
        expand(["task=austen_ppl", "policy=h2o", "+policy.compress=prefill"], multirun=False)
    with pytest.raises(Unsupported, match="compress=decode: pyramidkv is defined at the end of a prompt only"):
        expand(["task=austen_ctx", "policy=pyramidkv", "policy.compress=decode"], multirun=False)


# ------------------------------------------------------------------ context then continuation, both paths
W, C = 40, 28


@pytest.fixture(scope="module", params=["llama_gqa", "opt"])
def model(request):
    return tiny_model(request.param)


def real_path(model, policy, ids):
    """The evicting cache fed the context in one forward, then the continuation one token at a time:
    (summed NLL of the continuation, the cache, tokens x heads held after the cut)."""
    with torch.no_grad(), attach(model, policy, mode="real") as h:
        cache = h.new_cache()
        logits = [model(ids[:, :C], cache=cache).logits[:, -1:]]
        cut = int(cache.held_tokens().sum())
        logits += [model(ids[:, t:t + 1], cache=cache).logits for t in range(C, W - 1)]
    nll = torch.nn.functional.cross_entropy(torch.cat(logits, 1)[0].float(), ids[0, C:], reduction="sum")
    return float(nll), cache, cut


@pytest.mark.parametrize("name, options", [("h2o", {"compress": "decode"}), ("h2o", {"compress": "prefill"}),
                                           ("snapkv", {"window": 4}), ("pyramidkv", {"window": 4}),
                                           ("full", {})])
def test_the_context_task_scores_what_the_evicting_cache_holds(model, name, options):
    task = PerplexityTask(name="austen_ctx", window=W, context=C, n_windows=1)
    policy = make_policy(name, budget=0.3, **options) if name != "full" else make_policy("full")
    ids = torch.randint(3, 128, (1, W), generator=torch.Generator().manual_seed(3))
    sim = float(task.nll(model, policy, ids)[0])
    real, cache, cut = real_path(model, policy, ids)
    assert sim == pytest.approx(real, rel=1e-5, abs=1e-4)
    held = simulated_held(model, policy, W, C)
    foot = cache.footprint()
    assert held["kv_tokens_end"] == int(cache.held_tokens().sum()) == foot["tokens_held"]
    assert held["kv_tokens_cut"] == cut
    assert held["kv_bytes_end"] == foot["bytes_held"] == foot["bytes_stored"]  # one sequence: nothing padded
    if name != "full":
        n = int(policy.counts(torch.tensor([C])).total)
        layers, heads, _, _ = geometry(model)
        prefill = policy.compress == "prefill"
        if name == "h2o":  # the two timings hold different amounts at the end for one budget
            assert held["kv_tokens_end"] == layers * heads * (n + (W - 1 - C if prefill else 0))
        full = float(task.nll(model, make_policy("full"), ids)[0])
        assert sim != pytest.approx(full, rel=1e-4)  # the budget bites


def test_the_context_option_is_checked_in_one_line():
    from h2o.core.validate import ConfigError

    with pytest.raises(ConfigError, match=r"task.context=512: expected null or a token count in 1-511"):
        PerplexityTask(name="austen_ctx", window=512, context=512)
    task = PerplexityTask(name="austen_ppl", window=64)
    with pytest.raises(Unsupported, match="no prompt to compress; allowed: compress=decode"):
        task.check_policy(make_policy("snapkv", budget=0.2))
    task.check_policy(make_policy("h2o", budget=0.2))
    PerplexityTask(name="austen_ctx", window=64, context=48).check_policy(make_policy("snapkv", budget=0.2))


# ---------------------------------------------------------- lm-eval log-likelihoods, context compressed once
@pytest.fixture(scope="module")
def tiny_lm():
    from h2o.assets.model_spec import ModelSpec

    return ModelSpec("tiny-llama", "tiny:llama").load()


def direct_ll(model, policy, ctx: list[int], cont: list[int]) -> float:
    """The continuation's log-likelihood with the context compressed once by the evicting cache (kvpress's
    protocol by hand): the context's last logits predict cont[0], the continuation's own forward the rest."""
    with torch.no_grad(), attach(model, policy, mode="real") as h:
        cache = h.new_cache()
        first = model(torch.tensor([ctx]), cache=cache).logits[:, -1:]  # (1, 1, V)
        rest = model(torch.tensor([cont[:-1]]), cache=cache).logits if len(cont) > 1 else first[:, :0]
    logp = torch.log_softmax(torch.cat([first, rest], 1)[0].float(), -1)  # (len(cont), V)
    return float(logp[torch.arange(len(cont)), torch.tensor(cont)].sum())


def test_lm_eval_loglikelihoods_compress_each_context_once(tiny_lm):
    from h2o.tasks.lm_eval_model import H2OLM

    model, tok = tiny_lm
    g = torch.Generator().manual_seed(5)
    pairs = [(torch.randint(3, 200, (n,), generator=g).tolist(), torch.randint(3, 200, (m,), generator=g).tolist())
             for n, m in ((30, 5), (24, 5), (36, 3), (20, 1))]
    requests = [((f"c{i}", f"x{i}"), ctx, cont) for i, (ctx, cont) in enumerate(pairs)]
    for name, options in (("snapkv", {"window": 4}), ("knorm", {}), ("h2o", {"compress": "prefill"})):
        lm = H2OLM(pretrained=model, tokenizer=tok, policy=name, budget=0.4, batch_size=4, **options)
        got = [ll for ll, _ in lm._loglikelihood_tokens(requests)]
        want = [direct_ll(model, lm.policy, ctx, cont) for ctx, cont in pairs]
        assert got == pytest.approx(want, abs=1e-4), name
        full = [direct_ll(model, make_policy("full"), ctx, cont) for ctx, cont in pairs]
        assert got[0] != pytest.approx(full[0], abs=1e-3) and got[3] == pytest.approx(full[3], abs=1e-4)  # a
        # one-token continuation is predicted from the whole context (the cut comes after its logits)
    split = [(("a", "b"), [5, 6, 7], [8, 9]), (("c", "d"), [5, 6, 7, 8], [9])]  # one model input, two contexts
    with pytest.raises(PolicyError, match=r"contexts of \[3, 4\] tokens, so the prompt to compress is ambiguous"):
        H2OLM(pretrained=model, tokenizer=tok, policy="snapkv", budget=0.5)._loglikelihood_tokens(split)
    assert len(H2OLM(pretrained=model, tokenizer=tok, policy="h2o", budget=0.5)._loglikelihood_tokens(split)) == 2


# ------------------------------------------------------------------------------------------- the analysis
def record(root, policy, budget, timing, ppl, kv, n=4, task="austen_ctx"):
    folder = root / f"{task}-{policy}-{budget}-{timing}"
    folder.mkdir(parents=True)
    nll = [math.log(ppl) + d for d in (-0.1, 0.0, 0.05, 0.05)][:n]
    (folder / "samples.jsonl").write_text("".join(json.dumps({"window": i, "nll": v * 256, "n_tokens": 256}) + "\n"
                                                  for i, v in enumerate(nll)))
    options = {"compress": timing} if policy != "full" else {}
    rec = {"experiment": "methods", "model": "smollm2-135m", "task": task, "task_kind": "perplexity",
           "policy": policy, "budget": budget, "shots": 0, "semantics": "simulated", "seed": 0, "n_samples": n,
           "protocol": {"window": 2304, "context": 2048}, "policy_options": options, "kv_bytes_end": kv,
           "cpu_s": 10.0, "wall_s": 20.0, "metrics": {"ppl": ppl}, **({"compress": timing} if timing == "prefill"
                                                                     else {})}
    (folder / "metrics.json").write_text(json.dumps(rec))


def test_the_methods_table_figures_and_page_come_from_the_records(tmp_path):
    from analysis import results_pages
    from analysis.methods import methods_figures, methods_tables
    from analysis.records import load_runs

    root = tmp_path / "studies" / "methods" / "records"
    mib = 2 ** 20
    record(root, "full", 1.0, "decode", 18.0, 100 * mib)
    record(root, "h2o", 0.2, "decode", 30.0, 20 * mib)
    record(root, "h2o", 0.2, "prefill", 24.0, 31 * mib)
    record(root, "snapkv", 0.2, "prefill", 21.0, 31 * mib)
    df = load_runs(root)
    [table] = methods_tables(df)
    assert table.header == ["method", "20% decode", "20% prefill"]
    rows = {r[0]: r[1:] for r in table.rows}
    assert rows["SnapKV"][0] == "—" and rows["SnapKV"][1].startswith("21.00 [") and rows["SnapKV"][1].endswith(
        " · 31.0")
    assert rows["H2O"][0].endswith(" · 20.0") and rows["full"][0].startswith("18.00 [")
    names = sorted(p.name for p in methods_figures(df, tmp_path / "fig"))
    assert names == ["methods_austen_ctx_methods.pdf", "methods_austen_ctx_methods.png"]
    (root.parent / "study.yaml").write_text(json.dumps({"title": "Methods", "kind": "methods"}))
    out = tmp_path / "docs"
    assert results_pages.main(["--studies", str(tmp_path / "studies"), "--out", str(out)]) == 0
    page = (out / "methods.md").read_text()
    assert "![methods_austen_ctx_methods](methods/methods_austen_ctx_methods.png)" in page
    assert "- 20%: SnapKV (prefill) > H2O (decode): ppl 21.000 vs 30.000" in page  # paired by window: resolved
    assert "| SnapKV | — | 21.00 [" in page
