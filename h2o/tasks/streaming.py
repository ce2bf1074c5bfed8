"""Streaming perplexity over one long text through the evicting cache (the paper's long-context figure).

The authors' protocol is the default: one token at a time (``chunk=1``: each step evicts one token, the paper's
setting) and H2O split 1/3 heavy, 2/3 recent (heavy 32 + recent 64 at 96 tokens, scaled with the cache size;
``HEAVY_SHARE``). Budgets are token counts (``budget=96`` keeps 96 tokens per KV head). With ``chunk > 1`` each
chunk is a prefill chunk of the real path: it attends to the cache and to itself causally, then the cache is cut
back to its budget, so a chunk's tokens see between ``budget`` and ``budget + chunk - 1`` tokens: faster (the
weights are read once per chunk), and not the same numbers (measured in the README). Every token of the text but
the first is predicted once.

Positions (``positions=``), once the text passes the model's context (8192 tokens for SmolLM2):

* ``"cache"`` (default, StreamingLLM's choice, for every policy): positions *inside the cache*. The kept tokens of
  each KV head are numbered 0..n-1 in text order, the chunk's tokens n..n+chunk-1, so no position ever exceeds
  ``budget + chunk - 1``. Keys are cached after the rotary embedding, so StreamingLLM re-assigns positions from
  keys stored before it; here the cached keys are moved instead: rotary embeddings are rotations, R(p + d) k =
  R(d) R(p) k, so after each chunk every kept key whose number changed (a token before it was evicted) is
  rotated by the change d (negative) with the model's own inverse frequencies (each evicting layer does it after
  its policy's eviction: ``EvictingCache(..., rerotate=)``, :mod:`h2o.core.rerotate`). For ``local`` this gives exactly
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

Samples, one per ``window`` predicted tokens (1000; exact windows, split across chunks): ``tokens`` (tokens
predicted so far), ``nll`` (mean over the window), ``chunk_ppl`` (the window's perplexity), ``ppl`` (perplexity
of everything so far), ``time_s`` (the window's seconds), ``time_per_token_s``, ``cpu_per_token_s`` (this
process's CPU seconds: not inflated by other processes), ``rss_bytes`` (process resident memory),
``cache_tokens`` (tokens held per KV head). Several policies of one budget can stream as one batch
(:class:`Streamer`, sequence b runs policy b): the same numbers, and a token-by-token step reads the weights once
for all of them; per-stream times are then the batch's divided by the streams.
Summary metrics: ``ppl``, ``nll``, ``ppl_past_context`` (tokens past the model's context), ``tok_s``,
``rss_growth``, ``time_per_token_growth`` and ``cpu_per_token_growth`` (end vs after the warm-up, see
:func:`flatness`).

Run records: ``make stream`` = ``h2o-run -m experiment=streaming`` (:class:`StreamingTask`, one run per policy x
budget x chunk). Exploration, no record (:mod:`h2o.tasks.streaming_cli`): ``python -m h2o.tasks.streaming_cli --text
austen --tokens 20000 --policies h2o,h2o:heavy_share=1/2,streaming_llm,local --budgets 96,192,384 --compare-chunk 32
--batch --progress``; ``--tokens 1000000`` streams a million tokens (the text repeats if shorter).
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from h2o.core.attach import attach, attention_modules
from h2o.core import engine
from h2o.core.cache import EvictingCache
from h2o.core.rerotate import KeyShifter
from h2o.assets.resources import rss_bytes
from h2o.tasks.streaming_parts import HEAVY_SHARE, Windows, build_policy, estimate, flatness
from h2o.core.policies import Policy
from h2o.core.policies.per_sequence import PerSequence
from h2o.tasks.base import Result, TaskSpec, adds_bos, check, positive_or_none
from h2o.tasks.progress import partial_file

POSITIONS = ("cache", "true")
CHUNK = 1  # tokens per forward: one at a time, the authors' protocol
WINDOW = 1000  # predicted tokens per sample


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
class Streamer:
    """Streams of one text through evicting caches of one budget, one per policy spec, batched: sequence b of the
    batch runs ``specs[b]`` (:class:`PerSequence`), so a step reads the weights once for all of them. Advanced a
    few tokens at a time, so that several streamers share one model in turns (``run(interleave=True)``).
    Per-stream times are the batch's time divided by the streams."""

    def __init__(self, model, ids: torch.Tensor, specs: list, budget: int | None = None, chunk: int = CHUNK,
                 positions: str = "cache", window: int = WINDOW, heavy_share: float = HEAVY_SHARE,
                 on_sample=None):
        if positions not in POSITIONS:
            raise ValueError(f"positions={positions!r}: allowed: {', '.join(POSITIONS)}")
        self.model, self.chunk, self.positions = model, chunk, positions
        self.device = next(model.parameters()).device
        self.pols = [build_policy(spec, budget, heavy_share) for spec in specs]
        # a quantizer set on the policy (policy.quant): the key rotation moves stored keys, not packed rows
        if any(p.quant is not None for p in self.pols):
            raise ValueError("streaming: a policy with quant set; the streamed cache is not quantized (allowed: none)")
        self.B = len(self.pols)
        self.ids = ids.to(self.device).expand(self.B, -1)
        self.pol = self.pols[0] if self.B == 1 else PerSequence(self.pols)
        self.budget = self.pol.budget
        if not engine.keeps_all(self.pol) and not isinstance(self.budget, int):
            raise ValueError(f"streaming: budget={self.budget!r}: give a cache size in tokens (an int), not a ratio")
        self.ctx = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
        self.wins = [Windows(window, None if on_sample is None else partial(on_sample, b)) for b in range(self.B)]
        self.past_nll, self.past_n = torch.zeros(self.B, dtype=torch.float64), 0
        self.max_pos = self.max_held = self.held = self.s = 0
        self.n_pred = self.ids.shape[1] - 1
        self.wall = 0.0
        ref_len = self.budget if isinstance(self.budget, int) else None
        rerotate = KeyShifter(model) if positions == "cache" else None  # positions inside the cache
        self.cache = EvictingCache(self.pol, len(attention_modules(model)), ref_len, rerotate=rerotate)

    @property
    def done(self) -> bool:
        return self.s >= self.n_pred

    @torch.inference_mode()
    def advance(self, until: int) -> None:
        """Feed chunks until ``until`` tokens have been predicted (or the text ends)."""
        until = min(until, self.n_pred)
        ids, chunk, inside = self.ids, self.chunk, self.positions == "cache"
        t_in = time.perf_counter()
        with attach(self.model, self.pol, mode="real") as h:
            h.cache = self.cache
            while self.s < until:
                s = self.s
                x, y = ids[:, s:s + chunk], ids[:, s + 1:s + chunk + 1]
                x = x[:, :y.shape[1]]
                q = x.shape[1]
                t0, c0 = time.perf_counter(), time.process_time()
                pos_ids = None
                if inside:
                    n = self.cache.next_position()
                    pos_ids = torch.arange(n, n + q, device=self.device)[None].expand(self.B, -1)
                    self.max_pos = max(self.max_pos, n + q - 1)
                out = self.model(input_ids=x, cache=self.cache, position_ids=pos_ids, use_cache=True)
                nll = F.cross_entropy(out.logits.flatten(0, 1).float(), y.flatten(), reduction="none")
                nll = nll.view(self.B, q).cpu()  # (B, q)
                if inside:
                    held = self.cache.next_position()
                else:
                    held = int(self.cache.held_tokens(0)[0, 0])
                    self.max_pos = s + q - 1
                if self.ctx and s + q > self.ctx:
                    past = nll[:, max(0, self.ctx - s - 1):]  # predicted tokens whose position is >= ctx
                    self.past_nll, self.past_n = self.past_nll + past.double().sum(-1), self.past_n + past.shape[1]
                self.s += q
                dt, dc = (time.perf_counter() - t0) / self.B, (time.process_time() - c0) / self.B
                for b, win in enumerate(self.wins):
                    win.add(nll[b], dt, dc, held, last=self.done)
                self.held, self.max_held = held, max(self.max_held, held)
        self.wall += time.perf_counter() - t_in

    def metrics(self, b: int = 0) -> dict:
        """Stream ``b``'s summary metrics."""
        win = self.wins[b]
        total_nll, total_n = win.total_nll, win.total_n
        wall = self.wall / self.B
        return {"ppl": math.exp(total_nll / total_n), "nll": total_nll / total_n, "tokens": total_n,
                "ppl_past_context": math.exp(self.past_nll[b] / self.past_n) if self.past_n else None,
                "tokens_past_context": self.past_n, "tok_s": total_n / wall, "wall_s": wall, "batch": self.B,
                "cache_tokens_max": self.max_held, "kv_bytes": self.cache.nbytes() // self.B,
                "max_position_id": self.max_pos, **flatness(win.samples)}


