"""The field's implementations of one method: TriAttention's own R1KV and SnapKV beside ``r_kv`` and ``snapkv``,
through the golden numbers ``python -m h2o.parity.baselines --reference DIR --golden`` recorded
(tests/data/parity_golden/baselines.json): on the committed tiny model, ours at TriAttention's ``mix_lambda`` keeps
its R1KV's positions in every layer and head and gives its NLL; ours at R-KV's own ``mix_lambda`` and kvpress's
SnapKV keep what was recorded beside them (the overlaps of results/parity.md), and TriAttention's H2O fails as
recorded."""
import pytest
import torch

from h2o.parity import baselines as parity
from tests.golden import golden_fixture, recorded_model

TOLERANCE = 2e-5  # |NLL per token, ours - reference|; equal methods measured below 1e-6


golden = golden_fixture(parity)


@pytest.fixture(scope="module")
def model(golden):
    return recorded_model(golden, prompt=parity.PROMPT, cont=parity.CONT, seed=parity.SEED)


def rows(golden, reference: str):
    return [r for r in golden["rows"] if r["reference"] == reference]


def test_ours_at_its_mix_lambda_equals_triattentions_r1kv(model, golden):
    prompt, cont = parity.ids()
    equal = [r for r in rows(golden, "R1KV") if r["options"] == {"mix_lambda": 0.1}]
    assert len(equal) == len(parity.BUDGETS)
    for r in equal:
        ref = golden["references"][f"R1KV/{r['budget']}"]
        kept, nll = parity.ours(model, "r_kv", r["options"], r["budget"], prompt, cont)
        assert kept == ref["kept"]
        assert abs(nll - ref["nll"]) < TOLERANCE


@pytest.mark.parametrize("reference", ["R1KV", "SnapKV"])
def test_where_the_implementations_differ_ours_keeps_what_was_recorded(model, golden, reference):
    """R-KV's own mix_lambda (0.07; TriAttention's R1KV: 0.1) and kvpress's SnapKV (average pooling of the mean of
    the query heads' probabilities; TriAttention's: max pooling of the softmax of the heads' largest logits)."""
    prompt, cont = parity.ids()
    differ = [r for r in rows(golden, reference) if r["options"] != {"mix_lambda": 0.1}]
    assert differ
    for r in differ:
        kept, nll = parity.ours(model, r["policy"], r["options"], r["budget"], prompt, cont)
        ref = golden["references"][f"{reference}/{r['budget']}"]
        assert parity.overlap(ref["kept"], kept) == r["overlap"] and min(r["overlap"]) < 1
        assert abs(nll - r["ours_nll"]) < TOLERANCE and abs(nll - ref["nll"]) > 100 * TOLERANCE


def test_triattentions_h2o_fails_as_recorded(golden):
    """Its update_kv averages its scores over the KV heads (dim=-2 once the row axis is squeezed): no head axis is
    left for its gather, so it cannot run (docs/results/parity.md)."""
    assert "expanded size" in golden["h2o_error"] and not rows(golden, "H2O")


def test_a_reference_path_without_the_code_is_one_line(tmp_path):
    with pytest.raises(SystemExit, match=r"^--reference=.*: no .*utils\.py.*; allowed: a checkout of "
                                         r"WeianMao/triattention$"):
        parity.main(["--reference", str(tmp_path)])


def test_the_full_caches_nll_is_the_recorded_one(model, golden):
    prompt, cont = parity.ids()
    assert abs(parity.full_nll(model, prompt, cont) - golden["full_nll"]) < TOLERANCE
    assert torch.equal(torch.cat(parity.ids(), 1), torch.randint(
        3, parity.VOCAB, (1, parity.PROMPT + parity.CONT), generator=torch.Generator().manual_seed(parity.SEED)))


@pytest.mark.parametrize("budget", [48, 96])
def test_ours_equals_the_forks_h2o_with_a_press_per_layer(model, golden, budget):
    """The minghui-liu/kvpress fork's H2OPress (each token's mean attention since it arrived, a cut after every
    decoding token) is ``h2_only score=mean`` at ``compress=interval interval=1`` once each layer has its own press:
    the same dropped position at every cut, layer and head, the same NLL and greedy tokens. As shipped, its one press
    object carries one accumulated score for all layers (each layer reads the previous layer's), and ours is far
    from it, as recorded."""
    from h2o import make_policy
    from h2o.parity import snapkv_d

    record = golden["fork_h2o_record"]
    policy = make_policy("h2_only", budget=budget, score="mean", compress="interval", interval=1)
    run = snapkv_d.ours_run(model, "defaults", snapkv_d.prompt_ids(), policy=policy)
    per_layer, shipped = record[f"{budget}/one press per layer"], record[f"{budget}/as shipped"]
    assert run["held"][0] == per_layer["prompt_cut"] and snapkv_d.dropped(run["held"]) == per_layer["dropped"]
    assert max(abs(a - b) for a, b in zip(run["nll"], per_layer["nll"])) < TOLERANCE
    assert run["tokens"] == per_layer["greedy"] != shipped["greedy"]
    assert abs(sum(run["nll"]) - sum(shipped["nll"])) / len(run["nll"]) > 0.1
    assert snapkv_d.dropped(run["held"]) != shipped["dropped"]
