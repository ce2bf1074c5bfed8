"""snapkv_d (SnapKV-D as the minghui-liu/kvpress fork runs it) against the fork itself, through the golden numbers
``python -m h2o.parity.snapkv_d --reference DIR --golden`` recorded (tests/data/parity_golden/snapkv_d.json): on the
committed tiny model, a prompt of 160 ids and 320 greedy tokens, ours keeps the fork's positions (its kept slots in
position order) at the prompt's cut and drops the fork's position at every decoding cut, in every layer and KV head,
generates its greedy tokens and gives its NLL per token (fp32 noise); kvpress 0.5.5's SnapKV at interval 1 (the
newest ``window`` rows, not the newest one), another kernel and summed rows miss them. Greedy decoding equals the
definition written naively over transformers' eager attention (Llama with GQA, OPT, GPT-NeoX); both paths agree on
four tiny architectures with a padded batch; ``compress=buffer interval=1`` makes the same cuts; the spellings build
the same rule; bad input is one line."""
import pytest
import torch

from h2o import attach, make_policy
from h2o.assets.models import tiny_model
from h2o.core.policies import PolicyError
from h2o.core.policies.snapkv_d import SnapKVD
from h2o.parity import snapkv_d as parity
from tests.golden import golden_fixture, recorded_model
from tests.two_paths import P, PADS, padded_paths

TOLERANCE = 2e-5  # |NLL ours - fork| per token; measured 1.3e-6 when recorded (two attention implementations)


golden = golden_fixture(parity)


@pytest.fixture(scope="module")
def model(golden):
    return recorded_model(golden, prompt=parity.prompt_ids()[0].tolist(), new=parity.NEW)


def misses(run: dict, fork: dict) -> tuple[int, int, float]:
    """(cut entries (layer, head) kept differently, greedy tokens differing, largest |NLL gap|) of ``run`` (ours,
    greedy) against the fork's golden record."""
    held = run["held"]
    kept = sum(a != b for a, b in zip(sum(held[0], []), sum(fork["prompt_cut"], [])))
    kept += sum(a != b for s, f in zip(parity.dropped(held), fork["dropped"]) for la, lf in zip(s, f)
                for a, b in zip(la, lf))
    tokens = sum(a != b for a, b in zip(run["tokens"], fork["greedy_in_position_order"]))
    gap = max(abs(a - b) for a, b in zip(run["nll"], fork["nll"]))
    return kept, tokens, gap


@pytest.mark.parametrize("case", list(parity.CASES))
def test_every_cut_and_token_equals_the_fork(model, golden, case):
    assert golden["cases"][case] == {"options": parity.CASES[case][0], "budget": parity.CASES[case][1]}
    fork = golden["fork"][case]
    run = parity.ours_run(model, case, parity.prompt_ids())
    assert misses(run, fork)[:2] == (0, 0)
    assert misses(run, fork)[2] < TOLERANCE
    budget = parity.CASES[case][1]
    assert all(len(h) == budget for step in run["held"] for layer in step for h in layer)  # back to n at each cut
    assert all(p >= 0 for step in fork["dropped"] for layer in step for p in layer)  # each cut dropped one
    # the prompt's last window is kept at its cut; later cuts drop prompt tokens and generated ones alike
    w = parity.CASES[case][0]["window"]
    assert all(set(range(parity.PROMPT - w, parity.PROMPT)) <= set(h) for h in sum(fork["prompt_cut"], []))
    drops = [p for step in fork["dropped"] for layer in step for p in layer]
    assert min(drops) < parity.PROMPT <= max(drops)


def test_the_fork_as_it_runs_differs_by_its_slot_order(golden):
    """Recorded with the reference: its cache in topk's order reads other tokens as the newest and as neighbours."""
    for case, row in golden["summary"].items():
        cuts = row["decoding_cuts_kept_differently"]
        assert cuts["in_position_order"] == 0 < cuts["as_it_runs"]
        assert row["largest_nll_gap"]["in_position_order"] < TOLERANCE < row["largest_nll_gap"]["as_it_runs"]
        assert row["greedy_tokens_equal_before_a_difference"]["in_position_order"] == parity.NEW
        assert golden["fork"][case]["greedy_as_it_runs"] != golden["fork"][case]["greedy_in_position_order"]


