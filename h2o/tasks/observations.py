"""The paper's Figure 2 observations (``conf/task/observations.yaml``, ``experiment=observations``).

On windows of a long book (Austen offline), with the full cache:

* **sparsity per layer**: the fraction of causal attention probabilities below ``threshold`` x the row's maximum,
  averaged over heads, rows and windows (the paper reports > 95% for OPT on WikiText-103);
* **accumulated attention**: for one layer, each token's attention received from all later queries (column sums),
  pooled over heads and windows: its rank/size plot on log-log axes is close to a line (a power law);
* **heavy hitters masked**: next-token top-1 accuracy with the full cache, with each layer/head's ``mask_ratio``
  top accumulated-attention tokens hidden from every query, and with as many random tokens hidden.

Record: ``metrics.json`` (``acc_full``, ``acc_heavy_masked``, ``acc_random_masked``, ``mean_sparsity``) and
``observations.json`` with the keys ``analysis/figures.py`` reads.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from h2o.tasks.perplexity import PerplexityTask
from h2o.core.policies import Policy
from h2o.tasks.base import Result, check
from h2o.tasks.batching import Sizing, record


class Hide(Policy):
    """Not a cache policy: keeps every token but hides the columns ``hidden`` (B, Hkv, T) from all queries."""

    evicts = False
    is_full = False

    def __init__(self, hidden: torch.Tensor):
        super().__init__(budget=1.0)
        self.hidden = hidden

    def restrict(self, logits, acc, allowed, counts):
        diagonal = torch.eye(logits.shape[-1], dtype=torch.bool, device=logits.device)
        return allowed & (~self.hidden[:, :, None, None, :] | diagonal)  # a query still sees itself


@dataclass
class ObservationsTask(PerplexityTask):
    threshold: float = 0.01  # sparsity: probabilities below threshold x row max
    layer: int = -1  # accumulated attention of this layer (-1: the middle layer)
    mask_ratio: float = 0.05  # heavy hitters hidden per layer and head

    kind = "observations"
    semantics = ("simulated",)
    quantizes = False  # the attention it observes is the full model's

    def __post_init__(self):
        super().__post_init__()
        check(0 < self.threshold < 1, f"task.threshold={self.threshold}: must be in (0, 1)")
        check(0 < self.mask_ratio < 1, f"task.mask_ratio={self.mask_ratio}: must be in (0, 1)")

    def check_model(self, model) -> None:
        super().check_model(model)
        n = model.num_layers()
        check(self.layer >= -1 and (n is None or self.layer < n),
              f"task.layer={self.layer}: model {model.name} has {n} layers; allowed: -1 (the middle one) or "
              f"0-{(n or 1) - 1}")

    def run(self, model, tokenizer, policy, semantics: str, seed: int, quant=None) -> Result:
        from tqdm import tqdm

        from h2o import attach, make_policy

        wins = self.windows(tokenizer).to(model.device)  # (N, W)
        n_layers = model.config.num_hidden_layers
        layer = self.layer if self.layer >= 0 else n_layers // 2
        sparsity, acc_cols = torch.zeros(n_layers, device=wins.device), []
        correct = {"full": 0, "heavy_masked": 0, "random_masked": 0}
        gen = torch.Generator().manual_seed(seed)
        for w in tqdm(range(len(wins)), desc="observations", file=sys.stderr):
            ids = wins[w:w + 1]
            probs = {}
            with torch.no_grad(), attach(model, make_policy("full")) as h:
                h.observer = lambda i, p: probs.__setitem__(i, p[0].float())  # (Hq, T, T)
                logits = model(ids, use_cache=False).logits
            correct["full"] += self.hits(logits, ids)
            for i, p in probs.items():  # a layer's probabilities live on its own device (device_map)
                sparsity[i] += self.layer_sparsity(p).to(sparsity.device) / len(wins)
            acc_cols.append(probs[layer].sum(1).flatten().cpu())  # (Hq * T,) column sums per head
            for name, hidden in self.hidden_sets(model, probs, gen).items():  # hidden in every layer at once
                correct[name] += self.hits_hidden(model, ids, hidden)
        n_pred = len(wins) * (self.window - 1)
        acc = {k: v / n_pred for k, v in correct.items()}
        observations = {"sparsity_per_layer": sparsity.tolist(), "sparsity_threshold": self.threshold,
                        "accumulated_attention": torch.cat(acc_cols).tolist(),
                        "accumulated_attention_source": f"layer {layer}, pooled over heads and windows",
                        "heavy_masked": acc}
        metrics = {f"acc_{k}": v for k, v in acc.items()} | {"mean_sparsity": float(sparsity.mean())}
        one = Sizing(1, "one_at_a_time", "observations score one window at a time")
        return Result(metrics, [], {"files": {"observations.json": observations}, **record(self.batch_size, [one])})

    def layer_sparsity(self, p: torch.Tensor) -> torch.Tensor:
        """p (Hq, T, T) -> 0-dim tensor on p's device: the fraction of causal probabilities below threshold x max."""
        causal = torch.ones_like(p[0], dtype=torch.bool).tril()
        small = (p < self.threshold * p.amax(-1, keepdim=True)) & causal
        return small.sum() / (causal.sum() * p.shape[0])

    @staticmethod
    def hits(logits, ids) -> int:
        return int((logits[0, :-1].argmax(-1) == ids[0, 1:]).sum())

    def hidden_sets(self, model, probs, gen) -> dict[str, dict[int, torch.Tensor]]:
        """Per layer (B=1, Hkv, T) bool: the top accumulated-attention tokens, and as many random ones."""
        heavy, rand = {}, {}
        for i, p in probs.items():
            n_kv = model.config.num_key_value_heads if hasattr(model.config, "num_key_value_heads") else p.shape[0]
            n_kv = n_kv or p.shape[0]
            score = p.sum(1).view(n_kv, -1, p.shape[-1]).sum(1)  # (Hkv, T) summed over the group's heads
            k = max(1, int(self.mask_ratio * p.shape[-1]))
            top = score.topk(k, -1).indices
            heavy[i] = torch.zeros_like(score, dtype=torch.bool).scatter_(-1, top, True)[None]
            pick = torch.rand(score.shape, generator=gen).argsort(-1)[:, :k].to(score.device)  # CPU generator
            rand[i] = torch.zeros_like(score, dtype=torch.bool).scatter_(-1, pick, True)[None]
        return {"heavy_masked": heavy, "random_masked": rand}

    def hits_hidden(self, model, ids, hidden: dict[int, torch.Tensor]) -> int:
        """Top-1 hits with ``hidden[layer]`` hidden in each layer (one Hide policy per layer)."""
        from h2o import attach

        with torch.no_grad(), attach(model, Hide(hidden[0])) as h:
            modules = [m for m in model.modules() if getattr(m, "h2o", None) is h]
            for m in modules:  # each layer hides its own tokens
                m.h2o = type(h)(Hide(hidden[m.layer_idx]), h.mode, prompt_len=h.prompt_len, num_layers=h.num_layers)
            logits = model(ids, use_cache=False).logits
        return self.hits(logits, ids)
