"""kvzip (kvpress 0.5.5's KVzipPress) on the real path: the replay's chunks and prompts, the selection over all
layers and heads, the budget it keeps, and the one-line refusals (the simulated path, batches). Its numbers against
kvpress's are in tests/test_parity_golden.py."""
from __future__ import annotations

import pytest
import torch

from h2o import attach, make_policy
from h2o.core.policies import PolicyError
from h2o.core.policies.kvzip_replay import FIRST, LATER, OVERLAP, replays, template_parts
from h2o.core.validate import BadInput

TEXT = ("The grass is green and the sky is blue. The code for the red door is 4821. Rain fell on the hills all day "
        "long, and the river ran high under the old stone bridge.\n")


@pytest.fixture(scope="module")
def tiny():
    from h2o.assets.model_spec import ModelSpec

    return ModelSpec("tiny-llama", "tiny:llama").load()


def test_the_replays_chunk_the_context_as_kvpress(tiny):
    _, tok = tiny
    prefix, suffix = template_parts(tok)
    assert (prefix, suffix) == (0, tok.encode("\n", add_special_tokens=False))  # no chat template
    context = list(range(3, 3 + 25))
    out = replays(tok, context, 2, suffix, 10)
    assert [(s, e) for s, e, _ in out] == [(2, 12), (12, 22), (22, 25)]
    first, later = (tok.encode(t, add_special_tokens=False) for t in (FIRST, LATER))
    assert out[0][2] == first + suffix + context[2:12]
    assert out[1][2] == later + context[12 - OVERLAP:12] + suffix + context[12:22]
    assert out[2][2] == later + context[22 - OVERLAP:22] + suffix + context[22:25]


@pytest.mark.parametrize("budget, layerwise", [(0.3, False), (0.3, True), (20, False)])
def test_the_cut_keeps_the_budget_over_all_layers_and_heads(tiny, budget, layerwise):
    model, tok = tiny
    ids = tok(TEXT, add_special_tokens=False).input_ids
    policy = make_policy("kvzip", budget=budget, layerwise=layerwise, chunk_size=40)
    with torch.no_grad(), attach(model, policy, mode="real") as h:
        cache = h.new_cache()
        model(input_ids=torch.tensor([ids]), cache=cache)
        held = cache.held_tokens()  # (L, 1, Hkv)
        L, _, H = held.shape
        numel = (1 if layerwise else L) * H * len(ids)  # what one count is taken of: a layer, or all layers
        kept = numel - int(numel * (1 - budget)) if isinstance(budget, float) else L * H * budget
        if layerwise:
            assert held.sum((1, 2)).tolist() == [kept] * L
            kept *= L
        assert int(held.sum()) == kept
        assert len(set(held.flatten().tolist())) > 1  # heads hold uneven counts
        for layer in cache.layers:  # the first n_sink tokens always kept, every head
            assert all(set(range(4)) <= set(p[p >= 0].tolist()) for p in layer.pos[0])
        model(input_ids=torch.tensor([ids[:7]]), cache=cache)  # later tokens kept whole, no second replay
        assert int(cache.held_tokens().sum()) == kept + 7 * L * H


def test_kvzip_is_refused_where_it_has_no_meaning(tiny, hydra_ctx, tmp_path):
    model, tok = tiny
    with pytest.raises(PolicyError, match=r"^policy=kvzip: mode=simulated: it scores the context by replaying it"):
        with attach(model, make_policy("kvzip"), prompt_len=4):
            pass
    with pytest.raises(PolicyError, match=r"^compress=decode: kvzip is defined at the end of a prompt only"):
        make_policy("kvzip", compress="decode")
    with pytest.raises(PolicyError, match=r"^chunk_size=0: the context tokens per replay must be an int >= 1$"):
        make_policy("kvzip", chunk_size=0)
    from h2o.pipeline.spec import prepare
    from h2o.pipeline.sweep import _compose

    root = ["model=tiny-llama", "policy=kvzip", f"runs_dir={tmp_path}"]
    with pytest.raises(BadInput, match=r"^policy=kvzip: semantics=simulated: it scores the context by replaying"):
        prepare(_compose([*root, "task=bb_copa"]))
    assert prepare(_compose([*root, "task=niah", "task.lengths=[512]"])).policy.name == "kvzip"
    from h2o.assets.models import tiny_model
    from h2o.core.attach import attention_modules

    sliding = tiny_model("gemma3")  # its layers' windows as the model passes them (no cache read)
    with pytest.raises(PolicyError, match=r"^policy=kvzip: the model has sliding-window layers"):
        make_policy("kvzip").compress_cache(sliding, attention_modules(sliding), None, torch.ones(1, 4).long(), None)


