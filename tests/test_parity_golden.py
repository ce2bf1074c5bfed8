"""Golden numbers: our side of parity on the committed tiny model equals kvpress 0.5.5's recorded figures.

tests/data/parity_golden/kvpress.json was written once by `python -m h2o.parity --golden` (kvpress in its own
virtualenv, on the weights in tests/data/parity_golden/model/); here only our side runs (h2o.parity.golden,
the evicting cache), on the same weights and token ids, and each method's NLL per token of every continuation must
be within TOLERANCE of kvpress's. A method whose selection drifts by one token fails (the broken variants below).
kvpress's figures are recorded on two CPUs (Intel Xeon, AMD EPYC): where the last bit of a key decides an exact tie
(knorm's decoding forms), kvpress's own figures differ between them, and ours must equal one CPU's.
"""
from __future__ import annotations

import json

import pytest
import torch

from h2o.parity.golden import Case, beside, cases, cpus, load_model, nll, ours_nll, records_of, weights_sha256
from h2o.parity.pairs import RECORD, TOLERANCE
from h2o.core.policies import Policy
from h2o.core.policies.adakv import AdaKV
from h2o.core.policies.prefill import PrefillOnly

GOLD = json.loads(RECORD.read_text())
CASES = cases()
FULL = Case("full")
COMPARED = [(n, r) for n, c in CASES.items() if not c.statistical and not c.differs and c.policy() is not None
            for r in GOLD["ratios"]]
DIFFERS = [(n, r) for n, c in CASES.items() if c.differs for r in GOLD["ratios"]]  # kvpress's own behaviour


@pytest.fixture(scope="module")
def model():
    return load_model()


def kvpress(name: str, ratio: float, cpu: str) -> dict[str, float]:
    """kvpress's NLL per token by prompt for ``name`` at ``ratio``, as recorded on ``cpu``."""
    return {r["prompt"]: nll(r) for r in records_of(GOLD, cpu) if r["method"] == name and r["ratio"] == ratio}


def largest_gap(model, name: str, ratio: float, policy=None) -> float:
    """The largest gap over the prompts to kvpress's figures of the recorded CPU that ours is closest to: where the
    last bit of a key decides an exact tie, kvpress's own figures differ between CPUs (h2o.parity.golden.beside)."""
    case = FULL if name == "full" else CASES[name]
    ours = {p["id"]: ours_nll(model, case, ratio, p, policy) for p in GOLD["prompts"]["ppl"]}
    gaps = []
    for cpu in cpus(GOLD):
        theirs = kvpress(name, ratio, cpu)
        assert theirs.keys() == ours.keys()  # every prompt recorded
        gaps.append(max(abs(theirs[p] - ours[p]) for p in ours))
    return min(gaps)


def test_a_record_made_on_another_cpu_goes_beside_the_first():
    """Recording again on another CPU keeps the first CPU's figures and adds only the other's that differ; on the
    same CPU, or for other cases or weights, the new record replaces the old."""
    def rec(cpu, nlls, sha="w"):
        return {"kvpress": "0.5.5", "transformers": "5.2.0", "model": {"sha256": sha}, "ratios": [0.5], "prompts": {},
                "cases": {}, "largest_gap": {}, "cpu": cpu,
                "records": [{"method": m, "ratio": 0.5, "prompt": "p", "nll": v, "n_tokens": 1} for m, v in nlls]}
    old, new = rec("A", [("x", 1.0), ("y", 2.0)]), rec("B", [("x", 1.0 + TOLERANCE / 2), ("y", 2.5)])
    both = beside(old, new)
    assert cpus(both) == ["A", "B"] and both["records"] == old["records"]
    assert [r["nll"] for r in records_of(both, "B")] == [1.0, 2.5] and records_of(both, "A") == old["records"]
    assert beside(old, rec("A", [("x", 3.0)])) == rec("A", [("x", 3.0)])
    assert beside(old, rec("B", [("x", 3.0)], sha="v"))["cpu"] == "B"


def test_the_cpus_figures_differ_only_where_an_exact_tie_decides():
    """The record holds two CPUs' figures; they differ only in knorm's decoding forms (a repeated token's keys tie
    at layer 0), and there by more than the tolerance (so the second CPU's figures are needed)."""
    first, *others = cpus(GOLD)
    assert others, "one CPU recorded"
    for cpu in others:
        moved = {(r["method"], r["ratio"]) for r in GOLD["other_cpus"][cpu]["records"]}
        assert {m for m, _ in moved} == {"knorm_decode", "knorm_interval"}
        assert all(max(abs(kvpress(m, r, cpu)[p] - kvpress(m, r, first)[p]) for p in kvpress(m, r, first)) > TOLERANCE
                   for m, r in moved)


def test_the_weights_and_the_record_belong_together():
    assert weights_sha256() == GOLD["model"]["sha256"]
    assert GOLD["kvpress"] == "0.5.5"


