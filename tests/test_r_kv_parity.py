"""r_kv against R-KV's reference scoring (Zefan-Cai/R-KV's ``R1KV.update_kv``), through the golden numbers
``python -m h2o.parity.r_kv --reference DIR --golden`` recorded (tests/data/parity_golden/r_kv.json): the committed
tiny model's queries and keys are recorded again here, our rule scores them, and its scores and kept positions
must equal the reference's (fp32 noise), at the first cut and at every later cut of the decoding buffer (the
reference's cache re-sorted by position there: its own order is the one difference, docs/r_kv.md). A broken rule
(the query heads' probabilities averaged instead of their logits' maximum; another pooling kernel) misses them."""
import pytest
import torch

from h2o.parity import r_kv as parity
from tests.golden import first_cut_gaps, golden_fixture, prompt_cuts_keep_the_golden, recorded_model

TOLERANCE = 1e-5  # |score ours - reference|; measured 9.3e-10 when recorded (scores ~1e-3 to 1e-2 apart)


golden = golden_fixture(parity)


@pytest.fixture(scope="module")
def states(golden):
    ids = parity.golden_ids()
    return parity.record_states(recorded_model(golden, ids=ids[0].tolist()), ids)


def test_the_first_cut_equals_the_reference(states, golden):
    assert golden["options"] == parity.OPTIONS and golden["budgets"] == list(parity.BUDGETS)
    gap, differ = first_cut_gaps(parity.first_cuts(states), golden)
    assert gap < TOLERANCE and differ == 0, (gap, differ)
    assert golden["summary"]["similar_rows"] > 0.5  # the redundancy's newest similar key decides, not its fallback


def test_every_later_cut_equals_the_reference_in_position_order(states, golden):
    ours = parity.later_cuts(states, golden["budgets"][0])
    assert [(r["layer"], r["now"], r["ours"]) for r in ours] == \
        [(r["layer"], r["now"], r["kept"]) for r in golden["later_cuts_resorted"]]
    assert golden["summary"]["later_cuts"]["kept_differently_in_its_order"] > 0  # the order matters there


def test_a_broken_rule_misses_the_golden_numbers(states, golden, monkeypatch):
    from h2o.core.policies.r_kv import RKV

    def mean_of_probabilities(self, acc, probs, valid=None):  # the heads' probabilities averaged (kvpress's way)
        w = self.window
        p = probs.float().softmax(-1).mean(2).transpose(-1, -2)  # (B, H, S, r)
        acc.copy_(torch.cat([acc, p], -1)[..., -w:])

    with monkeypatch.context() as m:
        m.setattr(RKV, "accumulate", mean_of_probabilities)
        gap, differ = first_cut_gaps(parity.first_cuts(states), golden)
    assert gap > 100 * TOLERANCE and differ > 0
    with monkeypatch.context() as m:
        m.setitem(parity.OPTIONS, "kernel", 5)
        gap, _ = first_cut_gaps(parity.first_cuts(states), golden)
    assert gap > 100 * TOLERANCE


def test_the_evicting_caches_cut_of_a_prompt_keeps_the_references_positions(golden):
    """The whole sequence as a prompt through the evicting cache (its own attention, the cut at the prompt's end):
    each layer's held positions per KV head are the reference's, at every budget (the simulated path equals this
    path: tests/test_r_kv.py, tests/test_interval.py)."""
    prompt_cuts_keep_the_golden("r_kv", parity.OPTIONS, parity.golden_ids(), golden)


def test_a_reference_path_without_the_code_is_one_line(tmp_path):
    with pytest.raises(SystemExit, match=r"^--reference=.*: no .*r1_kv\.py; allowed: a checkout of Zefan-Cai/R-KV$"):
        parity.main(["--reference", str(tmp_path)])