@pytest.mark.parametrize("broken", ["snapkv_window_rows", "kernel", "summed_rows"])
def test_a_broken_rule_misses_the_golden_numbers(model, golden, broken, monkeypatch):
    case = "w16_k3"
    options, budget = parity.CASES[case]
    if broken == "snapkv_window_rows":  # kvpress 0.5.5's SnapKV at interval 1: the newest w rows, not the newest one
        policy = make_policy("snapkv", budget=budget, compress="interval", interval=1, **options)
    elif broken == "kernel":
        policy = make_policy("snapkv_d", budget=budget, **{**options, "kernel": 5})
    else:  # each row's attention added to the state (H2O's accumulation) instead of the newest row's
        monkeypatch.setattr(SnapKVD, "accumulate", lambda self, acc, probs, valid=None:
                            acc.add_(probs.sum((2, 3)) / probs.shape[2]))
        policy = make_policy("snapkv_d", budget=budget, **options)
    kept, tokens, gap = misses(parity.ours_run(model, case, parity.prompt_ids(), policy=policy), golden["fork"][case])
    assert kept > 0 and (tokens > 0 or gap > 100 * TOLERANCE)


@pytest.mark.parametrize("arch", ["llama_gqa", "opt", "gpt_neox", "gemma3"])
def test_both_paths_agree_on_a_padded_batch(arch):
    """A left-padded batch of two prompts of P columns, then token by token: the simulated mask equals the evicting
    cache (tests/two_paths.py); every decoding cut brings each head back to its budget."""
    model = tiny_model(arch, seed=2)
    policy = make_policy("snapkv_d", budget=0.4, window=3, kernel=3)
    sim, full, cache = padded_paths(model, policy)
    assert not torch.allclose(sim[:, P:], full[:, P:], atol=1e-3)  # the cuts change what follows
    totals = [int(policy.counts(torch.tensor([P - n])).total) for n in PADS]
    if arch != "gemma3":  # a sliding layer holds its window at most
        assert cache.held_tokens()[:, :, 0].tolist() == [totals] * len(cache.layers)


def test_greedy_generation_through_the_cache_equals_the_simulated_mask():
    """The tokens ``generate`` picks through the evicting cache, scored in one pass by the simulated mask: the same
    argmax at every generated position (grouped-query attention)."""
    model = tiny_model("llama_gqa", seed=4)
    ids = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(3))
    policy = make_policy("snapkv_d", budget=12, window=4, kernel=3)
    with torch.no_grad():
        with attach(model, policy, mode="real") as h:
            out = model.generate(ids, cache=h.new_cache(), max_new_tokens=24, min_new_tokens=24, do_sample=False,
                                 pad_token_id=0)
        with attach(model, policy, prompt_len=20):
            sim = model(out).logits
    assert torch.equal(sim[0, 19:-1].argmax(-1), out[0, 20:])


def test_the_spellings_build_the_same_rule():
    from hydra import initialize_config_dir
    from lm_eval.utils import simple_parse_args_string

    from h2o.assets.paths import CONF
    from h2o.pipeline.spec import build
    from h2o.pipeline.sweep import _compose
    from h2o.tasks.lm_eval_model import lm_policy

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        default = build("policy", _compose(["policy=snapkv_d"]).policy)
        hydra = build("policy", _compose(["policy=snapkv_d", "policy.window=16", "policy.budget=128",
                                          "+policy.interval=4"]).policy)
        decode = build("policy", _compose(["policy=snapkv_d", "policy.compress=decode"]).policy)
    args = simple_parse_args_string("pretrained=tiny:llama,policy=snapkv_d,window=16,budget=128,interval=4")
    lm = lm_policy(args.pop("policy"), args)
    api = make_policy("snapkv_d", window=16, budget=128, interval=4)
    assert hydra.describe() == lm.describe() == api.describe() == {
        "policy": "snapkv_d", "budget": 128, "heavy": 128, "recent": 0, "compress": "interval", "interval": 4,
        "window": 16, "kernel": 5}
    assert default.describe() == make_policy("snapkv_d").describe() == {
        "policy": "snapkv_d", "budget": 512, "heavy": 512, "recent": 0, "compress": "interval", "interval": 1,
        "window": 64, "kernel": 5}  # the fork's: cache_budget 512, a cut after every token, SnapKVPress's defaults
    assert decode.schedule.evicts_each_step


@pytest.mark.parametrize("options,message", [
    ({"window": 0}, r"^window=0: the observation window must be an int >= 1$"),
    ({"kernel": 4}, r"^kernel=4: the pooling kernel must be an odd int >= 1$"),
    ({"interval": 0}, r"^interval=0: compress=interval needs the generated tokens between two cuts; allowed: an int"),
    ({"compress": "prefill", "interval": 2}, r"^interval=2: read only with compress=interval"),
])
def test_bad_options_are_one_line(options, message):
    with pytest.raises(PolicyError, match=message):
        make_policy("snapkv_d", **options)


