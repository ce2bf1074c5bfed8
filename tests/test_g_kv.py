"""g_kv (G-KV's global score): the score on hand-made states, both paths under its schedules, its options,
refusals and config, and its parity with G-KV's reference code through the golden numbers
``python -m h2o.parity.g_kv --reference DIR --golden`` recorded (tests/data/parity_golden/g_kv.json): the committed
tiny model's queries and keys are recorded again here and our rule must keep the reference's positions at the first
cut (its scores to fp32 noise), at every later cut with the history carried, and over a greedy generation of 256
tokens through the evicting cache (the same tokens, the NLL to fp32 noise). Broken rules (no decay, no history,
R-KV's similarity fallback) miss them. Its interval form on every tiny architecture, a padded batch and against a
naive token-by-token loop: tests/test_interval.py (RULES)."""
import pytest
import torch

from h2o import make_policy
from h2o.assets.models import tiny_model
from h2o.core.policies import PolicyError
from h2o.core.policies.base import TIER
from h2o.core.policies.budget import Unsupported
from h2o.core.policies.g_kv import GKV
from h2o.core.schedule import Interval
from h2o.parity import g_kv as parity
from h2o.parity.golden import load_model
from tests.golden import first_cut_gaps, golden_fixture, prompt_cuts_keep_the_golden, recorded_model
from tests.two_paths import padded_paths

TOLERANCE = 1e-5  # |score ours - reference|; measured 1.2e-07 when recorded (scores ~1e-2 apart)
NLL_TOLERANCE = 1e-4  # |NLL per generated token|; measured 1.4e-06 when recorded


# ------------------------------------------------------------------ the score on hand-made states
def state(rows: list[list[float]], history: list[float]) -> torch.Tensor:
    """acc (1, 1, S, w + 1): each slot's rows (w of them) and its history."""
    return torch.tensor([[[r + [h] for r, h in zip(rows, history)]]])


def test_the_global_score_is_the_larger_of_the_decayed_history_and_the_normalised_local_score():
    p = make_policy("g_kv", budget=3, window=2, alpha=0.5)
    acc = state([[0.2, 0.4], [0.1, 0.1], [0.0, 0.0], [0.5, 0.5], [0.3, 0.3]], [0.0, 0.9, 1.0, 0.0, 0.0])
    older = torch.tensor([[[True, True, True, False, False]]])  # the last two: the window
    g = p.global_score(acc, older)[0, 0]
    # local: means 0.3, 0.1, 0 divided by 0.3 -> 1, 1/3, 0; history * 0.5: 0, 0.45, 0.5
    torch.testing.assert_close(g, torch.tensor([1.0, 0.45, 0.5, 0.0, 0.0]))


def test_a_cut_writes_the_history_of_the_older_tokens_and_only_above_the_budget():
    p = make_policy("g_kv", budget=3, window=2, alpha=0.5)
    acc = state([[0.2, 0.4], [0.1, 0.1], [0.0, 0.0], [0.5, 0.5], [0.3, 0.3]], [0.0, 0.9, 1.0, 0.7, 0.0])
    pos = torch.arange(5)[None, None]
    held = pos >= 0
    counts = p.counts(torch.tensor([5]))
    before = acc.clone()
    p.cut_order(acc, None, pos, held, counts)
    torch.testing.assert_close(acc[0, 0, :, -1], torch.tensor([1.0, 0.45, 0.5, 0.0, 0.0]))  # the window's: 0
    assert torch.equal(acc[..., :-1], before[..., :-1])  # the rows are left as they are
    roomy = make_policy("g_kv", budget=5, window=2, alpha=0.5)
    acc = before.clone()
    roomy.cut_order(acc, None, pos, held, roomy.counts(torch.tensor([5])))
    assert torch.equal(acc, before)  # nothing to drop: the reference leaves its score_cache as it is


