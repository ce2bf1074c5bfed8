"""Long-book perplexity (``conf/task/austen_ppl.yaml``): the simulated mask over fixed windows of a book.

The book (Jane Austen's six novels, or Moby-Dick; h2o.assets.data) is tokenized once without special tokens and cut
into consecutive windows of ``window`` tokens (``add_bos_token``: true puts BOS first in each window, then
``window - 1`` tokens of text; null does so when the model's tokenizer adds BOS by default, as Gemma's does;
false, the default, never); windows ``0, stride, 2*stride, ...`` (``n_windows`` of them) are
scored, ``batch_size`` at a time (``auto``: sized to the free GPU memory, h2o.tasks.batching), each in one forward
pass inside ``attach(model, policy)``: token i of a window is predicted from what the policy holds at step i
(budget = ratio of the window). Every token after the first of each window is predicted;
``ppl = exp(total NLL / predicted tokens)``. Its 95% interval treats the windows as
the sample (they have equal lengths): ``exp(nll_per_token +- 1.96 * nll_per_token_stderr)``, the standard error
of the windows' mean NLL per token.

Context then continuation (``context: C``, conf/task/austen_ctx.yaml; kvpress's protocol): the first ``C`` tokens of
each window are a prompt that every row of it sees whole; the other ``window - C`` are the continuation, teacher-forced
and the only tokens scored (predicted from rows ``C - 1 .. window - 2``). The budget is a ratio of the context.
``compress: prefill`` cuts the context once to the budget when it ends and keeps every continuation token;
``compress: decode`` cuts it there too and then keeps the budget as the continuation grows (each new token evicts
one). Without ``context`` there is no prompt, so ``compress: prefill`` is refused in one line. The record has the KV
cache actually held (h2o.tasks.kv_held): tokens, bytes held and bytes stored per sequence right after the cut and at
the end (a pooled policy, adakv, stores its heads padded: its windows go through the evicting cache once more to
measure that).
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass

import torch

from h2o.core import engine
from h2o.tasks.base import Result, TaskSpec, adds_bos, as_run, check, positive_or_none, stderr
from h2o.tasks.batching import BatchSize, Sizing, check_batch_size, choose, record

TEXTS = ("austen", "moby_dick")


def book(text: str) -> str:
    from h2o.assets import fetch

    return fetch.austen_text() if text == "austen" else fetch.moby_dick()


@dataclass
class PerplexityTask(TaskSpec):
    name: str
    text: str = "austen"
    window: int = 512
    n_windows: int = 16
    stride: int = 1
    batch_size: BatchSize = 1  # or auto (h2o.tasks.batching)
    shots: int = 0
    add_bos_token: bool | None = False  # BOS first in each window: true | false | null (the tokenizer's default)
    context: int | None = None  # tokens of each window that are the prompt (null: none, every token is scored)

    kind = "perplexity"
    semantics = ("simulated", "reference")
    quantizes = True

    def __post_init__(self):
        check(self.text in TEXTS, f"task.text={self.text!r}: allowed: {', '.join(TEXTS)}")
        for key in ("window", "n_windows", "stride"):
            positive_or_none(f"task.{key}", getattr(self, key))
        check_batch_size(self.batch_size)
        check(self.window >= 2, f"task.window={self.window}: must be >= 2")
        check(self.shots == 0, f"task.shots={self.shots}: perplexity takes no in-context examples (0)")
        check(self.context is None or (isinstance(self.context, int) and not isinstance(self.context, bool)
                                       and 1 <= self.context < self.window),
              f"task.context={self.context!r}: expected null or a token count in 1-{self.window - 1} (less than "
              f"task.window={self.window}: the rest is the scored continuation)")
        check(self.add_bos_token in (True, False, None),
              f"task.add_bos_token={self.add_bos_token!r}: allowed: true, false, null (the tokenizer's default)")

    def add_bos(self, tokenizer) -> bool:
        """null: whether the tokenizer puts BOS first by default; true: always (the tokenizer must have one)."""
        if self.add_bos_token is None:
            return adds_bos(tokenizer, None)
        check(not self.add_bos_token or getattr(tokenizer, "bos_token_id", None) is not None,
              "task.add_bos_token=true: this model's tokenizer has no BOS token; allowed: false, null")
        return bool(self.add_bos_token)

    def check_model(self, model) -> None:
        max_pos = model.max_positions()
        check(max_pos is None or self.window <= max_pos,
              f"task.window={self.window}: longer than model {model.name}'s context of {max_pos} tokens; "
              f"allowed: 2-{max_pos}")
        from h2o.assets.fetch import fetch_austen, fetch_moby_dick

        need = ((self.n_windows - 1) * self.stride + 1) * self.window  # tokens; a token is at least one byte
        size = (fetch_austen() if self.text == "austen" else fetch_moby_dick()).stat().st_size  # fetched if missing
        most = (size // self.window - 1) // self.stride + 1
        check(need <= size,
              f"task.n_windows={self.n_windows}: {self.n_windows} windows of {self.window} tokens (stride "
              f"{self.stride}) need {need} tokens; the text {self.text} has at most {size}; allowed: 1-{most}")

    def check_policy(self, policy) -> None:
        """Sliding windows have no prompt: a policy compressed once at a prompt's end is refused there."""
        from h2o.core.policies.budget import Unsupported

        if self.context is None and engine.compresses_once(policy):
            raise Unsupported(f"compress=prefill: task {self.name} scores sliding windows with no prompt to compress; "
                              f"allowed: compress=decode, or task.context=<prompt tokens> (task=austen_ctx)")

    @property
    def scored(self) -> int:
        """Tokens scored per window: the continuation after ``context``, else every token after the first."""
        return self.window - (self.context or 1)

    def windows(self, tokenizer) -> torch.Tensor:
        """(n_windows, window) token ids (each starting with BOS when :meth:`add_bos`)."""
        need_chars = (self.n_windows - 1) * self.stride * self.window * 8 + self.window * 8  # ~4 chars a token
        ids = tokenizer(book(self.text)[:need_chars], add_special_tokens=False, return_tensors="pt").input_ids[0]
        starts = [i * self.stride * self.window for i in range(self.n_windows)]
        check(starts[-1] + self.window <= len(ids), f"task: the text has {len(ids)} tokens, fewer than "
                                                     f"n_windows x stride x window needs")
        if self.add_bos(tokenizer):
            bos = torch.tensor([tokenizer.bos_token_id])
            return torch.stack([torch.cat([bos, ids[s:s + self.window - 1]]) for s in starts])
        return torch.stack([ids[s:s + self.window] for s in starts])

    def nll(self, model, policy, ids: torch.Tensor, quant=None) -> torch.Tensor:
        """(b, W) windows -> (b,) summed NLL of the scored tokens (:attr:`scored`), each window under the policy
        (and the KV quantizer ``quant``: the values a quantized cache holds)."""
        from h2o.core.attach import attach

        first = (self.context or 1) - 1  # the row predicting the first scored token
        with attach(model, policy, prompt_len=self.context or 0, quant=quant), torch.no_grad():
            logits = model(ids, use_cache=False).logits[:, first:-1].float()  # (b, scored, V)
        return torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, first + 1:],
                                                 reduction="none").sum(-1)  # (b,)

    def sizing(self, model, policy, wins: torch.Tensor, quant=None) -> Sizing:
        """The batch size (the paper code's rule: one window at a time)."""
        if engine.whole_forward(policy):
            return Sizing(1, "one_at_a_time", "semantics=reference scores one unpadded sequence at a time")
        return choose(self.batch_size, model, lambda b: self.nll(model, policy, wins[:1].repeat(b, 1), quant),
                      len(wins))

    def run(self, model, tokenizer, policy, semantics: str, seed: int, quant=None) -> Result:
        from tqdm import tqdm

        from h2o.tasks.base import clamped

        from h2o.tasks.progress import RequestLog

        cpu0 = time.process_time()
        policy = as_run(policy, semantics)
        wins = self.windows(tokenizer).to(model.device)  # (N, W)
        sizing = self.sizing(model, policy, wins, quant)
        bs = sizing.size
        samples = []
        log = RequestLog.open("windows")  # windows scored before an interruption (None outside a recorded run)
        for start in tqdm(range(0, len(wins), bs), desc=f"{self.name} {policy.name}", file=sys.stderr):
            if log is not None and all(w in log for w in range(start, min(start + bs, len(wins)))):
                samples.extend(log[w] for w in range(start, min(start + bs, len(wins))))
                continue
            nll = self.nll(model, policy, wins[start:start + bs], quant)  # (b,)
            for j, v in enumerate(nll.tolist()):
                n = self.scored
                samples.append({"window": start + j, "start_token": (start + j) * self.stride * self.window,
                                "nll": v, "n_tokens": n, "ppl": math.exp(v / n)})
                if log is not None:
                    log[start + j] = samples[-1]
        total = sum(s["nll"] for s in samples)
        count = sum(s["n_tokens"] for s in samples)
        nll, se = total / count, stderr([s["nll"] / s["n_tokens"] for s in samples])
        metrics = {"ppl": math.exp(nll), "nll_per_token": nll, "nll_per_token_stderr": se,
                   "ppl_ci95_low": math.exp(nll - 1.96 * se), "ppl_ci95_high": math.exp(nll + 1.96 * se)}
        from h2o.tasks.kv_held import simulated_held

        reference = self.context or self.window  # what a budget ratio is taken of
        return Result(metrics, samples, {"window": self.window, "context": self.context, "tokens_scored": count,
                                         "clamped_requests": clamped(policy, [reference] * len(samples)),
                                         **simulated_held(model, policy, self.window, self.context, quant,
                                                          wins, bs),  # a pooled policy's padding: measured
                                         "cpu_s": round(time.process_time() - cpu0, 1),  # this process, all threads
                                         **record(self.batch_size, [sizing])})