def test_a_reference_path_without_the_code_is_one_line(tmp_path):
    with pytest.raises(SystemExit, match=r"^--reference=.*: no .*base_press\.py.*; allowed: a checkout of "
                                         r"minghui-liu/kvpress$"):
        parity.main(["--reference", str(tmp_path)])


def naive_snapkv_d(model, prompt: torch.Tensor, steps: int, n: int, w: int, kernel: int):
    """SnapKV-D written from its definition (docs/methods.md), literally: transformers' eager attention over a
    ``DynamicCache`` kept in position order; after the prompt (more than ``n`` tokens) and after each generated token
    attended (more than ``n`` held), the held keys but the newest ``w`` scored by the attention rows (the prompt's
    last ``w``, then the newest one), averaged over the rows, average-pooled (``kernel``, zero padding), averaged over
    each KV head's query heads; the top ``n - w`` of them and the newest ``w`` kept. -> (greedy tokens, logits)."""
    from transformers import DynamicCache

    cfg = model.config
    G = cfg.num_attention_heads // (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
    cache, tokens, logits = DynamicCache(config=cfg), [], []

    def cut(attentions, rows: int):
        for layer, attn in zip(cache.layers, attentions):  # attn (1, Hq, q, S)
            S = layer.keys.shape[2]
            if S <= n:
                continue
            m = attn[0, :, -rows:, :S - w].float().mean(1)  # (Hq, S - w)
            pooled = torch.nn.functional.avg_pool1d(m[:, None], kernel, 1, kernel // 2)[:, 0]
            score = pooled.view(-1, G, S - w).mean(1)  # (Hkv, S - w)
            older = score.topk(n - w, -1).indices.sort(-1).values  # the kept older keys, in position order
            keep = torch.cat([older, torch.arange(S - w, S).expand(older.shape[0], w)], -1)[None, :, :, None]
            layer.keys = layer.keys.gather(2, keep.expand(-1, -1, -1, layer.keys.shape[-1]))
            layer.values = layer.values.gather(2, keep.expand(-1, -1, -1, layer.values.shape[-1]))

    before = cfg._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            P = prompt.shape[1]
            out = model(prompt, cache=cache, use_cache=True, output_attentions=True)
            cut(out.attentions, w)
            for t in range(steps):
                logits.append(out.logits[0, -1])
                tokens.append(int(out.logits[0, -1].argmax()))
                out = model(torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True, output_attentions=True,
                            position_ids=torch.tensor([[P + t]]))
                cut(out.attentions, 1)
    finally:
        model.set_attn_implementation(before)
    return tokens, torch.stack(logits)


@pytest.mark.parametrize("arch", ["llama_gqa", "opt", "gpt_neox"])
def test_greedy_decoding_equals_the_definition_written_naively(arch):
    model = tiny_model(arch, seed=5)
    prompt = torch.randperm(120, generator=torch.Generator().manual_seed(2))[:30][None] + 1
    n, w, kernel, steps = 14, 4, 3, 20
    tokens, logits = naive_snapkv_d(model, prompt, steps, n, w, kernel)
    policy = make_policy("snapkv_d", budget=n, window=w, kernel=kernel)
    with torch.no_grad(), attach(model, policy, mode="real") as h:
        cache = h.new_cache()
        ours = [model(prompt, cache=cache).logits[0, -1]]
        ours += [model(torch.tensor([[t]]), cache=cache).logits[0, -1] for t in tokens[:-1]]
    torch.testing.assert_close(torch.stack(ours), logits, atol=1e-4, rtol=0)
    assert [int(x.argmax()) for x in ours] == tokens
    assert cache.held_tokens()[:, 0, 0].tolist() == [n] * len(cache.layers)


def test_the_buffer_schedule_of_one_token_makes_the_same_cuts(model, golden):
    """The fork cuts when a layer holds more than ``n``: ``compress=buffer interval=1`` says so literally, and keeps
    what ``interval=1`` keeps (a cut of ``n`` held tokens to ``n`` changes nothing)."""
    options, budget = parity.CASES["w16_k3"]
    policy = make_policy("snapkv_d", budget=budget, compress="buffer", interval=1, **options)
    assert misses(parity.ours_run(model, "w16_k3", parity.prompt_ids(), policy=policy),
                  golden["fork"]["w16_k3"])[:2] == (0, 0)


def test_the_decode_timing_agrees_in_both_paths():
    """compress=decode: the prompt's cut ranks the window rows' mean (accumulate_prompt) in both paths, then each
    arriving token takes the slot of the lowest score by the previous row (the simulated loop ranked the prompt's
    last row alone at the prompt's cut: 2.6 apart in the logits here)."""
    padded_paths(tiny_model("llama_gqa", seed=2), make_policy("snapkv_d", budget=0.3, compress="decode", window=3,
                                                              kernel=3))