def stream(model, ids: torch.Tensor, policy: str | Policy, budget: int | None = None, chunk: int = CHUNK,
           positions: str = "cache", window: int = WINDOW, progress: bool = False, heavy_share: float = HEAVY_SHARE,
           on_sample=None) -> tuple[dict, list[dict]]:
    """Stream ``ids`` (1, N + 1) through an evicting cache of ``budget`` tokens (or a built policy with a token
    budget), ``chunk`` tokens per forward (1: token by token). Returns (metrics, samples), one sample per
    ``window`` predicted tokens. ``progress``: a tqdm bar and, after the calibration, the wall-time estimate."""
    st = Streamer(model, ids, [policy], budget, chunk, positions, window, heavy_share,
                  None if on_sample is None else (lambda b, smp: on_sample(smp)))
    drive(st, progress)
    return st.metrics(), st.wins[0].samples


def drive(st: Streamer, progress: bool = False, runs_left: int = 1) -> None:
    """Advance a streamer to the end of its text, with a tqdm bar and, once the cache is full and some tokens
    more are done, the measured speed and the wall time it predicts (for ``runs_left`` such runs)."""
    calib = min(st.n_pred, max(2 * (st.budget if isinstance(st.budget, int) else 0), 256))  # past the filling
    step = st.chunk * max(1, 64 // st.chunk)
    with tqdm(total=st.n_pred, unit="tok", desc=f"{st.pol.name} {st.budget}", mininterval=5, disable=not progress,
              file=sys.stderr) as bar:
        while not st.done:
            before = st.s
            st.advance(calib if before < calib else before + step)
            bar.update(st.s - before)
            if progress and before < calib <= st.s:
                bar.write(f"[stream] {st.pol.name} {st.budget} chunk {st.chunk}: "
                          f"{estimate(st.s, st.n_pred, st.wall, runs_left)}", file=sys.stderr)
            if progress and st.wins[0].samples:
                bar.set_postfix(ppl=f"{st.wins[0].samples[-1]['ppl']:.2f}", held=st.held,
                                rss=f"{rss_bytes() / 2**20:.0f}MiB", refresh=False)


# ------------------------------------------------------------------------------------ runner task
@dataclass
class StreamingTask(TaskSpec):
    """``conf/task/bench_streaming.yaml``: one run = the configured policy (a budget in tokens, e.g.
    ``policy.budget=128``) streaming ``tokens`` tokens of the text, ``chunk`` per forward (1: the authors'
    protocol). Samples: one per ``window`` predicted tokens (module doc). While it runs: a progress bar on stderr
    (tokens/s, perplexity, tokens held, resident memory), the measured speed and the wall time it predicts once
    the cache is full, and each window's sample appended to ``<run>/partial/windows.jsonl`` as it ends (removed
    with ``partial/`` once the record is written; a run that dies keeps its curve there until it is rerun)."""

    name: str
    text: str = "austen"
    tokens: int = 20000
    chunk: int = CHUNK
    positions: str = "cache"
    window: int = WINDOW
    shots: int = 0

    kind = "streaming"
    semantics = ("real",)

    def __post_init__(self):
        for key in ("tokens", "chunk", "window"):
            positive_or_none(f"task.{key}", getattr(self, key))
        check(self.positions in POSITIONS, f"task.positions={self.positions!r}: allowed: {', '.join(POSITIONS)}")
        check(self.shots == 0, f"task.shots={self.shots}: streaming takes no in-context examples (0)")

    def check_policy(self, policy) -> None:
        check(engine.keeps_all(policy) or isinstance(policy.budget, int),
              f"policy.budget={policy.budget!r}: streaming needs a cache size in tokens (an int, e.g. 128)")

    def check_quant(self, quant) -> None:
        check(quant is None, f"quant={quant and quant.label()}: the streaming task's cache is not quantized (its "
                             f"key shifter moves stored keys, packed rows cannot be moved); allowed: quant=none")

    def add_bos(self, tokenizer) -> bool:
        """The text is encoded with the tokenizer's special tokens (``text_ids``): BOS where the tokenizer adds it."""
        return adds_bos(tokenizer, None)

    def run(self, model, tokenizer, policy, semantics: str, seed: int, quant=None) -> Result:
        self.check_policy(policy)
        self.check_quant(quant)
        ids = text_ids(tokenizer, load_text(self.text), self.tokens)
        live = partial_file("windows.jsonl")
        if live is not None:
            live.parent.mkdir(parents=True, exist_ok=True)
            live.write_text("")  # a rerun starts its curve afresh

        def on_sample(sample: dict) -> None:
            with open(live, "a", encoding="utf-8") as f:
                from h2o.store.strict_json import dumps as strict_dumps  # inf, nan: null
                f.write(strict_dumps(sample) + "\n")

        metrics, samples = stream(model, ids, policy, chunk=self.chunk, positions=self.positions,
                                  window=self.window, progress=True, on_sample=on_sample if live else None)
        return Result(metrics, samples, {"chunk": self.chunk, "positions": self.positions, "text": self.text})
