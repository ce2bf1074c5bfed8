"""What the tests against a reference's golden numbers share (test_r_kv_parity, test_g_kv, test_snapkv_d,
test_baselines, test_triattention; each records with ``python -m h2o.parity.<name> --reference DIR --golden``): the
record, read once a module, the committed tiny model it was made on, and, for the first cuts as
:func:`h2o.parity.r_kv.golden_first` records them (r_kv's and g_kv's), ours against them: the recorded states' and
the evicting cache's."""
import json

import pytest
import torch

from h2o.parity.golden import load_model, weights_sha256


def golden_fixture(parity):
    """A module-scoped fixture: ``parity.RECORD``'s golden numbers (``golden = golden_fixture(parity)``)."""

    @pytest.fixture(scope="module")
    def golden():
        return json.loads(parity.RECORD.read_text())

    return golden


def recorded_model(golden: dict, **inputs):
    """The committed tiny model, once its weights are those ``golden`` was recorded on and each of ``inputs`` (what
    this checkout feeds it: ids, lengths, a seed) is the recorded one."""
    assert weights_sha256() == golden["model"]["sha256"]
    assert {k: golden[k] for k in inputs} == inputs
    return load_model()


def first_cut_gaps(first: dict, golden: dict) -> tuple[float, int]:
    """(largest |score difference|, heads whose kept positions differ) of ours (``first``: "layer/budget" -> our
    score and kept positions) against the golden first cuts."""
    gap, differ = 0.0, 0
    for key, row in first.items():
        layer, budget = key.split("/")
        ref = golden["first_cut"][layer]
        gap = max(gap, float((torch.tensor(row["ours_score"]) - torch.tensor(ref["score"])).abs().max()))
        differ += sum(a != b for a, b in zip(row["ours_kept"], ref["kept"][budget]))
    return gap, differ


def prompt_cuts_keep_the_golden(policy: str, options: dict, ids: torch.Tensor, golden: dict) -> None:
    """``ids`` as one prompt through ``policy``'s evicting cache (``options``; its own attention, the cut at the
    prompt's end), at each of ``golden``'s budgets: each layer's held positions per KV head are the golden first
    cut's (r_kv's and g_kv's)."""
    from h2o import attach, make_policy

    model = load_model()
    for budget in golden["budgets"]:
        with torch.no_grad(), attach(model, make_policy(policy, budget=budget, **options), mode="real") as h:
            cache = h.new_cache()
            model(ids, cache=cache)
        held = [[sorted(p for p in head.tolist() if p >= 0) for head in layer.pos[0]] for layer in cache.layers]
        assert held == [golden["first_cut"][str(i)]["kept"][str(budget)] for i in range(len(held))]
