"""Each policy declares every form of its rule on its class; the paths dispatch by what it declares. A new
score-based policy in a module of its own (outside the package) plus its config gets both paths, the default
decoder, and on CUDA the notice that the torch row loop serves it (it declares no kernel form)."""
import sys
import warnings

import pytest
import torch
from omegaconf import OmegaConf

from h2o import attach, make_policy
from h2o.assets.models import tiny_model
from h2o.core import row_kernel
from h2o.core.policies import Policy
from h2o.core.policies.base import Decoder, declared
from h2o.core.policies.h2o import H2O
from h2o.core.simulate import causal_valid, policy_allowed
from h2o.pipeline.spec import build

TOY = '''
"""toy_recency: heavy hitters with a small bonus for newer tokens (no window, no closed form, no kernel)."""
from h2o.core.policies.score import Scored


class Toy(Scored):
    name = "toy_recency"

    def __init__(self, budget=0.2, heavy=None, recent=None, heavy_share=0.5, score="sum", decay=0.99, bonus=0.05):
        super().__init__(budget, heavy, recent, heavy_share)
        self.set_score(score, decay)
        self.bonus = bonus

    def priority(self, pos, acc, now, counts):
        return self.score(pos, acc, now) + self.bonus * pos.to(acc.dtype)  # (B, H, S) fp32
'''


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """The policy built from its own module and config, as a run would (``_target_``); unregistered after."""
    (tmp_path / "toy_policy.py").write_text(TOY)
    (tmp_path / "toy.yaml").write_text("_target_: toy_policy.Toy\nbudget: 0.3\nscore: sum\nbonus: 0.05\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    policy = build("policy", OmegaConf.load(tmp_path / "toy.yaml"))
    yield policy
    Policy.registry.pop("toy_recency", None)
    row_kernel.NOTICED.discard("toy_recency")
    sys.modules.pop("toy_policy", None)


def naive_rows(policy, logits):
    """The definition, one row at a time for one sequence: logits (H, G, T, T) -> (H, T, T) bool rows seen. When
    the cache holds the budget, the held token of lowest priority goes (the oldest on ties), then the row's token
    comes in; its softmax over what it sees (summed over the group) is added to the scores."""
    H, G, T, _ = logits.shape
    counts = policy.counts(torch.tensor([T]))
    total = int(counts.total)
    rows = torch.zeros(H, T, T, dtype=torch.bool)
    for h in range(H):
        held, acc = [], torch.zeros(1, 1, T)
        for i in range(T):
            if len(held) >= total:
                pos = torch.full((1, 1, T), -1)
                pos[0, 0, held] = torch.tensor(held)
                prio = policy.priority(pos, acc, torch.tensor([i]), counts)[0, 0]
                low = min(float(prio[j]) for j in held)
                held.remove(min(j for j in held if float(prio[j]) == low))
            held.append(i)
            rows[h, i, held] = True
            for g in range(G):
                p = torch.softmax(logits[h, g, i].masked_fill(~rows[h, i], float("-inf")), -1)
                policy.accumulate(acc, p.view(1, 1, 1, 1, T))
    return rows


@pytest.mark.parametrize("arch", ["llama_gqa", "gpt_neox"])
def test_a_new_policy_module_gets_both_paths_and_the_decoder(toy, arch):
    assert make_policy("toy_recency", budget=0.3).bonus == 0.05  # registered by name, options through config
    model = tiny_model(arch)
    ids = torch.randint(0, 128, (1, 30), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        with attach(model, toy, prompt_len=12):
            sim = model(ids).logits
        with attach(model, toy, mode="real") as h:
            cache = h.new_cache()
            real = [model(ids[:, :12], cache=cache).logits]
            real += [model(ids[:, t:t + 1], cache=cache).logits for t in range(12, 30)]
    torch.testing.assert_close(torch.cat(real, 1), sim, rtol=0, atol=1e-4)
    layer = cache.layers[0]
    assert type(layer.decoder) is Decoder  # no faster form declared: the definition at every step
    assert int((layer.pos >= 0).sum(-1).max()) == int(toy.counts(torch.tensor([12])).total)


def test_a_new_policys_rows_are_its_definition(toy):
    """The independent oracle: the simulated path's mask against the rule applied row by row."""
    logits = torch.randn(1, 2, 2, 24, 24, generator=torch.Generator().manual_seed(6))
    valid = torch.ones(1, 24, dtype=torch.bool)
    mask = policy_allowed(toy, logits, causal_valid(valid), valid, 0)  # (1, H, 1, T, T)
    assert torch.equal(mask[0, :, 0], naive_rows(toy, logits[0]))


def test_no_kernel_form_is_noticed_once_on_cuda(toy, monkeypatch):
    monkeypatch.setenv("H2O_ROW_KERNEL", "auto")
    assert not row_kernel.supports(toy)
    with pytest.warns(RuntimeWarning, match="policy=toy_recency: no Triton row kernel form"):
        assert not row_kernel.use_kernel(toy, torch.device("cuda"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not row_kernel.use_kernel(toy, torch.device("cuda"))  # once per process
        assert not row_kernel.use_kernel(make_policy("h2o"), torch.device("cpu"))  # the CPU: no notice
    assert "toy_recency: no kernel form declared, the torch row loop serves it on CUDA" in row_kernel.coverage()
    assert "h2o: Triton row kernel (evict)" in row_kernel.coverage()


def test_a_subclass_that_changes_the_rule_loses_its_parents_faster_forms():
    class Newest(H2O):  # not registered: it inherits its parent's name, it does not replace it
        def priority(self, pos, acc, now, counts):
            return pos.double()

    policy = Newest(budget=0.3)
    assert declared(policy, "kernel_form") is None and not row_kernel.supports(policy)
    assert Policy.registry["h2o"] is H2O
    assert row_kernel.supports(make_policy("h2_only"))  # the same rule as h2o's: its kernel form holds
    assert declared(make_policy("topk_h2"), "decoder") is not None  # re-declared: select carries the rule
