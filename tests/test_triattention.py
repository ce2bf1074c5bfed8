"""triattention (TriAttention's key-only score from calibrated query centres): the score equals a naive per-offset
computation from the keys turned back before RoPE by the model's own rotary; the prompt's tokens are kept first;
both paths agree on every tiny RoPE architecture (GQA, partial rotary, Gemma-3's sliding layers) on a left-padded
batch at every step and every N tokens; the calibration equals the queries recomputed from ``q_proj``; ours equals
the reference's kept sets and scores through the golden numbers ``python -m h2o.parity.triattention --reference DIR
--golden`` recorded (tests/data/parity_golden/triattention.json), and broken variants miss them; bad input and a
missing calibration are one line, the latter before the model loads, naming the command."""
import math

import pytest
import torch

from h2o import attach, make_policy
from h2o.assets.models import tiny_model
from h2o.assets.tiny import byte_tokenizer
from h2o.assets.triattention import calibrate, require, stats_file, weights_digest
from h2o.core.policies import PolicyError
from h2o.core.policies.budget import Unsupported
from h2o.core.policies.triattention import TriAttention
from h2o.parity import triattention as parity
from tests.golden import golden_fixture, recorded_model
from tests.two_paths import P, padded_paths

ARCHS = ("llama", "llama_gqa", "gpt_neox", "gemma3")  # RoPE models (OPT has none: refused)
TOLERANCE = 1e-3  # |score ours - reference|; measured 4.3e-4 on scores up to 9.3 when recorded (the reference's
# distances in fp32; 9.5e-7 with them in float64: docs/results/parity.md)


def austen_ids() -> torch.Tensor:
    return torch.tensor(byte_tokenizer()(parity.TEXT, add_special_tokens=False).input_ids)[None]  # (1, T)


@pytest.fixture(scope="module", params=ARCHS)
def calibrated(request):
    model = tiny_model(request.param, seed=2)
    return model, calibrate(model, austen_ids(), "test", {"model": request.param})


