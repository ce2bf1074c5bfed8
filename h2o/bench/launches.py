"""What a GPU pays, counted on any device with torch.profiler: aten ops (one launch each, at most) and host syncs.

* ``simulated_ops``: aten ops of one simulated forward against the eager forward of the same model and input.
* ``decode_counts``: per decoding step, aten ops and host syncs of the real path (the evicting cache) against
  transformers' sdpa attention with a ``DynamicCache``.
* ``layer_syncs``: host reads per layer per decoding step of a policy (every schedule it runs), the step's
  reads a GPU would wait on, beyond the forward's one (the non-finite guard's flag): the count of
  :func:`host_reads` on the tiny LLaMA at 2 and 4 layers, differenced. ``make bench`` prints it for every rule.

A host sync is counted as ``aten::_local_scalar_dense`` (what ``.item()``, ``int()``, ``bool()`` of a tensor call);
``aten::item`` and ``aten::is_nonzero`` wrap it and are not counted twice. :func:`host_reads` adds what the CPU
profiler does not show as one: ``aten::nonzero`` (a boolean index, ``nonzero``: its output's size is read) and
``Tensor.tolist`` / ``numpy`` (a copy to the host on a GPU, no aten op on the CPU).

    python -m h2o.bench.launches            # prints the counts on the tiny LLaMA (256 tokens, budget 20%)
"""
from __future__ import annotations

import functools
import json
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode
from torch.profiler import ProfilerActivity, profile

from h2o.core.schedule import Schedule

SYNC = "aten::_local_scalar_dense"
HIDDEN = (torch.Tensor.tolist, torch.Tensor.numpy)  # reads the CPU profiler shows as no aten op


class ListReads(TorchFunctionMode):
    """Counts :data:`HIDDEN` calls (``n``) while active, but of the tensors at the addresses ``host`` (what lives
    on the host on every device: the evicting cache's host counts)."""

    def __init__(self, host: frozenset[int] = frozenset()):
        super().__init__()
        self.n, self.host = 0, host

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.n += func in HIDDEN and args[0].data_ptr() not in self.host
        return func(*args, **(kwargs or {}))


def host_side(cache) -> frozenset[int]:
    """The addresses of the tensors an evicting cache keeps on the host on every device (its host counts,
    :meth:`h2o.core.cache.EvictingCache.host_tensors`)."""
    return frozenset(x.data_ptr() for x in cache.host_tensors())


def host_reads(fn, host: frozenset[int] = frozenset()) -> int:
    """Host reads while ``fn()`` runs: ``aten::_local_scalar_dense`` and ``aten::nonzero`` (profiler), and
    ``tolist`` / ``numpy`` calls (:class:`ListReads`) but of the tensors at ``host`` (:func:`host_side`)."""
    lists = ListReads(host)
    with lists:
        counts = aten_ops(fn)
    return counts[SYNC] + counts["aten::nonzero"] + lists.n


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


def step_reads(model, policy, ids: torch.Tensor, steps: int = 2) -> float:
    """Host reads (:func:`host_reads`) per decoding step of the evicting cache after a prefill of ``ids`` (B, P)
    and two warm-up steps (``steps``: a multiple of a ``compress=interval`` policy's interval counts its cuts)."""
    from h2o.core.attach import attach

    with torch.no_grad(), attach(model, policy, mode="real") as h:
        cache = h.new_cache()
        model(ids, cache=cache)
        nxt = ids[:, -1:]
        for _ in range(2):
            model(nxt, cache=cache)
        return host_reads(lambda: [model(nxt, cache=cache) for _ in range(steps)], host_side(cache)) / steps


@functools.cache
def llama(layers: int):
    from h2o.assets.models import tiny_model

    return tiny_model("llama", num_hidden_layers=layers)


def layer_syncs(name: str, compress: str, interval: int = 2, budget=0.3, prompt: int = 40) -> float:
    """Host reads per layer per decoding step of policy ``name`` under ``compress`` (``interval``: its option),
    on the tiny LLaMA: :func:`step_reads` at 4 layers less at 2, halved (the forward's own reads cancel)."""
    from h2o.bench.every_policy import with_statistics
    from h2o.core.policies import make_policy

    extra = {"interval": interval} if Schedule.registry[compress].takes_interval else {}
    ids = torch.randint(3, 128, (1, prompt), generator=torch.Generator().manual_seed(0))
    at = [step_reads(llama(n), with_statistics(make_policy(name, budget=budget, compress=compress, **extra),
                                               llama(n)), ids, 2 * interval)  # triattention: the model's statistics
          for n in (2, 4)]
    return (at[1] - at[0]) / 2


def every_layer_syncs(interval: int = 2) -> dict[str, float]:
    """``{"rule/compress": host reads per layer per decoding step}`` for every rule with an evicting cache and
    every schedule it runs (kvzip: replays with a tokenizer, left out)."""
    from h2o.core.policies import REAL_POLICIES, make_policy
    from h2o.core.policies.budget import Unsupported
    from h2o.core.schedule import compress_names

    out = {}
    for name in REAL_POLICIES:
        if name == "kvzip":
            continue
        for compress in compress_names():
            try:
                make_policy(name, budget=0.3, compress=compress, **({"interval": interval} if Schedule.registry[
                    compress].takes_interval else {}))
            except Unsupported:
                continue
            out[f"{name}/{compress}"] = layer_syncs(name, compress, interval)
    return out


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
    print(json.dumps({"host_reads_per_layer_step": every_layer_syncs()}))


if __name__ == "__main__":
    main()