def test_the_priority_keeps_the_window_then_mixes_the_global_score_and_the_redundancy():
    p = make_policy("g_kv", budget=3, window=2, alpha=0.5, mix_lambda=1.0)  # the global score alone
    acc = state([[0.2, 0.4], [0.1, 0.1], [0.0, 0.0], [0.5, 0.5], [0.3, 0.3]], [0.0, 0.9, 1.0, 0.0, 0.0])
    keys = torch.randn(1, 1, 5, 4, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(5)[None, None]
    prio = p.priority(pos, p.cut_score(acc, keys, pos >= 0), torch.tensor([4]), p.counts(torch.tensor([5])))[0, 0]
    torch.testing.assert_close(prio[:3], torch.tensor([1.0, 0.45, 0.5], dtype=torch.float64))
    assert bool((prio[3:] >= 2 * TIER).all()) and prio[4] > prio[3]  # the window, newest first
    keep = p.keep(prio[None, None], pos, pos >= 0, p.counts(torch.tensor([5])))[0, 0]
    assert keep.tolist() == [True, False, False, True, True]
    red = make_policy("g_kv", budget=3, window=2, mix_lambda=0.0)  # the redundancy alone: minus its normalised
    prio = red.priority(pos, red.cut_score(acc, keys, pos >= 0), torch.tensor([4]), red.counts(torch.tensor([5])))
    assert float(prio[0, 0, :3].max()) <= 0 and float(prio[0, 0, :3].min()) == -1.0


# ------------------------------------------------------------------ both paths
@pytest.mark.parametrize("arch", ["llama_gqa", "opt", "gpt_neox"])
@pytest.mark.parametrize("every", [2, 5])
def test_both_paths_agree_on_a_padded_batch(arch, every):
    """Interval 2 is below the window (3): the rows then span a cut, each row's attention as it saw it, alike."""
    policy = make_policy("g_kv", budget=0.4, interval=every, window=3)
    sim, full, cache = padded_paths(tiny_model(arch, seed=2), policy)
    assert not torch.allclose(sim[:, -8:], full[:, -8:], atol=1e-3)


@pytest.mark.parametrize("compress, every, budget", [("prefill", None, 0.4), ("buffer", 3, 0.4), ("buffer", 3, 21)])
def test_its_other_schedules_agree_in_both_paths(compress, every, budget):
    """One cut at the prompt's end; the slack trigger (a cut once budget + 3 are held). At 21 tokens the second
    prompt (19) leaves room and the sequences' cuts fall on different steps: a sequence not due keeps its history."""
    policy = make_policy("g_kv", budget=budget, compress=compress, interval=every, window=3)
    sim, full, cache = padded_paths(tiny_model("llama_gqa", seed=2), policy)
    assert not torch.allclose(sim[:, -8:], full[:, -8:], atol=1e-3)


# ------------------------------------------------------------------ options, refusals
def test_the_reference_codes_defaults():
    p = make_policy("g_kv")
    assert p.describe() == {"policy": "g_kv", "budget": 128, "heavy": 128, "recent": 0, "compress": "interval",
                            "interval": 128, "window": 16, "alpha": 0.8, "mix_lambda": 0.5, "threshold": 0.5}
    assert p.schedule == Interval(128) and make_policy("g_kv", interval=16).schedule == Interval(16)
    assert make_policy("g_kv", compress="prefill").schedule.once


def test_its_config_is_the_reference_codes(hydra_ctx):
    from hydra import compose
    from hydra.utils import instantiate

    cfg = compose("config", ["task=bb_copa", "policy=g_kv"])
    assert instantiate(cfg.policy).describe() == make_policy("g_kv").describe()
    cfg = compose("config", ["task=bb_copa", "policy=g_kv", "policy.interval=64", "policy.alpha=0.5"])
    assert instantiate(cfg.policy).describe() == make_policy("g_kv", interval=64, alpha=0.5).describe()


@pytest.mark.parametrize("bad, error, match", [
    ({"compress": "decode"}, Unsupported, r"^compress=decode: g_kv carries its history from cut to cut .*; "
                                          r"allowed: (\w+, )*interval(, \w+)*$"),
    ({"window": 0}, PolicyError, r"^window=0: .*allowed: an int >= 1$"),
    ({"alpha": 1.5}, PolicyError, r"^alpha=1.5: allowed: a number in \[0, 1\]$"),
    ({"mix_lambda": -0.1}, PolicyError, r"^mix_lambda=-0.1: allowed: a number in \[0, 1\]$"),
    ({"threshold": "x"}, PolicyError, r"^threshold='x': allowed: a number in \[-1, 1\]$"),
    ({"interval": 0}, PolicyError, r"^interval=0: "),
    ({"compress": "prefill", "interval": 4}, PolicyError, r"^interval=4: read only with compress=interval")])
def test_bad_options_fail_in_one_line(bad, error, match):
    with pytest.raises(error, match=match) as e:
        make_policy("g_kv", **bad)
    assert "\n" not in str(e.value)


def test_wrappers_refuse_it():
    from h2o.core.policies.per_sequence import PerSequence

    with pytest.raises(PolicyError, match="^inner='g_kv': adakv wraps an evicting policy; allowed: "):
        make_policy("adakv", inner="g_kv")
    with pytest.raises(PolicyError, match="^PerSequence: g_kv keeps its own state per slot"):
        PerSequence([make_policy("g_kv", budget=8), make_policy("h2o", budget=8)])


# ------------------------------------------------------------------ parity through the golden numbers
golden = golden_fixture(parity)


@pytest.fixture(scope="module")
def states(golden):
    ids = parity.golden_ids()
    return parity.record_states(recorded_model(golden, ids=ids[0].tolist()), ids)


def first_gaps(states, golden) -> tuple[float, int]:
    """(largest |score difference|, heads whose kept positions differ) of ours against the golden first cuts."""
    return first_cut_gaps(parity.first_cuts(states), golden)


def later_differ(states, golden, options=None) -> int:
    ours = parity.later_cuts(states, options=options)
    assert [(r["layer"], r["now"]) for r in ours] == [(r["layer"], r["now"]) for r in golden["later_cuts"]]
    return sum(a != b for r, g in zip(ours, golden["later_cuts"]) for a, b in zip(r["ours"], g["kept"]))


def test_the_first_cut_equals_the_reference(states, golden):
    assert golden["options"] == parity.OPTIONS and golden["budgets"] == list(parity.BUDGETS)
    gap, differ = first_gaps(states, golden)
    assert gap < TOLERANCE and differ == 0, (gap, differ)


def test_every_later_cut_equals_the_reference_with_the_history_carried(states, golden):
    assert (golden["prompt"], golden["every"], golden["later_budget"]) == \
        (parity.PROMPT, parity.EVERY, parity.LATER_BUDGET)
    assert later_differ(states, golden) == 0
    assert golden["summary"]["later_cuts"]["largest_history_gap"] < TOLERANCE


def test_a_greedy_generation_through_the_evicting_cache_equals_the_references(golden):
    tokens, nll = parity.generate_ours(load_model(), parity.golden_ids()[:, :parity.PROMPT], golden["steps"])
    assert tokens == golden["generation"]["tokens"]
    assert max(abs(a - b) for a, b in zip(nll, golden["generation"]["nll"])) < NLL_TOLERANCE


def test_broken_rules_miss_the_golden_numbers(states, golden, monkeypatch):
    no_decay, no_history = {**parity.OPTIONS, "alpha": 1.0}, {**parity.OPTIONS, "alpha": 0.0}
    assert later_differ(states, golden, no_decay) > 0 and later_differ(states, golden, no_history) > 0
    prompt = parity.golden_ids()[:, :parity.PROMPT]
    for options in (no_decay, no_history):
        tokens, _ = parity.generate_ours(load_model(), prompt, 64, options)
        assert tokens != golden["generation"]["tokens"][:64]
    with monkeypatch.context() as m:  # the history not carried to the next cut
        m.setattr(GKV, "cut_order", lambda self, acc, prio, pos, valid, counts: None)
        assert later_differ(states, golden) > 0
    import h2o.core.policies.g_kv as module
    from h2o.core.policies.r_kv import redundancy

    with monkeypatch.context() as m:  # R-KV's cal_similarity (a row with no similar key zeroes its oldest entry)
        m.setattr(module, "redundancy", lambda *a, fallback, eps: redundancy(*a))
        gap, _ = first_gaps(states, golden)
    assert gap > 100 * TOLERANCE


def test_the_evicting_caches_cut_of_a_prompt_keeps_the_references_positions(golden):
    """The whole sequence as a prompt through the evicting cache (its own attention, the cut at the prompt's end):
    each layer's held positions per KV head are the reference's, at every budget."""
    prompt_cuts_keep_the_golden("g_kv", parity.OPTIONS, parity.golden_ids(), golden)


def test_the_fields_h2o_and_r_kv_recipes_are_recorded_beside_ours(states, golden):
    """G-KV's repository's H2O and R-KV recipes (its ScoreBasedKV) beside ``h2o`` and ``r_kv``: ours recomputed
    here keep what the record says they kept (the reference's side is recorded, CI has no checkout)."""
    T, recipe = states[0]["keys"].shape[2], golden["recipes"]["r_kv"]
    same = {"window": recipe["window_size"], "kernel": recipe["kernel_size"], "mix_lambda": recipe["mix_lambda"]}
    for key, row in golden["field"].items():
        layer, budget = map(int, key.split("/"))
        held = torch.arange(T).expand(states[layer]["keys"].shape[1], T)
        kept, _, _ = parity.ours_cut("h2o", {}, states[layer], held, T - 1, budget)
        assert kept == row["h2o"]
        kept, _, _ = parity.ours_cut("tova", {}, states[layer], held, T - 1, budget, rows=1)
        assert kept == row["tova"]
        kept, _, _ = parity.ours_cut("r_kv", same, states[layer], held, T - 1, budget, rows=same["window"])
        assert kept == row["r_kv"]
        # the whole difference: r_kv with the repository's importance keeps the repository's R-KV's tokens
        kept, _, _ = parity.ours_cut(parity.probs_importance(), same, states[layer], held, T - 1, budget,
                                     rows=same["window"])
        assert kept == row["gkv_repo_r_kv"]
    summary = golden["summary"]["field"]
    assert all(x["heads_equal"] == 0 for x in summary["h2o vs gkv_repo_h2o"].values())  # two definitions
    assert all(min(x["overlap_per_layer"]) > 0.9 for x in summary["r_kv vs gkv_repo_r_kv"].values())  # near
    assert sum(x["heads_equal"] for x in summary["r_kv vs gkv_repo_r_kv"].values()) < 18


def test_a_reference_path_without_the_code_is_one_line(tmp_path):
    with pytest.raises(SystemExit, match=r"^--reference=.*: no .*score_based\.py; allowed: a checkout of "
                                         r"microsoft/G-KV$"):
        parity.main(["--reference", str(tmp_path)])