# ----------------------------------------------------------------------------------------------- the rule
def naive_scores(model, cal: dict, layer: int, keys: torch.Tensor, pos: torch.Tensor, now: int,
                 max_length: int = 65536) -> torch.Tensor:
    """keys (Hkv, S, D) after RoPE at positions pos (S,) -> (Hq, S): the reference's formula term by term, one
    offset at a time, in float64, the keys turned back with the model's rotary (cos, sin) at their positions."""
    rotary = next(m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding"))
    kind = getattr(model.config, "layer_types", None)
    cos, sin = rotary(torch.zeros(()), pos[None], *([kind[layer]] if kind else []))  # (1, S, r)
    cos, sin = cos[0].double(), sin[0].double()
    r = cos.shape[-1]
    k = keys.double()
    turned = k[..., :r]
    half = torch.cat([-turned[..., r // 2:], turned[..., :r // 2]], -1)
    k = torch.cat([(turned * cos - half * sin) / (cos * cos + sin * sin), k[..., r:]], -1)  # before RoPE
    D = k.shape[-1]
    rest = (D - r) // 2
    re = torch.cat([k[..., :r // 2], k[..., r:r + rest]], -1)
    im = torch.cat([k[..., r // 2:r], k[..., r + rest:]], -1)
    omega, scale = cal["omega"][layer], cal["scale"][layer]
    qr, qi, qabs = (cal[n][layer].double() for n in ("q_mean_real", "q_mean_imag", "q_abs_mean"))
    Hq, Hkv = qr.shape[0], k.shape[0]
    out = torch.zeros(Hq, k.shape[1], dtype=torch.float64)
    for h in range(Hq):
        kr, ki = re[h // (Hq // Hkv)], im[h // (Hq // Hkv)]  # (S, F)
        amp = torch.hypot(qr[h], qi[h]) * torch.hypot(kr, ki)
        phi = torch.atan2(qi[h] * kr - qr[h] * ki, qr[h] * kr + qi[h] * ki)  # arg(qbar conj(k))
        extra = ((qabs[h] - torch.hypot(qr[h], qi[h])) * torch.hypot(kr, ki) * scale ** 2).sum(-1)
        n = int(math.log2(max_length)) + 1
        for o in (2.0 ** i for i in range(n)):
            d = (now + 1 - pos.double() + o)[:, None]
            out[h] += (amp * scale ** 2 * torch.cos(d * omega + phi)).sum(-1) / n
        out[h] += extra
    return out


def test_the_score_is_the_references_formula_term_by_term(calibrated):
    model, cal = calibrated
    policy = make_policy("triattention", budget=8, stats=cal)
    g = torch.Generator().manual_seed(0)
    Hkv = model.config.num_key_value_heads if hasattr(model.config, "num_key_value_heads") else \
        model.config.num_attention_heads
    D = cal["q_abs_mean"].shape[-1] * 2
    for layer in range(cal["layers"]):
        rule = policy.for_layer(layer, cal["layers"])
        keys = torch.randn(Hkv, 12, D, generator=g)
        pos = torch.tensor([0, 1, 2, 5, 9, 10, 30, 31, 40, 41, 42, 60])
        ours = rule.head_scores(keys[None], pos.expand(1, Hkv, -1), torch.tensor([61]))[0]  # (Hkv, G, S)
        naive = naive_scores(model, cal, layer, keys, pos, 61)
        torch.testing.assert_close(ours.reshape(naive.shape).double(), naive, atol=2e-4, rtol=1e-5)


def test_the_prompt_is_kept_first_and_the_generated_tokens_compete(calibrated):
    model, cal = calibrated
    rule = make_policy("triattention", budget=10, stats=cal).for_layer(0, cal["layers"])
    Hkv = getattr(model.config, "num_key_value_heads", None) or model.config.num_attention_heads
    keys = torch.randn(1, Hkv, 20, cal["q_abs_mean"].shape[-1] * 2, generator=torch.Generator().manual_seed(1))
    pos, now = torch.arange(20).expand(1, Hkv, 20), torch.tensor([19])
    counts = rule.counts(torch.tensor([6]))  # a prompt of 6 tokens
    kept = rule.keep(rule.priority(pos, rule.cut_score(None, keys, pos >= 0), now, counts), pos, pos >= 0, counts)
    assert kept[..., :6].all() and (kept.sum(-1) == 10).all()  # the prompt, then the 4 best of the 14 generated
    score = rule.scores(keys, pos, now, pos >= 6)[..., 6:]  # (1, Hkv, 14)
    for h in range(Hkv):
        assert set(torch.nonzero(kept[0, h, 6:]).flatten().tolist()) == set(score[0, h].topk(4).indices.tolist())
    long = rule.counts(torch.tensor([15]))  # a prompt past the budget: its oldest tokens (as the reference)
    kept = rule.keep(rule.priority(pos, keys, now, long), pos, pos >= 0, long)
    assert (kept == (pos < 10)).all()
    free = make_policy("triattention", budget=10, stats=cal, allow_prefill_compression=True)
    free = free.for_layer(0, cal["layers"])
    kept = free.keep(free.priority(pos, keys, now, counts), pos, pos >= 0, counts)
    assert not kept[..., :6].all()  # every token scored


# ----------------------------------------------------------------------------------------------- both paths
@pytest.mark.parametrize("compress", ["decode", "interval", "buffer"])
@pytest.mark.parametrize("budget,prefill", [(P + 4, False), (0.4, True)])
def test_both_paths_agree_on_a_padded_batch(calibrated, compress, budget, prefill):
    model, cal = calibrated
    policy = make_policy("triattention", budget=budget, stats=cal, allow_prefill_compression=prefill,
                         compress=compress, interval=None if compress == "decode" else 3)
    sim, full, _ = padded_paths(model, policy)
    assert not torch.allclose(sim[:, -6:], full[:, -6:], atol=1e-3)


def test_the_calibration_is_the_mean_query_before_rope():
    """The tiny Llama's queries recomputed from ``q_proj`` of each attention module's input (the reference's way;
    no query norm there): their complex pairs' mean and mean modulus per head are the calibration's."""
    model = tiny_model("llama_gqa", seed=2)
    ids = austen_ids()
    cal = calibrate(model, ids, "test", {})
    seen = {}
    hooks = [layer.self_attn.register_forward_pre_hook(
        lambda m, a, kw: seen.__setitem__(m.layer_idx, kw["hidden_states"]), with_kwargs=True)
        for layer in model.model.layers]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    for i, layer in enumerate(model.model.layers):
        att = layer.self_attn
        q = att.q_proj(seen[i]).view(1, ids.shape[1], -1, att.head_dim)[0].transpose(0, 1).double()  # (Hq, T, D)
        c = torch.complex(q[..., :att.head_dim // 2], q[..., att.head_dim // 2:])
        torch.testing.assert_close(cal["q_mean_real"][i], c.mean(1).real.float(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(cal["q_mean_imag"][i], c.mean(1).imag.float(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(cal["q_abs_mean"][i], c.abs().mean(1).float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cal["omega"], model.model.rotary_emb.inv_freq.double().expand_as(cal["omega"]))


# ----------------------------------------------------------------------------------------------- parity
golden = golden_fixture(parity)


@pytest.fixture(scope="module")
def recorded(golden):
    model = recorded_model(golden, ids=parity.golden_ids()[0].tolist())
    return parity.calibration(model), parity.record_states(model, parity.golden_ids())


def gaps(first: dict, golden: dict) -> tuple[float, int]:
    gap, differ = 0.0, 0
    for budget, row in first.items():
        ref = golden["first_cut"][budget]
        for a, b in zip(row["ours_score"], ref["score"]):
            gap = max(gap, float((torch.tensor(a) - torch.tensor(b)).abs().max()))
        differ += sum(x != y for a, b in zip(row["ours_kept"], ref["kept"]) for x, y in zip(a, b))
    return gap, differ


def test_the_first_cut_equals_the_reference(recorded, golden):
    assert golden["options"] == parity.OPTIONS and golden["budgets"] == list(parity.BUDGETS)
    gap, differ = gaps(parity.first_cuts(*recorded), golden)
    assert gap < TOLERANCE and differ == 0, (gap, differ)
    assert golden["summary"]["first_cut"]["heads_kept_differently"] == 0


def test_every_later_cut_equals_the_reference(recorded, golden):
    ours = parity.later_cuts(*recorded, golden["budgets"][0])
    assert len(ours) == len(golden["later_cuts"]) > 3
    assert [(r["now"], r["ours"]) for r in ours] == [(r["now"], r["kept"]) for r in golden["later_cuts"]]


def test_broken_rules_miss_the_golden_numbers(recorded, golden, monkeypatch):
    with monkeypatch.context() as m:  # the group's mean where the reference takes its maximum
        m.setitem(parity.OPTIONS, "head_aggregation", "mean")
        _, differ = gaps(parity.first_cuts(*recorded), golden)
    assert differ > 0
    with monkeypatch.context() as m:  # the distance measured from the newest token, not the one after it
        inner = TriAttention.head_scores
        m.setattr(TriAttention, "head_scores", lambda self, k, p, now: inner(self, k, p, now - 1))
        gap, _ = gaps(parity.first_cuts(*recorded), golden)
    assert gap > 10 * TOLERANCE


def test_the_evicting_caches_later_cuts_keep_the_references_positions(recorded, golden):
    """The golden prompt then one token at a time through the evicting cache at compress=buffer (the reference's
    slack trigger) holds, at each cut, the reference's kept positions per KV head: every layer's at the first cut,
    the first layer's at every cut (after a cut the later layers' keys are those of the evicted attention, no longer
    the recorded full-attention forward's)."""
    from h2o.parity.golden import load_model

    cal, _ = recorded
    model, ids = load_model(), parity.golden_ids()
    budget, P_ = golden["budgets"][0], parity.PROMPT
    policy = make_policy("triattention", budget=budget, stats=cal, compress="buffer", interval=parity.EVERY,
                         **parity.OPTIONS)
    cuts = {r["now"]: r["kept"] for r in golden["later_cuts"]}
    seen = 0
    with torch.no_grad(), attach(model, policy, mode="real") as h:
        cache = h.new_cache()
        model(ids[:, :P_], cache=cache)
        for t in range(P_, ids.shape[1]):
            model(ids[:, t:t + 1], cache=cache)
            if t in cuts:
                held = [[sorted(p for p in head.tolist() if p >= 0) for head in layer.pos[0]] for layer in cache.layers]
                assert held[:None if not seen else 1] == cuts[t][:None if not seen else 1], t
                seen += 1
    assert seen == len(cuts)


# ----------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("kwargs,needle", [
    ({"head_aggregation": "min"}, r"^head_aggregation='min': allowed: max, mean$"),
    ({"normalize_scores": 1}, r"^normalize_scores=1: allowed: true or false$"),
    ({"offset_max_length": 0}, r"^offset_max_length=0: .*allowed: an int >= 1$"),
    ({"stats": "/nowhere.pt"}, r"^stats='/nowhere.pt': no such file; allowed: .*python -m h2o.assets.triattention"),
    ({"stats": {"layers": 1}}, r"^stats: not a calibration .*missing\); allowed: "),
])
def test_bad_options_are_one_line(kwargs, needle):
    with pytest.raises(PolicyError, match=needle):
        make_policy("triattention", **kwargs)


def test_a_rule_without_its_models_statistics_is_one_line(calibrated):
    model, cal = calibrated
    with pytest.raises(PolicyError, match=r"^policy=triattention: no calibration \(stats=None\).*"
                                          r"`python -m h2o.assets.triattention model=<name>`$"):
        make_policy("triattention").for_layer(0, 2)
    with pytest.raises(PolicyError, match=r"has 2 layers, this model 5; allowed: the model's own"):
        make_policy("triattention", stats={**cal, "layers": 2}).for_layer(0, 5)
    with pytest.raises(PolicyError, match=r"^policy=triattention: model_type=opt has no rotary embedding"):
        calibrate(tiny_model("opt"), austen_ids(), "test", {})


def test_a_run_without_calibration_refuses_before_loading_and_records_the_digest(tmp_path, monkeypatch):
    from h2o.assets.model_spec import ModelSpec
    from h2o.assets.triattention import save

    monkeypatch.setenv("H2O_CACHE", str(tmp_path))
    spec = ModelSpec("tiny-llama", "tiny:llama")
    with pytest.raises(PolicyError, match=r"^policy=triattention: no calibration for model=tiny-llama \(weights "
                                          r"[0-9a-f]{12}\); write it once with `python -m h2o.assets.triattention "
                                          r"model=tiny-llama`$"):
        require(spec)
    from h2o.assets.triattention import checkpoint_folder

    digest = weights_digest(checkpoint_folder(spec.pretrained))
    model = tiny_model("llama")
    save(calibrate(model, austen_ids(), digest, {"model": "tiny-llama"}), stats_file(digest))
    assert require(spec) == require("tiny-llama") == stats_file(digest)
    with pytest.raises(PolicyError, match=r"^policy=triattention: model=tiny-opt has no rotary embedding"):
        require(ModelSpec("tiny-opt", "tiny:opt"))
    policy = make_policy("triattention", budget=16).calibrated(require(spec))
    assert policy.describe()["calibration"]["digest"] == digest
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "config.json").write_text("{}")  # a checkpoint folder without its weights
    with pytest.raises(Unsupported, match=r"^policy=triattention: model=bare has no weight files in .*bare, so it "
                                          r"has no calibration; allowed: a model with its weights on this machine$"):
        require(ModelSpec("bare", str(tmp_path / "bare")))


def test_greedy_generation_equals_the_references_own_model_patch(recorded, golden, monkeypatch):
    """160 greedy tokens through the evicting cache equal those of the reference's ``apply_triattention_patch``
    (its forward wrapper and slack trigger), each step's log-probability within 1e-5 (9.5e-7 when recorded); the
    full cache's differ (the comparison is not vacuous), and so does a rule that scores the prompt too."""
    cal, _ = recorded
    want = golden["generation"]
    assert (want["prompt"], want["budget"]) == (parity.GEN_PROMPT, parity.GEN_BUDGET)
    gen = parity.generation(cal)
    tokens, logp = gen["ours"]
    assert tokens == want["tokens"]
    assert max(abs(a - b) for a, b in zip(logp, want["logprob"])) < 1e-5
    assert sum(a != b for a, b in zip(gen["full"][0], want["tokens"])) == golden["summary"]["generation"][
        "tokens_unlike_full"] > 50
    with monkeypatch.context() as m:
        m.setitem(parity.OPTIONS, "allow_prefill_compression", True)
        assert parity.generation(cal)["ours"][0] != want["tokens"]


def test_lm_eval_finds_the_calibration_or_refuses_before_loading(tmp_path, monkeypatch):
    """lm-eval's ``--model h2o --model_args pretrained=tiny:llama,policy=triattention``: the conf/model name in the
    refusal (the command's spelling), raised before the model loads; with the file, the rule carries its digest."""
    from h2o.assets.triattention import checkpoint_folder, save
    from h2o.tasks import lm_eval_model

    monkeypatch.setenv("H2O_CACHE", str(tmp_path))
    loads = []
    monkeypatch.setattr(lm_eval_model.HFLM, "__init__", lambda self, **kw: loads.append(kw))
    with pytest.raises(PolicyError, match=r"model=tiny-llama`$"):
        lm_eval_model.H2OLM(pretrained="tiny:llama", policy="triattention", budget=16)
    assert loads == []
    digest = weights_digest(checkpoint_folder("tiny:llama"))
    save(calibrate(tiny_model("llama"), austen_ids(), digest, {"model": "tiny-llama"}), stats_file(digest))
    lm = lm_eval_model.H2OLM(pretrained="tiny:llama", policy="triattention", budget=16)
    assert lm.policy.describe()["calibration"]["digest"] == digest and len(loads) == 1


def test_the_calibration_equals_the_references_script_in_its_dtype(golden, monkeypatch):
    """The reference's scripts/calibrate.py (bfloat16, queries recomputed from ``q_proj`` through RoPE and back),
    recorded over the parity text on the committed model: ours with the model in bfloat16 on the same ids is within
    1e-3 of each statistic (4.4e-4 when recorded: its bf16 RoPE round trip); pairing channels (even, odd) as an
    interleaved rotary would, instead of the halves, misses."""
    from h2o.core.policies import triattention as rule

    want = {k: torch.tensor(v) for k, v in golden["calibration"].items()}
    gaps = parity.calibration_gaps(parity.ours_in_bf16(), want)
    assert max(g["largest_gap"] for g in gaps.values()) < 1e-3, gaps
    with monkeypatch.context() as m:
        m.setattr(rule, "complex_pairs", lambda x, r: torch.complex(x[..., 0::2], x[..., 1::2]))
        gaps = parity.calibration_gaps(parity.ours_in_bf16(), want)
    assert max(g["largest_gap"] for g in gaps.values()) > 0.1, gaps
