"""Golden numbers: our side of parity on the committed tiny model equals kvpress 0.5.5's recorded figures.

tests/data/parity_golden/kvpress.json was written once by `python -m h2o.parity --golden` (kvpress in its own
virtualenv, on the weights in tests/data/parity_golden/model/); here only our side runs (h2o.parity.golden,
the evicting cache), on the same weights and token ids, and each method's NLL per token of every continuation must
be within TOLERANCE of kvpress's. A method whose selection drifts by one token fails (the broken variants below).
"""
from __future__ import annotations

import json

import pytest
import torch

from h2o.parity.golden import Case, cases, load_model, ours_nll, weights_sha256
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


def kvpress(name: str, ratio: float) -> dict[str, float]:
    """kvpress's NLL per token by prompt for ``name`` at ``ratio``."""
    return {r["prompt"]: r["nll"] / r["n_tokens"] for r in GOLD["records"]
            if r["method"] == name and r["ratio"] == ratio}


def largest_gap(model, name: str, ratio: float, policy=None) -> float:
    case = FULL if name == "full" else CASES[name]
    theirs = kvpress(name, ratio)
    assert len(theirs) == len(GOLD["prompts"]["ppl"])  # every prompt recorded
    return max(abs(theirs[p["id"]] - ours_nll(model, case, ratio, p, policy)) for p in GOLD["prompts"]["ppl"])


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