def test_every_kvpress_method_has_golden_numbers():
    """kvpress's figures are recorded for every case; what is not compared is named here, so it cannot grow
    silently: random only (kvpress's draws are torch's generator, ours a hash); every other method is built."""
    recorded = {(r["method"], r["ratio"]) for r in GOLD["records"]}
    assert {(n, r) for n in CASES for r in GOLD["ratios"]} | {("full", 0.0)} <= recorded
    assert {n for n, c in CASES.items() if c.statistical} == {"random", "random_interval"}
    assert {n for n, c in CASES.items() if c.differs} == {"streaming_llm_interval", "snapkv_interval"}
    assert {n for n, c in CASES.items() if c.policy() is None} == set()


@pytest.mark.parametrize("name, ratio", [("full", 0.0)] + COMPARED)
def test_ours_equals_kvpress(model, name, ratio):
    assert largest_gap(model, name, ratio) <= TOLERANCE


@pytest.mark.parametrize("name, ratio", DIFFERS)
def test_where_kvpress_differs_by_design_it_still_does(model, name, ratio):
    """DecodingPress re-scoring a cache kept in top-k order (streaming_llm; snapkv, which also rotates its window
    queries by the current step's position): its diagnostic twin that keeps position order (and rotates each query
    by its own position) equals ours (``*_ordered_interval`` among COMPARED)."""
    assert largest_gap(model, name, ratio) > 10 * TOLERANCE
    assert f"{CASES[name].press}_ordered_interval" in CASES


@pytest.mark.parametrize("name, ratio, policy", [
    ("snapkv", 0.8, ("snapkv", {"kernel": 3})),  # another pooling kernel
    ("observed_attention", 0.5, ("h2_only", {"score": "sum"})),  # summed, not averaged over the queries
    ("streaming_llm", 0.8, ("streaming_llm", {"sinks": 3})),
    ("pyramidkv_w8_b4", 0.5, ("pyramidkv", {"window": 8, "beta": 5})),  # another pyramid
    ("streaming_llm_ordered", 0.5, ("local", {})),  # no sinks in the decoding timing
    ("adakv_snapkv", 0.5, ("snapkv", {})),  # every head its own n: no top-k across the heads
    ("expected_attention", 0.5, ("expected_attention", {"use_covariance": False})),
    ("knorm_interval", 0.8, ("knorm", {"interval": 4})),  # another interval
    ("tova_interval", 0.5, ("tova", {"interval": 16})),
    ("snapkv_ordered_interval", 0.5, ("snapkv", {"window": 4, "kernel": 5, "interval": 8})),  # another kernel
    ("kvzip", 0.5, ("kvzip", {"layerwise": True})),  # every layer the same count: no selection across layers
    ("kvzip_c64", 0.8, ("kvzip", {"chunk_size": 80})),  # other chunks: other replays
    ("kvzip", 0.8, ("kvzip", {"n_sink": 0})),  # the first tokens not protected
])
def test_a_broken_variant_fails(model, name, ratio, policy):
    assert largest_gap(model, name, ratio, policy) > 10 * TOLERANCE


ADAKV_KEEP = AdaKV.keep


def newest_first_at_the_cut(self, prio, pos, valid, counts, arriving=None):
    """AdaKV's decoding-step rule used at the cut too: ties to the newer token, then the lower head."""
    return ADAKV_KEEP(self, prio, pos, valid, counts, torch.zeros_like(valid))


@pytest.mark.parametrize("name, ratio, cls, keep", [
    ("snapkv", 0.8, PrefillOnly, Policy.keep),  # 51 < window 64 kept: only window tokens, all tied
    ("knorm", 0.5, PrefillOnly, Policy.keep),  # layer 0: every occurrence of a token has the same key norm
    ("adakv_snapkv", 0.8, AdaKV, newest_first_at_the_cut),  # the safeguard and the layer's cut inside the window
])
def test_the_tie_rule_is_asserted(model, monkeypatch, name, ratio, cls, keep):
    """Where scores tie at the budget's edge, kvpress keeps what its topk returns; breaking the ties another way
    (newer first) instead of running kvpress's topk on its rows is caught."""
    monkeypatch.setattr(cls, "keep", keep)
    assert largest_gap(model, name, ratio) > 10 * TOLERANCE


def older_first_ties(self, acc, keys, held, pos, counts):
    """The decoding step without kvpress's slot order: exact ties to select_slot, the older key goes."""
    return self.cut_score(acc, keys, held)


@pytest.mark.parametrize("name, ratio, attr, broken", [
    ("knorm_decode", 0.5, "step_score", older_first_ties),  # kvpress's topk on its slot order decides the ties
    ("knorm_decode", 0.5, "cut_order", Policy.cut_order),  # the prompt's cut without topk's order
    ("keydiff_decode", 0.8, "cut_room", 0),  # the prompt cut to n: the first step ranks by the kept keys' anchor
])
def test_a_broken_decoding_press_fails(model, monkeypatch, name, ratio, attr, broken):
    from h2o.core.policies.decoding_press import DecodingOrder

    monkeypatch.setattr(DecodingOrder, attr, broken)
    assert largest_gap(model, name, ratio) > 10 * TOLERANCE
