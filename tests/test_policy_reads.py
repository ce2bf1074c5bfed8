"""``Policy.reads``: each policy declares what its rule reads from a forward (h2o.core.policies.base: READ_KEYS,
READ_WINDOW, READ_ROWS, READ_QUERIES), and the declaration is what the rule uses: the attention rows it does not
declare can be anything without changing what a prefill keeps, the ones it declares change it."""
import pytest
import torch

from h2o import attach, make_policy
from h2o.assets.models import tiny_model
from h2o.core.policies import POLICIES, REAL_POLICIES, Policy
from h2o.core.policies.base import NOTHING, READ_KEYS, READ_LOGITS, READ_QUERIES, READ_ROWS, READ_WINDOW, READS
from h2o.core.policies.per_sequence import PerSequence
from tests.calibrated import ready

WINDOW = 6  # small observation windows, so that a 40-token prompt has rows before them
OPTIONS = {"snapkv": {"window": WINDOW}, "snapkv_d": {"window": WINDOW}, "pyramidkv": {"window": WINDOW},
           "scissorhands": {"history": WINDOW}, "adakv": {"window": WINDOW}, "r_kv": {"window": WINDOW},
           "g_kv": {"window": WINDOW},
           "triattention": {"allow_prefill_compression": True}}  # the prompt's keys scored at its cut
EXPECTED = {  # the declaration of every registered policy, as its rule is written
    "full": NOTHING, "local": NOTHING, "streaming_llm": NOTHING, "strided": NOTHING, "fixed": NOTHING,
    "random": NOTHING, "topk": NOTHING, "kvzip": NOTHING, "knorm": {READ_KEYS}, "keydiff": {READ_KEYS},
    "expected_attention": {READ_QUERIES}, "snapkv": {READ_WINDOW}, "snapkv_d": {READ_WINDOW},
    "pyramidkv": {READ_WINDOW},
    "adakv": {READ_WINDOW}, "tova": {READ_WINDOW}, "scissorhands": {READ_WINDOW}, "h2o": {READ_ROWS},
    "h2_only": {READ_ROWS}, "h2o_reference": {READ_ROWS}, "strided_h2": {READ_ROWS}, "fixed_h2": {READ_ROWS},
    "topk_h2": {READ_ROWS}, "r_kv": {READ_WINDOW, READ_LOGITS, READ_KEYS}, "g_kv": {READ_WINDOW, READ_KEYS},
    "triattention": {READ_KEYS},
}


def test_every_policy_declares_what_it_reads():
    assert sorted(EXPECTED) == POLICIES  # a new policy gets its line here
    for name in POLICIES:
        cls = Policy.registry[name]
        assert "reads" in vars(cls), f"{name}: reads not set on its class"
        assert cls.reads == EXPECTED[name] and cls.reads <= set(READS)
        p = make_policy(name)
        assert p.reads_keys == (READ_KEYS in p.reads)
        assert p.reads_queries == (READ_QUERIES in p.reads)
        assert p.needs_scores == bool(p.reads & {READ_ROWS, READ_WINDOW}) or name == "random"
        assert (p.read_window() > 0) == (READ_WINDOW in p.reads)
        own_cut = type(p).cut_score is not Policy.cut_score or type(p).step_score is not Policy.step_score
        assert own_cut == (READ_KEYS in p.reads) or name == "adakv"  # adakv: its inner's
        assert hasattr(p, "query_stats") == (READ_QUERIES in p.reads) or name == "adakv"


def test_wrappers_take_their_policies_declarations():
    for inner in ("knorm", "expected_attention", "tova", "h2o", "streaming_llm"):
        p = make_policy("adakv", inner=inner)
        assert p.reads == EXPECTED[inner] and p.reads_keys == (READ_KEYS in p.reads)
        assert p.read_window() == p.inner.read_window()
    assert make_policy("adakv", window=9).read_window() == 9
    assert make_policy("scissorhands", history=7).read_window() == 7 and make_policy("tova").read_window() == 1
    both = PerSequence([make_policy("h2o", budget=8), make_policy("tova", budget=8)])
    assert both.reads == {READ_ROWS, READ_WINDOW} and both.read_window() == 1
    with pytest.raises(TypeError, match="not in"):
        type("Odd", (Policy,), {"reads": frozenset({"gradients"})})


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def held(model, policy, ids, disturb=None, scores=False):
    """Positions each layer holds (``scores``: its scores ``acc``) after a real-path prefill of ``ids``;
    ``disturb(left)`` -> bool (B, rows) marks the rows whose attention the policy's hook (``accumulate_prompt``,
    which both paths call with each block of rows) is handed as noise instead (the attention output is untouched)."""
    hook = policy.accumulate_prompt
    calls = []

    def accumulate_prompt(acc, probs, valid, left):
        if disturb is not None:
            gen = torch.Generator().manual_seed(len(calls))
            noise = torch.rand(probs.shape, generator=gen) * (probs > 0)
            noise = noise / noise.sum(-1, keepdim=True).clamp(min=1e-30)
            probs = torch.where(disturb(left)[:, None, None, :, None], noise, probs)
        calls.append(probs.shape)
        return hook(acc, probs, valid, left)

    policy.accumulate_prompt = accumulate_prompt
    try:
        with torch.no_grad(), attach(model, policy, mode="real") as h:
            cache = h.new_cache()
            model(ids, cache=cache)
    finally:
        del policy.accumulate_prompt
    if scores:
        return [layer.acc for layer in cache.layers]
    return [layer.pos.sort(-1).values for layer in cache.layers]


# kvzip reads nothing of the prompt's forward: its replay, which needs the model's tokenizer (these tiny models
# have none), is tested in tests/test_kvzip.py
@pytest.mark.parametrize("name", [n for n in REAL_POLICIES if n not in ("full", "kvzip")])
def test_a_prefill_keeps_the_same_tokens_whatever_the_rows_it_does_not_read(model, name):
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(5))
    policy = ready(make_policy(name, budget=0.4, **OPTIONS.get(name, {})), model)
    w = policy.read_window()
    if READ_ROWS in policy.reads:
        unread, read = None, lambda left: left >= 0
    elif READ_WINDOW in policy.reads:
        unread, read = (lambda left: left >= w), (lambda left: (left >= 0) & (left < w))
    else:
        unread, read = (lambda left: left >= 0), None
    ref = held(model, policy, ids)
    if unread is not None:
        assert all(torch.equal(a, b) for a, b in zip(ref, held(model, policy, ids, unread)))
    if read is not None:  # the declared rows are read: noise there changes what is kept
        scores = not policy.evicts  # top-k keeps every token: its decoding steps rank by the scores read
        ref = held(model, policy, ids, scores=scores)
        assert not all(torch.equal(a, b) for a, b in zip(ref, held(model, policy, ids, read, scores)))
