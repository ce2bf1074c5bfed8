"""experiment=models: its grid, the perplexity windows' BOS option it uses, and the two-model table it renders."""
import math

import numpy as np
import pytest
import torch
from test_analysis import run
from test_packaged import bos_tokenizer

from analysis.__main__ import main as analysis_main
from analysis.models_table import models_tables, render
from analysis.records import load_runs
from analysis.render import MISSING
from h2o.assets.tiny import byte_tokenizer
from h2o.core.validate import ConfigError
from h2o.pipeline.sweep import expand
from h2o.tasks.perplexity import PerplexityTask


def test_the_grid_is_two_models_by_four_policies_at_twice_gemmas_window():
    specs = expand(["experiment=models"], multirun=True).specs
    cells = {(p.cfg.model.name, p.policy.name, p.cfg.policy.budget) for p in specs}
    assert cells == {(m, p, 0.2) for m in ("smollm2-135m", "gemma3-270m")
                     for p in ("full", "local", "streaming_llm", "h2o")}
    for p in specs:
        task = p.cfg.task
        assert (task.window, task.batch_size, task.add_bos_token) == (1024, 1, None)  # 1,024 = 2 x Gemma's 512
        assert task.window * 20 // 100 < 512 < task.window  # the budget is inside a window, the window beyond it
        assert p.cfg.experiment_name == "models" and "add_bos_token=null" in str(p.path)


def test_the_dry_run_lists_the_grid(capsys):
    from h2o.pipeline.sweep import main

    assert main(["experiment=models"]) == 0
    out = capsys.readouterr().out
    assert "8 jobs: 8 to run" in out and out.count("gemma3-270m ") == 4 and out.count("smollm2-135m ") == 4


@pytest.mark.parametrize("option, tokenizer, bos", [
    (True, byte_tokenizer, True), (False, bos_tokenizer, False),
    (None, byte_tokenizer, False), (None, bos_tokenizer, True),  # null: what the tokenizer does by default
])
def test_perplexity_windows_start_with_bos_when_asked(option, tokenizer, bos):
    tok = tokenizer()
    plain = PerplexityTask("austen_ppl", window=32, n_windows=3, stride=2).windows(tok)  # (3, 32)
    task = PerplexityTask("austen_ppl", window=32, n_windows=3, stride=2, add_bos_token=option)
    wins = task.windows(tok)
    assert wins.shape == plain.shape == (3, 32) and task.protocol(tok)["add_bos_token"] is bos
    if bos:
        assert (wins[:, 0] == tok.bos_token_id).all() and torch.equal(wins[:, 1:], plain[:, :31])
    else:
        assert torch.equal(wins, plain)


def test_a_bad_bos_option_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"^task.add_bos_token='yes': allowed: true, false, null"):
        PerplexityTask("austen_ppl", add_bos_token="yes")


NLL = {("smollm2-135m", "full"): [2.0, 2.2, 2.4], ("smollm2-135m", "local"): [3.0, 3.5, 4.0],
       ("smollm2-135m", "streaming_llm"): [2.3, 2.5, 2.7], ("smollm2-135m", "h2o"): [2.1, 2.3, 2.5],
       ("gemma3-270m", "full"): [3.0, 3.1, 3.2], ("gemma3-270m", "local"): [5.0, 5.5, 6.0],
       ("gemma3-270m", "h2o"): [3.05, 3.2, 3.3]}  # Gemma's StreamingLLM run is missing


def ppl_run(root, model, policy):
    nll = NLL[model, policy]
    samples = [{"window": i, "nll": v * 1023, "n_tokens": 1023} for i, v in enumerate(nll)]
    bos = model == "gemma3-270m"
    return run(root, samples=samples, experiment="models", model=model, task="austen_ppl", task_kind="perplexity",
               policy=policy, shots=0, semantics="simulated", seed=0, budget=1.0 if policy == "full" else 0.2,
               n_samples=3, scoring=None, add_bos_token=bos,
               protocol={"window": 1024, "n_windows": 3, "add_bos_token": bos},
               metrics={"ppl": math.exp(np.mean(nll))}, **({"heavy": 0.1, "recent": 0.1} if policy == "h2o" else {}))


@pytest.fixture
def records(tmp_path):
    for model, policy in NLL:
        ppl_run(tmp_path / "runs", model, policy)
    run(tmp_path / "runs", samples=[], experiment="default", model="smollm2-135m", task="austen_ppl",  # not ours
        task_kind="perplexity", policy="full", shots=0, semantics="simulated", seed=0, budget=1.0, n_samples=3,
        protocol={"window": 512}, metrics={"ppl": 99.0})
    return tmp_path


def test_the_two_model_table_puts_each_models_policies_side_by_side(records):
    [(table, orders)] = models_tables(load_runs(records / "runs"))
    assert table.header == ["policy", "budget", "gemma3-270m ppl [95%]", "gemma3-270m × full",
                            "smollm2-135m ppl [95%]", "smollm2-135m × full"]
    rows = {r[0]: r for r in table.rows}
    assert list(rows) == ["full", "local", "StreamingLLM", "H2O"]
    assert rows["full"][1] == "1" and rows["H2O"][1] == "0.2"
    assert rows["full"][2].startswith(f"{math.exp(3.1):.2f} [") and rows["full"][3] == "1.00×"
    assert rows["local"][5] == f"{math.exp(3.5) / math.exp(2.2):.2f}×"
    assert rows["StreamingLLM"][2] == MISSING and rows["StreamingLLM"][3] == MISSING
    assert rows["StreamingLLM"][4].startswith(f"{math.exp(2.5):.2f} [")
    assert any("(p1)" in c for c in rows["full"]) and any("(p2)" in c for c in rows["full"])  # BOS differs by model
    assert orders == [f"- gemma3-270m: full {math.exp(3.1):.2f} < H2O {math.exp(np.mean([3.05, 3.2, 3.3])):.2f} "
                      f"< local {math.exp(5.5):.2f} (best first)",
                      f"- smollm2-135m: full {math.exp(2.2):.2f} < H2O {math.exp(2.3):.2f} < StreamingLLM "
                      f"{math.exp(2.5):.2f} < local {math.exp(3.5):.2f} (best first)"]


def test_the_page_is_rendered_into_docs_from_the_records(records):
    out = records / "docs"
    assert analysis_main(["models", "--runs", str(records / "runs"), "--out", str(out)]) == 0
    page = (out / "models_results.md").read_text()
    assert page == render(load_runs(records / "runs"))
    assert page.startswith("# Two real models side by side (`experiment=models`)")
    assert "**austen_ppl: ppl of each model by policy (budget 0.2)**" in page
    assert "- austen_ppl (smollm2-135m, 0-shot, ppl): 0.2: H2O < full" in page  # paired over the three windows
    assert "99.00" not in page  # another experiment's record


def test_without_records_the_page_says_how_to_make_them(tmp_path):
    (tmp_path / "none").mkdir()  # an empty runs folder (a missing one is refused)
    assert analysis_main(["models", "--runs", str(tmp_path / "none"), "--out", str(tmp_path)]) == 0
    assert "No finished run of experiment `models` yet" in (tmp_path / "models_results.md").read_text()
