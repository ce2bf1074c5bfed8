"""Each side of ``make parity`` measured: the NLL of a continuation through the harness's compressed cache, and
kvpress run in its own virtualenv (tools/parity/kvpress_side.py). Shared by the driver (:mod:`h2o.parity.driver`)
and CI's golden numbers (:mod:`h2o.parity.golden`)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

from h2o.parity.pairs import RATIO_BUDGET, kept

ROOT = Path(__file__).resolve().parents[2]


def nll_sum(logits, targets) -> tuple[float, bool]:
    """logits (n, V), targets (n,) -> (summed NLL, every token the argmax)."""
    import torch

    logp = torch.log_softmax(logits.float(), -1)
    return -logp.gather(-1, targets[:, None]).sum().item(), bool((logp.argmax(-1) == targets).all())


def forwards(model, policy, context, parts, ref_len: int, stepwise: bool = False):
    """The evicting cache fed ``context`` (1, L), then each of ``parts`` (1, m) as one forward (or one token at
    a time with ``stepwise``). Returns (last context logits (1, V), logits of the parts (m_total, V), held per
    layer after the context)."""
    import torch

    from h2o.core.attach import attach

    with attach(model, policy, mode="real") as h, torch.no_grad():
        cache = h.new_cache(ref_len=ref_len)
        first = model(context, cache=cache, use_cache=True).logits[0, -1:]
        held = cache.held_tokens()[:, 0, 0].tolist()  # (L,) sequence 0, KV head 0
        rest = []
        for part in parts:
            chunks = part.split(1, dim=1) if stepwise else [part]
            rest += [model(c, cache=cache, use_cache=True).logits[0] for c in chunks]
    return first, torch.cat(rest), held


def continuation_nll(model, policy, context, continuation, stepwise: bool = False) -> tuple[float, list[int]]:
    """context (1, L), continuation (1, m) -> (summed NLL of the m tokens, tokens held per layer after the context):
    the first predicted by the context's last logits, the others teacher-forced through the cache (one forward, or
    one token at a time with ``stepwise``)."""
    import torch

    first, rest, held = forwards(model, policy, context, [continuation[:, :-1]], context.shape[1], stepwise)
    return nll_sum(torch.cat([first, rest]), continuation[0])[0], held


def parity_policy(name: str, options: dict, context_len: int, ratio: float, timing: str):
    """Our policy ``name`` (with ``options``) for kvpress's ``compression_ratio`` ``ratio`` on a context of
    ``context_len`` tokens, in ``timing``: the token count kvpress keeps, or the share kept for a method whose
    budget kvpress computes unrounded (:data:`RATIO_BUDGET`)."""
    from h2o.core.policies import make_policy

    if name == "full":
        return make_policy(name, **options)
    share = 1 - ratio if name in RATIO_BUDGET else kept(context_len, ratio)  # kvpress's arithmetic
    return make_policy(name, budget=share, compress=timing, **options)  # interval: its N among the options


def run_kvpress(venv: Path, prompts: Path, model_path: Path, out: Path, methods: list[str], ratios: list[float],
                decode: bool, threads: int, variants: Path | None = None, interval: int = 0) -> None:
    """tools/parity/kvpress_side.py in the parity virtualenv: the prefill timing, with ``decode`` the decoding one,
    with ``interval`` N the interval one (DecodingPress every N steps)."""
    cmd = [str(venv / "bin" / "python"), str(ROOT / "tools" / "parity" / "kvpress_side.py"), "--prompts",
           str(prompts), "--model", str(model_path), "--out", str(out), "--methods", ",".join(methods),
           "--ratios", ",".join(map(str, ratios)), "--threads", str(threads)] + (["--decode"] if decode else [])
    cmd += ["--interval", str(interval)] if interval else []
    cmd += ["--variants", str(variants)] if variants is not None else []
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the kvpress side never sees h2o
    subprocess.run(cmd, check=True, env={**env, "OMP_NUM_THREADS": str(threads)})
