"""Streaming perplexity over one long text through the evicting cache (the paper's long-context figure).

The text is fed in chunks of ``chunk`` tokens. Each chunk is a prefill chunk of the real path: it attends to the
cache and to itself causally, then the cache is cut back to its budget (absolute token budgets: ``budget=128``
keeps 128 tokens per KV head). Every token of the text but the first is predicted once; a chunk's tokens see
between ``budget`` and ``budget + chunk - 1`` tokens (the cache plus the chunk's own prefix), so a smaller chunk is
closer to token-by-token streaming and slower.

Positions (``positions=``), once the text passes the model's context (8192 tokens for SmolLM2):

* ``"cache"`` (default, StreamingLLM's choice, for every policy): positions *inside the cache*. The kept tokens of
  each KV head are numbered 0..n-1 in text order, the chunk's tokens n..n+chunk-1, so no position ever exceeds
  ``budget + chunk - 1``. Keys are cached after the rotary embedding, so StreamingLLM re-assigns positions from
  keys stored before it; here the cached keys are moved instead: rotary embeddings are rotations, R(p + d) k =
  R(d) R(p) k, so after each chunk every kept key whose number changed (a token before it was evicted) is
  rotated by the change d (negative) with the model's own inverse frequencies. For ``local`` this gives exactly
  the true relative distances (the window is contiguous), so it equals ``"true"`` while that stays in range.
  For sinks and heavy hitters the distances are compressed to ranks, as in StreamingLLM.
* ``"true"``: the true position of each token in the text (the model's default, ``seen + arange``). RoPE is
  relative, so scores depend only on the distances between kept tokens; those stay below ``budget + chunk`` for
  ``local``, but for sinks and heavy hitters kept from far back they grow without bound and pass the trained
  range (8192) after 8192 tokens, and fp32 rotary angles lose precision at large absolute positions.

Rejected: "shift the new token to position budget-1 and leave the cached keys as they are". A cached key keeps the
rotation of the position it was given, so a query placed at a fixed position sees every later distance to that
key shrink by the tokens streamed since: relative distances are *not* preserved; they are only if the old keys
are moved as well, which is ``"cache"``.

Rotary models only for ``"cache"`` (Llama, Mistral, GPT-NeoX's partial rotary; not OPT's learned positions,
nor rope types whose frequencies change with length).

Samples, one per chunk (or per ``log_every`` tokens): ``tokens`` (tokens predicted so far), ``nll`` (mean over the
chunk), ``chunk_ppl``, ``ppl`` (perplexity of everything so far), ``time_s`` (the chunk's seconds),
``time_per_token_s``, ``cpu_per_token_s`` (this process's CPU seconds: not inflated by other processes),
``rss_bytes`` (process resident memory), ``cache_tokens`` (tokens held per KV head).
Summary metrics: ``ppl``, ``nll``, ``ppl_past_context`` (tokens past the model's context), ``tok_s``,
``rss_growth``, ``time_per_token_growth`` and ``cpu_per_token_growth`` (end vs after the warm-up, see
:func:`flatness`).

CLI: ``python -m h2o.bench.streaming --text austen --tokens 20000 --policies h2o,streaming_llm,local
--budgets 64,128,256 --chunk 32``; ``--tokens 1000000`` streams a million tokens (the text repeats if shorter).
"""
from __future__ import annotations

import json
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from h2o.core.attach import attach
from h2o.bench.measure import rss_bytes
from h2o.core.policies import Policy, make_policy
from h2o.assets.model_spec import check_pretrained
from h2o.core.policies import POLICIES
from h2o.core.validate import ArgParser, check_name, choice, guard, output_dir, output_file, positive_int, split_list
from h2o.tasks.base import Result, TaskSpec, check, positive_or_none

POSITIONS = ("cache", "true")
STATIC_ROPE = ("default", "linear", "llama3", "yarn", "longrope")


# ---------------------------------------------------------------------------------------- rotary
def rotary_module(model):
    """The model's rotary embedding module (it holds ``inv_freq``)."""
    for m in model.modules():
        if type(m).__name__.endswith("RotaryEmbedding") and hasattr(m, "inv_freq"):
            return m
    raise ValueError(f"positions='cache' needs a rotary model; {type(model).__name__} has no rotary embedding "
                     f"(use positions='true')")


