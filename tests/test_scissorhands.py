"""scissorhands against a naive re-implementation of the paper's rule (docs/methods.md), both paths equal on tiny
models with a history window shorter than the sequence (left-padded batches, GQA, a quantized cache), its options
and spelling. The registry's matrices (tests/test_paths.py, test_sliding_window.py, test_quant.py, test_rerotate.py)
run it at its defaults too."""
import pytest
import torch

from h2o import attach, make_policy
from h2o.assets.models import TINY_ARCHS, tiny_model
from h2o.assets.policy_config import build_policy, parse
from h2o.core.policies import PolicyError
from h2o.core.policies.per_sequence import PerSequence
from h2o.core.quant import Uniform
from tests.test_paths import ATOL, padded_batch_equals_alone, real_prefill_decode, simulated, tokens
from tests.test_policies import random_logits, run_mask


def naive_scissorhands(logits: torch.Tensor, K: int, history: int, window: int, prompt: int = 0,
                       count: str = "unimportant", threshold=None, steps_of_all: bool = False,
                       once: bool = False) -> torch.Tensor:
    """logits (T, T) of one head -> (T, T) bool rows seen. A list of held tokens; each row attends to the held ones
    and itself (softmax over them), and every token it saw records whether its weight was below ``1/t`` (t: the
    tokens seen); a token's count is its records from the last ``history`` rows. Rows < prompt see their prefix
    and the prompt is then cut to the K of highest priority (newer first on ties); from then on, when K are held,
    the arriving row drops the one of lowest priority (older first on ties), or (``once``: compress=prefill) keeps
    every newer token. Priority: +inf for the ``min(window, K - 1)`` tokens before the arriving one, else minus the
    unimportant count (plus the important one).
    Broken variants for the test that this reference can fail: ``threshold`` (t -> a callable of (i, t)),
    ``steps_of_all`` (every record kept: no history window)."""
    T = logits.shape[-1]
    rows = torch.zeros(T, T, dtype=torch.bool)
    keep, marks = [], {}

    def prio(j, now):
        if j >= now - min(window, K - 1):
            return float("inf")
        kept = marks[j] if steps_of_all else marks[j][-history:]
        n = sum(kept)
        return -n if count == "unimportant" else n

    for i in range(T):
        if prompt and i == prompt and len(keep) > K:
            keep = sorted(sorted(keep, key=lambda j: (prio(j, prompt - 1), j), reverse=True)[:K])
        if i >= prompt and len(keep) == K and not (once and prompt):
            keep.remove(min(keep, key=lambda j: (prio(j, i), j)))
        keep.append(i)
        marks[i] = []
        seen = list(range(i + 1)) if i < prompt else keep
        rows[i, seen] = True
        p = torch.softmax(logits[i, seen], -1)
        t = len(seen) if threshold is None else threshold(i, len(seen))
        below = (p * t < 1).tolist()  # in fp32, as the attention's probabilities are
        for j, low in zip(seen, below):
            marks[j].append(int(low) if count == "unimportant" else int(not low))
    return rows


CASES = [(6, 4, 2, 0), (8, 3, 0, 0), (5, 10, 1, 0), (7, 4, 2, 16), (4, 2, 3, 12)]  # K, history, window, prompt


@pytest.mark.parametrize("count", ["unimportant", "important"])
@pytest.mark.parametrize("K,history,window,prompt", CASES)
def test_scissorhands_against_naive(K, history, window, prompt, count):
    logits = random_logits(32, seed=K + history + prompt)
    policy = make_policy("scissorhands", budget=K, history=history, window=window, count=count)
    mask = run_mask(policy, logits, prompt_len=prompt)
    for b in range(2):
        for h in range(3):
            want = naive_scissorhands(logits[b, h], K, history, window, prompt, count)
            assert torch.equal(mask[b, h], want), (b, h)


def test_naive_reference_is_not_blind():
    """Deliberately broken rules keep other tokens: no history window, a threshold of 1/(position + 1) (the paper's
    1/t read as the step number), the other count; and the rule is not local's."""
    logits = random_logits(40, seed=3)[0, 0]
    K, w, r = 8, 4, 2
    right = naive_scissorhands(logits, K, w, r)
    assert torch.equal(run_mask(make_policy("scissorhands", budget=K, history=w, window=r), logits[None, None])[0, 0],
                       right)
    broken = [naive_scissorhands(logits, K, w, r, steps_of_all=True),
              naive_scissorhands(logits, K, w, r, threshold=lambda i, t: i + 1),
              naive_scissorhands(logits, K, w, r, count="important")]
    assert all(not torch.equal(b, right) for b in broken)
    local = run_mask(make_policy("local", budget=K), logits[None, None])[0, 0]
    assert not torch.equal(local, right)


def test_a_small_budget_is_a_window():
    """The recent window covers every held token: the oldest goes, as in local."""
    logits = random_logits(24, seed=4)
    mask = run_mask(make_policy("scissorhands", budget=5, window=10), logits)
    assert torch.equal(mask, run_mask(make_policy("local", budget=5), logits))


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_both_paths_equal_left_padded_batch(arch):
    """A left-padded batch, prefilled then decoded through the evicting cache, equals each sequence alone, and each
    alone equals the simulated mask with the prompt's rows unmasked (history 5 < the 14 decoded steps); from the
    first token on, the cache equals the simulated mask too."""
    model = tiny_model(arch)
    policy = make_policy("scissorhands", budget=0.3, history=5, window=2)
    seqs, prompts, alone = padded_batch_equals_alone(model, policy, [34, 28], 0.5, seed=20)
    for s, p, real in zip(seqs, prompts, alone):
        assert torch.allclose(real, simulated(model, policy, s, prompt_len=p), atol=ATOL)
    one = seqs[0]
    sim = simulated(model, policy, one)
    real, _ = real_prefill_decode(model, policy, one, prompt=0, ref_len=one.shape[1])
    assert torch.allclose(real, sim, atol=ATOL)
    assert not torch.allclose(sim, simulated(model, make_policy("h2o", budget=0.3), one), atol=1e-3)


