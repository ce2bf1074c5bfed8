"""What a GPU pays, counted on any device with torch.profiler: aten ops (one launch each, at most) and host syncs.

* ``simulated_ops``: aten ops of one simulated forward against the eager forward of the same model and input.
* ``decode_counts``: per decoding step, aten ops and host syncs of the real path (the evicting cache) against
  transformers' sdpa attention with a ``DynamicCache``.

A host sync is counted as ``aten::_local_scalar_dense`` (what ``.item()``, ``int()``, ``bool()`` of a tensor call);
``aten::item`` and ``aten::is_nonzero`` wrap it and are not counted twice.

    python -m h2o.bench.launches            # prints the counts on the tiny LLaMA (256 tokens, budget 20%)
"""
from __future__ import annotations

import json
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile

SYNC = "aten::_local_scalar_dense"


def aten_ops(fn) -> Counter:
    """Run ``fn()`` under the profiler; Counter of aten op name -> calls (nested ops included)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return Counter(e.name for e in prof.events() if e.name.startswith("aten::"))


def simulated_ops(model, policy, ids: torch.Tensor) -> dict:
    """aten ops of one simulated forward of ``ids`` (B, T) under ``policy`` vs the model's eager forward."""
    from h2o.core.attach import attach

    with torch.no_grad():
        model(ids)  # warm-up: lazy initialisation is not counted
        eager = aten_ops(lambda: model(ids))
        with attach(model, policy):
            model(ids)
            ours = aten_ops(lambda: model(ids))
    n_eager, n_ours = sum(eager.values()), sum(ours.values())
    return {"policy": policy.name, "tokens": ids.shape[1], "eager_ops": n_eager, "ops": n_ours,
            "ratio": round(n_ours / n_eager, 3), "syncs": ours[SYNC]}


def decode_counts(model, policy, ids: torch.Tensor, steps: int = 4) -> dict:
    """Per decoding step after a prefill of ``ids`` (B, P): ops and syncs of the evicting cache vs sdpa+Dynamic."""
    from transformers import DynamicCache

    from h2o.core.attach import attach

    def per_step(new_cache) -> tuple[float, float]:
        cache = new_cache()
        model(ids, cache=cache)
        nxt = ids[:, -1:]
        model(nxt, cache=cache)  # warm-up step
        counts = aten_ops(lambda: [model(nxt, cache=cache) for _ in range(steps)])
        return sum(counts.values()) / steps, counts[SYNC] / steps

    with torch.no_grad():
        previous = model.config._attn_implementation
        model.set_attn_implementation("sdpa")
        try:
            base_ops, base_syncs = per_step(lambda: DynamicCache(config=model.config))
        finally:
            model.set_attn_implementation(previous)
        with attach(model, policy, mode="real") as h:
            ops, syncs = per_step(h.new_cache)
    # syncs are per step, not per layer: the one sync is the non-finite guard's flag, read once per forward
    # (tests/test_launches.py checks it stays 1 at 2 and 4 layers)
    return {"policy": policy.name, "layers": model.config.num_hidden_layers, "sdpa_ops_per_step": base_ops,
            "sdpa_syncs_per_step": base_syncs, "ops_per_step": ops, "ratio": round(ops / base_ops, 3),
            "syncs_per_step": syncs}


# every policy's real decode, h2o's score variants too (full: budget 1.0 whatever it is given)
DECODED = [(name, {}) for name in ("full", "local", "streaming_llm", "strided", "fixed", "h2o", "h2_only",
                                   "strided_h2", "fixed_h2", "topk", "topk_h2")] + [("h2o", {"score": "mean"}),
                                                                                    ("h2o", {"score": "decay"})]


def main() -> None:
    from h2o.assets.models import tiny_model
    from h2o.core.policies import make_policy

    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 256), generator=torch.Generator().manual_seed(0))
    for name in ("local", "streaming_llm", "strided", "fixed", "h2o"):
        print(json.dumps(simulated_ops(model, make_policy(name, budget=0.2), ids)))
    for name, options in DECODED:
        print(json.dumps({**decode_counts(model, make_policy(name, budget=0.2, **options), ids[:, :64]), **options}))


if __name__ == "__main__":
    main()