def test_kvzip_answers_many_questions_from_one_replay(tiny, monkeypatch):
    """task.questions: the context is replayed once, whatever the number of questions."""
    from h2o.core.policies import kvzip_replay
    from h2o.tasks.many_questions import ask

    model, tok = tiny
    calls = []
    real = kvzip_replay.score_context
    monkeypatch.setattr(kvzip_replay, "score_context", lambda *a: calls.append(1) or real(*a))
    ids = tok(TEXT, add_special_tokens=False).input_ids
    qs = [tok(q, add_special_tokens=False).input_ids for q in ("What is the code? It is", "Where? At")]
    answers, compressed, _ = ask(model, make_policy("kvzip", budget=0.3), ids, qs, 4, lambda o: False)
    assert len(calls) == 1 and len(answers) == 2 and compressed["tokens_held"] < 0.31 * len(ids) * 8


def test_a_padded_batch_holds_what_each_sequence_holds_alone(tiny):
    """Each sequence of a left-padded batch is replayed and cut alone: the same positions per layer and head."""
    model, tok = tiny
    texts = [TEXT, TEXT[:70] + "\n"]
    policy = make_policy("kvzip", budget=0.3)
    alone = []
    for t in texts:
        with torch.no_grad(), attach(model, policy, mode="real") as h:
            cache = h.new_cache()
            model(input_ids=torch.tensor([tok(t, add_special_tokens=False).input_ids]), cache=cache)
            alone.append([[sorted(p[p >= 0].tolist()) for p in layer.pos[0]] for layer in cache.layers])
    enc = tok(texts, add_special_tokens=False, padding=True, padding_side="left", return_tensors="pt")
    with torch.no_grad(), attach(model, policy, mode="real") as h:
        cache = h.new_cache()
        position = (enc.attention_mask.cumsum(-1) - 1).clamp(min=0)  # as generate counts them
        model(input_ids=enc.input_ids, attention_mask=enc.attention_mask, position_ids=position, cache=cache)
        batch = [[[sorted(p[p >= 0].tolist()) for p in layer.pos[b]] for layer in cache.layers] for b in range(2)]
    assert batch == alone


def test_keep_only_frees_the_dropped_slots_where_one_head_keeps_them_all(tiny):
    """A cut decided outside the step (kvzip's replay, per_head_pruning) where one head keeps every slot: the other
    heads' dropped slots are freed all the same (the storage keeps its S slots, the dropped ones empty)."""
    model, tok = tiny
    ids = tok(TEXT, add_special_tokens=False).input_ids[:12]
    with torch.no_grad(), attach(model, make_policy("full"), mode="real") as h:
        cache = h.new_cache()
        model(input_ids=torch.tensor([ids]), cache=cache)
        positions = cache.positions()  # per layer (1, Hkv, 12)
        keep = [p >= 0 for p in positions]
        for kept in keep:
            kept[0, 1:, 1::2] = False  # head 0 keeps all 12 slots, the others every other one
        cache.keep_only(keep)
        held = cache.held_tokens()  # (L, 1, Hkv)
        assert held[:, 0, 0].tolist() == [12] * len(keep)
        assert held[:, 0, 1:].unique().tolist() == [6]
        for layer, kept in zip(cache.layers, keep):
            assert torch.equal(layer.pos >= 0, kept)