@pytest.mark.parametrize("compress", ["decode", "prefill"])
def test_quantized_cache_gqa_both_timings(compress):
    """GQA (2 query heads per KV head), a 4-bit cache: both paths equal in either timing; the state is the history
    window's bytes per slot, counted beside the keys and values."""
    model = tiny_model("llama_gqa")
    policy = make_policy("scissorhands", budget=0.3, history=5, window=1, compress=compress)
    ids, P = tokens(40, 7), 20
    quant = Uniform(4, 8)
    with torch.no_grad():
        with attach(model, policy, quant=quant, prompt_len=P):
            sim = model(ids).logits
        with attach(model, policy, mode="real", quant=quant) as h:
            cache = h.new_cache()
            real = [model(ids[:, :P], cache=cache).logits]
            real += [model(ids[:, t:t + 1], cache=cache).logits for t in range(P, 40)]
    assert torch.allclose(torch.cat(real, 1), sim, atol=ATOL)
    layer = cache.layers[0]
    assert layer.acc.shape == (*layer.pos.shape, 5) and layer.acc.dtype == torch.uint8
    held = int((layer.pos >= 0).sum(-1).max())
    assert held == (6 if compress == "decode" else 6 + 20)  # 30% of the prompt, then every later token kept


def test_prefill_cut_keeps_the_counts_of_the_prompts_last_queries():
    """compress=prefill: rows after the prompt see what the cut kept (the naive rule's cut) plus every newer token."""
    logits = random_logits(30, seed=9)
    K, w, r, P = 6, 5, 1, 18
    mask = run_mask(make_policy("scissorhands", budget=K, history=w, window=r, compress="prefill"), logits, P)
    for b in range(2):
        for h in range(3):
            cut = naive_scissorhands(logits[b, h], K, w, r, prompt=P, once=True)[P, :P]  # row P's view of the prompt
            assert torch.equal(mask[b, h, P:, :P], cut.expand(30 - P, P))
            assert mask[b, h, P:, P:].equal(torch.ones(30 - P, 30 - P, dtype=torch.bool).tril())


def test_options_spelling_and_bad_values():
    hydra = build_policy("scissorhands", budget=0.1, history=64, window=4)
    name, opts = parse("policy=scissorhands,budget=0.1,history=64,window=4")
    assert build_policy(name, "--model_args ", **opts).describe() == hydra.describe() == {
        "policy": "scissorhands", "budget": 0.1, "heavy": 0.1, "recent": 0.0, "history": 64, "window": 4}
    assert make_policy("scissorhands", count="important").describe()["count"] == "important"
    for kw, words in [({"history": 0}, "history=0"), ({"window": -1}, "window=-1"),
                      ({"count": "often"}, "count='often'"), ({"history": 2.5}, "history=2.5")]:
        with pytest.raises(PolicyError, match=words.replace("(", r"\(")) as e:
            make_policy("scissorhands", **kw)
        assert "\n" not in str(e.value)
    with pytest.raises(PolicyError, match="keeps its own state per slot"):
        PerSequence([make_policy("h2o", budget=8), make_policy("scissorhands", budget=8)])


def test_a_shared_prefill_fork_is_refused_in_one_line():
    """The benchmark's shared prefill forks the full cache's summed scores; this policy's history is not there."""
    model = tiny_model("llama")
    ids = tokens(20, 1)
    with torch.no_grad(), attach(model, make_policy("full"), mode="real") as h:
        snap = h.new_cache(ref_len=20)
        model(ids, cache=snap)
    with attach(model, make_policy("scissorhands", budget=5), mode="real") as h:
        with pytest.raises(PolicyError, match="policy=scissorhands: keeps its own state per slot.*prefill=each"):
            h.new_cache(ref_len=20).fork(snap)


@pytest.mark.parametrize("args, words", [
    (["policy.history=0"], ["history=0", "int >= 1"]),
    (["policy.heavy=0.1", "policy.recent=0.1"], ["policy.heavy=0.1", "scissorhands reads only the whole budget"]),
])
def test_bad_options_through_the_runner(args, words, capsys, tmp_path, monkeypatch):
    """h2o-run: one line, exit 2, before a model loads."""
    from h2o.pipeline.run import main
    from tests.test_hardening import no_load, one_line_exit_2

    monkeypatch.chdir(tmp_path)
    no_load(monkeypatch)
    code = main(["model=tiny-llama", "policy=scissorhands", f"runs_dir={tmp_path}/runs", *args])
    one_line_exit_2(code, capsys, words)


def test_adakv_over_scissorhands_both_paths():
    """adakv's one top-k over the layer's heads reads this policy's state through its own (Policy.new_state)."""
    model = tiny_model("llama_gqa")
    policy = make_policy("adakv", budget=0.3, inner="scissorhands", compress="decode")
    ids, P = tokens(36, 8), 18
    real, cache = real_prefill_decode(model, policy, ids, prompt=P)
    assert torch.allclose(real, simulated(model, policy, ids, prompt_len=P), atol=ATOL)
    assert cache.layers[0].acc.dim() == 4
