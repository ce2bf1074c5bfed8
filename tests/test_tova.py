"""tova against a naive re-implementation of its definition (docs/methods.md), and against kvpress's TOVAPress rule
at a prompt's end (the prefill score, computed from transformers' eager attention weights)."""
import pytest
import torch

from h2o import make_policy
from h2o.assets.models import tiny_model
from h2o.parity import driver as parity
from h2o.parity.pairs import kept as tokens_kept
from h2o.core.policies import PolicyError
from tests.test_parity import ids, reference
from tests.test_policies import random_logits, run_mask


def naive_tova(logits: torch.Tensor, K: int, prompt: int = 0) -> torch.Tensor:
    """logits (H, T, T) of one sequence, every head its own KV head -> (T, T) bool rows seen (the same for every
    head). Rows < prompt see their prefix; at the prompt's end the K tokens of highest head-averaged attention from
    its last row are kept (that row's own token always); then each row, when the cache is full, drops the token the
    previous row attended least (head-averaged; oldest on ties) and adds itself."""
    H, T, _ = logits.shape
    rows = torch.zeros(T, T, dtype=torch.bool)
    keep, score = [], None
    for i in range(T):
        if i == prompt and prompt > 0:
            top = sorted(range(prompt), key=lambda j: (j == prompt - 1, score[j], j), reverse=True)[:K]
            keep = sorted(top)
        if i >= prompt and len(keep) == K:
            keep.remove(min(keep, key=lambda j: (score[j], j)))
        keep.append(i)
        seen = list(range(i + 1)) if i < prompt else keep
        rows[i, seen] = True
        p = torch.softmax(logits[:, i, seen], -1).mean(0)  # (len(seen),) head-averaged
        score = {j: float(pj) for j, pj in zip(seen, p)}
    return rows


@pytest.mark.parametrize("K", [3, 6, 10])
@pytest.mark.parametrize("prompt", [0, 14])
def test_tova_against_naive(K, prompt):
    logits = random_logits(30, seed=K + prompt)
    mask = run_mask(make_policy("tova", budget=K), logits, prompt_len=prompt)
    for b in range(2):
        want = naive_tova(logits[b], K, prompt)
        for h in range(3):
            assert torch.equal(mask[b, h], want), (b, h)


def test_tova_differs_from_accumulated_scores():
    """The score is replaced by each query, not summed (an accumulating variant keeps other tokens)."""
    logits = random_logits(30, seed=5)
    assert not torch.equal(run_mask(make_policy("tova", budget=6), logits),
                           run_mask(make_policy("h2_only", budget=6), logits))


def test_naive_reference_is_not_blind():
    """A deliberately broken rule (the previous row's attention of head 0 alone) disagrees with the naive one."""
    logits = random_logits(30, seed=1)[0]
    broken = naive_tova(logits[:1].expand(3, -1, -1), 6)
    assert not torch.equal(broken, naive_tova(logits, 6))


@pytest.mark.parametrize("ratio", [0.5, 0.8])
def test_prefill_cut_is_kvpress_tova(ratio):
    """At a prompt's end the evicting cache keeps kvpress's TOVAPress set: the last token, plus the n - 1 others
    of highest attention from the last query averaged over all query heads (the same for every KV head)."""
    model = tiny_model("llama_gqa", seed=3)
    L, n = 40, tokens_kept(40, ratio)
    hkv = model.config.num_key_value_heads
    ctx, cont = ids(1, L), ids(2, 9)

    def keep(i, attn):  # attn (1, Hq, L, L) eager weights of layer i
        s = attn[0, :, L - 1, :L - 1].mean(0)  # (L - 1,)
        top = torch.cat([s.topk(n - 1).indices, torch.tensor([L - 1])]).sort().values
        return top[None].expand(hkv, -1)

    first, rest, held = parity.forwards(model, make_policy("tova", budget=n), ctx, [cont], L)
    ref_first, ref_rest = reference(model, ctx, cont, keep)
    assert held == [n] * model.config.num_hidden_layers
    torch.testing.assert_close(rest, ref_rest, atol=1e-5, rtol=1e-5)


def test_every_kv_head_holds_the_same_positions():
    from h2o import attach

    model = tiny_model("llama_gqa", seed=0)
    with torch.no_grad(), attach(model, make_policy("tova", budget=8), mode="real") as h:
        cache = h.new_cache()
        model(ids(3, 20), cache=cache)
        for t in range(6):
            model(ids(10 + t, 1), cache=cache)
    for layer in cache.layers:
        held = layer.pos[0].sort(-1).values  # (Hkv, S)
        assert (held == held[:1]).all()


def test_bad_options():
    with pytest.raises(PolicyError, match="budget=0"):
        make_policy("tova", budget=0)
    with pytest.raises(PolicyError, match="sinks"):
        make_policy("tova", budget=0.2, sinks=4)