class KeyShifter:
    """Moves cached (already rotated) keys by ``delta`` positions: R(p + d) k = R(d) R(p) k."""

    def __init__(self, model):
        rot = rotary_module(model)
        rope_type = getattr(rot, "rope_type", "default")
        if rope_type not in STATIC_ROPE:
            raise ValueError(f"positions='cache': rope type {rope_type!r} changes its frequencies with the length; "
                             f"allowed: {', '.join(STATIC_ROPE)} (or positions='true')")
        self.inv_freq = rot.inv_freq.detach().float()  # (R/2,): the first R dims of a head are rotated

    def rotate(self, keys: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """keys (B, H, S, D), delta (B, H, S) int -> keys moved by delta positions (a new tensor)."""
        half = self.inv_freq.numel()
        ang = delta[..., None].float() * self.inv_freq.to(keys.device)  # (B, H, S, R/2)
        cos, sin = ang.cos().to(keys.dtype), ang.sin().to(keys.dtype)
        x1, x2, rest = keys[..., :half], keys[..., half:2 * half], keys[..., 2 * half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


class CachePositions:
    """Per-layer bookkeeping of ``positions="cache"``: after each chunk, renumber the kept keys 0..n-1."""

    def __init__(self, model, n_layers: int):
        self.shifter = KeyShifter(model)
        self.prev: list[torch.Tensor | None] = [None] * n_layers  # (B, H, n) sorted true positions held
        self.n = 0  # tokens held per KV head (equal across heads); the next chunk starts at position n

    def after_chunk(self, cache, first_new: int) -> int:
        """Renumber after a chunk whose first token had true position ``first_new``. Returns tokens held."""
        held = None
        for i, layer in enumerate(cache.layers):
            pos = layer.pos  # (B, H, S) true positions, -1 empty
            valid = pos >= 0
            counts = valid.sum(-1)
            n = int(counts.max())
            if int(counts.min()) != n:
                raise RuntimeError(f"layer {i}: heads hold different numbers of tokens ({counts.tolist()})")
            new = pos >= first_new
            if self.prev[i] is None:
                old = torch.zeros_like(pos)
            else:  # a kept old token's current number is its rank in the previously held set
                old = torch.searchsorted(self.prev[i], pos.clamp(min=0).contiguous())
            current = torch.where(new, self.n + pos - first_new, old)
            key = torch.where(valid, pos, torch.iinfo(torch.int64).max)
            sorted_pos, order = key.sort(-1)
            rank = torch.empty_like(order)
            rank.scatter_(-1, order, torch.arange(pos.shape[-1], device=pos.device).expand_as(order))
            delta = torch.where(valid, rank - current, 0)
            if bool((delta != 0).any()):
                layer.keys.copy_(self.shifter.rotate(layer.keys, delta))
            self.prev[i] = sorted_pos[..., :n].contiguous()
            held = n if held is None else held
            if n != held:
                raise RuntimeError(f"layer {i} holds {n} tokens, layer 0 {held}")
        self.n = held
        return held


# ------------------------------------------------------------------------------------------ text
def load_text(name: str) -> str:
    """``austen`` (six novels), ``moby`` (Moby-Dick), ``pg19`` (PG-19's first test book, needs the hub), or a
    path to a text file."""
    from h2o.assets import fetch
    if name == "austen":
        return fetch.austen_text()
    if name in ("moby", "moby_dick"):
        return fetch.moby_dick()
    if name == "pg19":
        try:
            from datasets import load_dataset
            ds = load_dataset("deepmind/pg19", split="test", streaming=True)
            return next(iter(ds))["text"]
        except Exception as err:  # offline, or the hub refuses
            raise RuntimeError(f"text=pg19: cannot load PG-19 ({str(err).splitlines()[0]}); offline use "
                               f"text=austen or text=moby") from None
    path = Path(name)
    if not path.exists():
        raise FileNotFoundError(f"text={name!r}: not austen, moby, pg19 or an existing file")
    return path.read_text(encoding="utf-8")


def text_ids(tokenizer, text: str, n_tokens: int) -> torch.Tensor:
    """(1, n_tokens + 1) token ids of the text's beginning; the text is repeated if it is too short."""
    need = n_tokens + 1
    ids: list[int] = []
    chars = max(need * 6, 4096)
    while len(ids) < need:
        piece = text[:chars]
        ids = tokenizer(piece, add_special_tokens=not ids).input_ids
        if len(ids) >= need or chars >= len(text):
            break
        chars *= 2
    if len(ids) < need:  # shorter than asked: stream the text again (documented in the record)
        print(f"[stream] the text has {len(ids)} tokens; it is repeated to reach {need}", file=sys.stderr)
        base = ids
        while len(ids) < need:
            ids = ids + base
    return torch.tensor(ids[:need])[None]


# --------------------------------------------------------------------------------------- stream
def flatness(samples: list[dict], warmup: float = 0.1) -> dict:
    """Growth after the warm-up (the first ``warmup`` fraction of samples, at least two): resident memory at the
    end over memory right after the warm-up, minus 1; median time (and CPU time) per token of the last quarter
    of the samples over the first quarter after the warm-up, minus 1 (medians of quarters: robust to load spikes
    from other processes)."""
    n = len(samples)
    w = min(max(2, int(n * warmup)), n - 1)
    after = samples[w:]
    if len(after) < 2:
        return {"rss_growth": None, "rss_growth_max": None, "time_per_token_growth": None,
                "time_per_token_s_start": None, "time_per_token_s_end": None, "warmup_tokens": None,
                "cpu_per_token_growth": None}
    k = max(1, len(after) // 4)
    t0 = statistics.median(s["time_per_token_s"] for s in after[:k])
    t1 = statistics.median(s["time_per_token_s"] for s in after[-k:])
    out = {"rss_growth": after[-1]["rss_bytes"] / after[0]["rss_bytes"] - 1,
           "rss_growth_max": max(s["rss_bytes"] for s in after) / after[0]["rss_bytes"] - 1,
           "time_per_token_growth": t1 / t0 - 1, "time_per_token_s_start": t0, "time_per_token_s_end": t1,
           "warmup_tokens": samples[w - 1]["tokens"]}
    if all("cpu_per_token_s" in s for s in after):  # CPU seconds: not inflated by other processes' load
        c0 = statistics.median(s["cpu_per_token_s"] for s in after[:k])
        c1 = statistics.median(s["cpu_per_token_s"] for s in after[-k:])
        out.update(cpu_per_token_growth=c1 / c0 - 1, cpu_per_token_s_start=c0, cpu_per_token_s_end=c1)
    return out


@torch.inference_mode()
def stream(model, ids: torch.Tensor, policy: str | Policy, budget: int | None = None, chunk: int = 32,
           positions: str = "cache", log_every: int = 0, progress: int = 0) -> tuple[dict, list[dict]]:
    """Stream ``ids`` (1, N + 1) through an evicting cache of ``budget`` tokens (or a built policy with a token
    budget). Returns (metrics, samples)."""
    if positions not in POSITIONS:
        raise ValueError(f"positions={positions!r}: allowed: {', '.join(POSITIONS)}")
    device = next(model.parameters()).device
    ids = ids.to(device)
    if isinstance(policy, Policy):
        pol, budget = policy, policy.budget
    else:
        pol = make_policy(policy) if policy == "full" else make_policy(policy, budget=budget)
    if not pol.is_full and not isinstance(pol.budget, int):
        raise ValueError(f"streaming: budget={pol.budget!r}: give a cache size in tokens (an int), not a ratio")
    policy = pol.name
    ctx = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    samples: list[dict] = []
    total_nll, total_n, past_nll, past_n = 0.0, 0, 0.0, 0
    acc = {"nll": 0.0, "n": 0, "t": 0.0, "c": 0.0}
    max_pos = max_held = 0
    n_pred = ids.shape[1] - 1
    t_start = time.perf_counter()
    with attach(model, pol, mode="real") as h:
        cache = h.new_cache(ref_len=budget if isinstance(budget, int) else None)
        renum = CachePositions(model, len(cache.layers)) if positions == "cache" else None
        for s in range(0, n_pred, chunk):
            x, y = ids[:, s:s + chunk], ids[:, s + 1:s + chunk + 1]
            x = x[:, :y.shape[1]]
            q = x.shape[1]
            t0, c0 = time.perf_counter(), time.process_time()
            pos_ids = None
            if renum is not None:
                pos_ids = torch.arange(renum.n, renum.n + q, device=device)[None]
                max_pos = max(max_pos, renum.n + q - 1)
            out = model(input_ids=x, cache=cache, position_ids=pos_ids, use_cache=True)
            nll = F.cross_entropy(out.logits[0].float(), y[0], reduction="none")
            held = renum.after_chunk(cache, s) if renum is not None else int((cache.layers[0].pos[0, 0] >= 0).sum())
            nll_sum = float(nll.sum())
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            if renum is None:
                max_pos = s + q - 1
            max_held = max(max_held, held)
            total_nll, total_n = total_nll + nll_sum, total_n + q
            if ctx:
                past = nll[max(0, ctx - s - 1):]  # predicted tokens whose position is >= ctx
                past_nll, past_n = past_nll + float(past.sum()), past_n + past.numel()
            acc = {"nll": acc["nll"] + nll_sum, "n": acc["n"] + q, "t": acc["t"] + dt, "c": acc["c"] + dc}
            if acc["n"] >= max(log_every, 1) or s + chunk >= n_pred:
                m = acc["nll"] / acc["n"]
                samples.append({"tokens": total_n, "nll": m, "chunk_ppl": math.exp(m),
                                "ppl": math.exp(total_nll / total_n), "time_s": acc["t"],
                                "time_per_token_s": acc["t"] / acc["n"], "cpu_per_token_s": acc["c"] / acc["n"],
                                "rss_bytes": rss_bytes(), "cache_tokens": held})
                acc = {"nll": 0.0, "n": 0, "t": 0.0, "c": 0.0}
            if progress and (s // chunk) % progress == 0:
                print(f"[stream] {policy} {budget}: {total_n} tokens, ppl {math.exp(total_nll / total_n):.2f}, "
                      f"held {held}, {total_n / (time.perf_counter() - t_start):.0f} tok/s, "
                      f"rss {rss_bytes() / 2**20:.0f} MiB", file=sys.stderr, flush=True)
        kv = cache.nbytes()
    wall = time.perf_counter() - t_start
    metrics = {"ppl": math.exp(total_nll / total_n), "nll": total_nll / total_n, "tokens": total_n,
               "ppl_past_context": math.exp(past_nll / past_n) if past_n else None, "tokens_past_context": past_n,
               "tok_s": total_n / wall, "wall_s": wall, "cache_tokens_max": max_held, "kv_bytes": kv,
               "max_position_id": max_pos, **flatness(samples)}
    return metrics, samples


# ------------------------------------------------------------------------------------ runner task
@dataclass
class StreamingTask(TaskSpec):
    """``conf/task/bench_streaming.yaml``: one run = the configured policy (a budget in tokens, e.g.
    ``policy.budget=128``) streaming ``tokens`` tokens of the text. Samples: one per chunk (module doc)."""

    name: str
    text: str = "austen"
    tokens: int = 20000
    chunk: int = 32
    positions: str = "cache"
    log_every: int = 0
    shots: int = 0

    kind = "streaming"
    semantics = ("real",)

    def __post_init__(self):
        for key in ("tokens", "chunk"):
            positive_or_none(f"task.{key}", getattr(self, key))
        check(self.positions in POSITIONS, f"task.positions={self.positions!r}: allowed: {', '.join(POSITIONS)}")
        check(self.shots == 0, f"task.shots={self.shots}: streaming takes no in-context examples (0)")

    def run(self, model, tokenizer, policy, semantics: str, seed: int) -> Result:
        check(policy.is_full or isinstance(policy.budget, int),
              f"policy.budget={policy.budget!r}: streaming needs a cache size in tokens (an int, e.g. 128)")
        ids = text_ids(tokenizer, load_text(self.text), self.tokens)
        metrics, samples = stream(model, ids, policy, chunk=self.chunk, positions=self.positions,
                                  log_every=self.log_every)
        return Result(metrics, samples, {"chunk": self.chunk, "positions": self.positions, "text": self.text})


def run(model, tokenizer, text: str = "austen", tokens: int = 20000, policies=("h2o", "streaming_llm", "local"),
        budgets=(64, 128, 256), chunk: int = 32, positions: str = "cache", log_every: int = 0, progress: int = 0,
        model_name: str = "", out=None) -> list[tuple[dict, list[dict]]]:
    """Stream the text for each policy x budget; returns [(record, samples)] in the run-record format."""
    ids = text_ids(tokenizer, load_text(text), tokens)
    results = []
    for budget in budgets:
        for policy in policies:
            metrics, samples = stream(model, ids, policy, budget, chunk, positions, log_every, progress)
            rec = {"task_kind": "streaming", "task": text, "semantics": "real", "policy": policy,
                   "budget": budget, "chunk": chunk, "positions": positions, "model": model_name,
                   "n_samples": metrics["tokens"], "wall_s": metrics["wall_s"], "threads": torch.get_num_threads(),
                   "metrics": metrics}
            results.append((rec, samples))
            print_row(rec, out)
    return results


def print_row(rec: dict, out=None) -> None:
    m = rec["metrics"]

    def g(x, f, scale=1.0):
        return "-" if x is None else format(x * scale, f)

    print(f"{rec['policy']:>14} budget {rec['budget']:>5} chunk {rec['chunk']:>3} positions {rec['positions']:>5}: "
          f"ppl {m['ppl']:8.3f}  past-context ppl {g(m['ppl_past_context'], '8.3f')}  tokens {m['tokens']}  "
          f"held <= {m['cache_tokens_max']}  max pos {m['max_position_id']}  {m['tok_s']:.0f} tok/s  "
          f"time/token {g(m['time_per_token_s_start'], '.2f', 1e3)} -> {g(m['time_per_token_s_end'], '.2f', 1e3)} "
          f"ms ({g(m['time_per_token_growth'], '+.1f', 100)}%), CPU/token "
          f"{g(m.get('cpu_per_token_growth'), '+.1f', 100)}%  RSS growth after warm-up "
          f"{g(m['rss_growth'], '+.2f', 100)}% (max {g(m.get('rss_growth_max'), '+.2f', 100)}%)",
          file=out or sys.stdout, flush=True)


TEXTS = ("austen", "moby", "moby_dick", "pg19")


def validate(args) -> list[int]:
    """Every value checked before the model or the text loads (h2o.core.validate); returns the budgets."""
    check_pretrained(args.model, "--model")
    check(args.text in TEXTS or Path(args.text).is_file(), f"--text={args.text!r}: allowed: "
                                                           f"{', '.join(TEXTS)} or an existing text file")
    policies = choice("--policies", split_list("--policies", args.policies, str, "a policy name"), POLICIES)
    budgets = split_list("--budgets", args.budgets, positive_int, "a cache size in tokens (an int >= 1)")
    for name in policies:
        for b in budgets:
            make_policy(name, budget=b)  # e.g. streaming_llm: a budget below its sinks + 1
    for flag, low in (("tokens", 1), ("chunk", 1), ("log_every", 0), ("progress", 0), ("threads", 0)):
        check(getattr(args, flag) >= low, f"--{flag.replace('_', '-')}={getattr(args, flag)}: must be >= {low}")
    if args.json:
        output_file("--json", args.json)
    if args.runs:
        output_dir("--runs", args.runs)
        check_name("--experiment", args.experiment)
    return budgets


@guard
def main(argv: list[str] | None = None) -> int:
    p = ArgParser(prog="python -m h2o.bench.streaming", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--text", default="austen", help="austen, moby, pg19 or a text file")
    p.add_argument("--tokens", type=int, default=20000, help="tokens to stream (up to 1M and more)")
    p.add_argument("--policies", default="h2o,streaming_llm,local")
    p.add_argument("--budgets", default="64,128,256", help="cache sizes in tokens, comma-separated")
    p.add_argument("--chunk", type=int, default=32, help="tokens per forward")
    p.add_argument("--positions", choices=POSITIONS, default="cache")
    p.add_argument("--log-every", type=int, default=0, help="one sample per this many tokens (0: per chunk)")
    p.add_argument("--progress", type=int, default=0, help="print progress every this many chunks")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--json", default=None, help="write records (with their samples) here, JSON lines")
    p.add_argument("--runs", default=None, help="also write run folders (metrics.json + samples.jsonl)")
    p.add_argument("--experiment", default="streaming")
    args = p.parse_args(argv)
    budgets = validate(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    from h2o.assets.models import load_model
    model, tok = load_model(args.model)
    results = run(model, tok, args.text, args.tokens, args.policies.split(","), budgets, args.chunk,
                  args.positions, args.log_every, args.progress, model_name=args.model)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)  # checked creatable before the work (validate)
        with open(args.json, "w") as f:
            for rec, samples in results:
                f.write(json.dumps({"experiment": args.experiment, **rec, "samples": samples}) + "\n")
    if args.runs:
        for rec, samples in results:
            d = Path(args.runs) / args.experiment / args.model / args.text / \
                f"{rec['policy']}_{rec['budget']}_c{rec['chunk']}_{rec['positions']}"
            d.mkdir(parents=True, exist_ok=True)
            (d / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
            (d / "metrics.json").write_text(json.dumps({"experiment": args.experiment, **rec}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
