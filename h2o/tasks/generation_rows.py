"""What each generated row of a ``generate`` call did, for a per-sample record (h2o.tasks.reasoning): how many tokens
it generated, whether it stopped at the length limit, the KV cache it held when it ended and at its peak, and its
time.

:class:`StepWatch` is a logits processor handed to ``generate``: at every step it notes the time and, per row, the
token x KV head entries the evicting cache holds (the host counts of :class:`h2o.core.cache.EvictingLayer`, no
device read; a sliding-window layer's and a pooled policy's count is the slots stored, an upper bound of the tokens
held). Step ``k`` sees the cache the ``k``-th new token is predicted from (the prompt, cut to the budget, and ``k``
generated tokens). A row that generated ``n`` tokens ended at step ``n - 1``: its last token never enters the cache.
:func:`row_fields` reads the rows off the output ids; :func:`pair` matches lm-eval's answers to them.
"""
from __future__ import annotations

import json
import time

import torch
from transformers import LogitsProcessor

FIELDS = ("prompt_tokens", "gen_tokens", "at_limit", "kv_tokens_end", "kv_bytes_end", "kv_tokens_peak", "kv_bytes_peak",
          "time_s")


class StepWatch(LogitsProcessor):
    """Per generation step: the seconds since ``start`` and each row's tokens held (token x KV head entries summed
    over the layers); returns the scores unchanged."""

    def __init__(self, cache, kv_heads: int, start: float):
        self.cache, self.kv_heads, self.start = cache, kv_heads, start
        self.times: list[float] = []
        self.held: list[list[int]] = []  # per step, per row

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.note(input_ids.shape[0])
        return scores

    def note(self, rows: int = 1) -> None:
        """One step of ``rows`` rows (h2o.tasks.many_questions.greedy calls it with its one row)."""
        self.times.append(time.perf_counter() - self.start)
        held = self.cache.figures()["held"]
        self.held.append([self.kv_heads * (held[b] if held else 0) for b in range(rows)])


def ended_at(tokens: list[int], eos: set[int], stop: list[str], decode) -> int | None:
    """Tokens a row generated up to its stop (the EOS token or the token that completes a stop text, counted), or
    None when it never stopped. ``decode``: ids -> text."""
    first_eos = next((i + 1 for i, t in enumerate(tokens) if t in eos), None)
    scope = tokens[:first_eos] if first_eos else tokens
    stops = [s for s in stop if s]
    if not stops or not any(s in decode(scope) for s in stops):
        return first_eos
    lo, hi = 1, len(scope)  # the fewest tokens whose text holds a stop
    while lo < hi:
        mid = (lo + hi) // 2
        if any(s in decode(scope[:mid]) for s in stops):
            hi = mid
        else:
            lo = mid + 1
    return lo


def row_fields(out: torch.Tensor, prompt_width: int, prompts: list[int], watch: StepWatch, eos: set[int],
               stop: list[str], decode, bytes_per_token: int | None) -> list[dict]:
    """out (B, T + new), left-padded, ``prompts`` each row's prompt tokens -> each row's :data:`FIELDS`:
    ``prompt_tokens``, ``gen_tokens`` (up to its stop, else every new token),
    ``at_limit`` (it never stopped), ``kv_tokens_end`` / ``kv_tokens_peak`` (token x KV head entries at its last
    step and the most over its steps), their bytes (None: ``bytes_per_token`` None, a quantized cache), ``time_s``
    (from the call's start, prefill included, to its last step)."""
    new = out[:, prompt_width:].tolist()
    rows = []
    for b, tokens in enumerate(new):
        n = ended_at(tokens, eos, stop, decode)
        gen = n if n is not None else len(tokens)
        last = min(max(gen - 1, 0), len(watch.held) - 1)  # the step its last token was predicted at
        held = [step[b] for step in watch.held[:last + 1]] or [0]
        rows.append(fields(prompts[b], gen, n is None, held, watch.times[last] if watch.times else None,
                           bytes_per_token))
    return rows


def fields(prompt: int, gen: int, at_limit: bool, held: list[int], seconds: float | None,
           bytes_per_token: int | None) -> dict:
    """One answer's :data:`FIELDS`: ``held`` the entries at each of its steps (the last: its end), ``seconds`` to
    its last step (None: not timed), the bytes None where ``bytes_per_token`` is None."""
    size = (lambda t: None) if bytes_per_token is None else (lambda t: t * bytes_per_token)  # noqa: E731
    return {"prompt_tokens": prompt, "gen_tokens": gen, "at_limit": at_limit, "kv_tokens_end": held[-1],
            "kv_bytes_end": size(held[-1]), "kv_tokens_peak": max(held), "kv_bytes_peak": size(max(held)),
            "time_s": None if seconds is None else round(seconds, 4)}


def pair(requests, answers: list[str], rows: list[dict]) -> list[dict]:
    """lm-eval's requests (in order; a request repeated ``repeats`` times is one Instance listed again) and their
    answers -> one record per request: task, doc id, repeat (0-based), then its row's :data:`FIELDS`. ``rows``: the
    generated rows, each with its ``context`` and ``answer`` (the text as lm-eval returns it); a row serves one
    request of the same context and answer (equal answers of one prompt are interchangeable)."""
    free: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        free.setdefault((row["context"], row["answer"]), []).append(row)
    seen: dict[int, int] = {}
    out = []
    for req, answer in zip(requests, answers, strict=True):
        repeat = seen.get(id(req), 0)
        seen[id(req)] = repeat + 1
        match = free.get((req.args[0], answer)) or [{}]
        row = match.pop(0) if match[0] else {}
        out.append({"task": getattr(req, "task_name", None), "doc_id": getattr(req, "doc_id", None),
                    "repeat": repeat, **{k: row.get(k) for k in FIELDS}})
    return out


class GenerationRows:
    """The part of lm-eval's ``--model h2o`` (h2o.tasks.lm_eval_model.H2OLM, mixed in) that records each generated
    answer's row: it reads the model's ``model``, ``tokenizer``, ``quant``, ``think_end_token``, ``_batch`` and
    ``generation_log``, appends to its ``rows`` and keeps the answered requests' rows in ``generations``."""

    def keep_generations(self, rows: list[dict]) -> None:
        """Answered requests' rows into ``generations`` and, with ``generation_log``, appended to its file."""
        self.generations.extend(rows)
        if self.generation_log:
            with open(self.generation_log, "a", encoding="utf-8") as f:
                f.writelines(json.dumps(row) + "\n" for row in rows)

    def watch(self, cache, generation_kwargs: dict):
        """A :class:`h2o.tasks.generation_rows.StepWatch` on ``cache``, added to the call's logits processors."""
        import time

        from transformers import LogitsProcessorList

        from h2o.tasks.kv_held import geometry

        watch = StepWatch(cache, geometry(self.model)[1], time.perf_counter())
        generation_kwargs["logits_processor"] = LogitsProcessorList(
            [*generation_kwargs.get("logits_processor", []), watch])
        return watch

    def note_rows(self, out: torch.Tensor, width: int, prompts: list[int], watch, stop: list[str]) -> None:
        """Each row of ``out`` (B, width + new) (``prompts``: each row's prompt tokens) with its context and its
        answer as lm-eval returns it (the same decoding and cut as HFLM.generate_until) -> ``rows``."""
        from lm_eval.models.utils import postprocess_generated_text

        from h2o.tasks.kv_held import entry_bytes

        ids = getattr(self.model.generation_config, "eos_token_id", None)
        eos = {self.tokenizer.eos_token_id, *([ids] if isinstance(ids, int) else ids or [])} - {None}
        size = entry_bytes(self.model, self.quant)
        raw = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731  (as lm-eval's stop test)
        fields = row_fields(out, width, prompts, watch, eos, stop, raw, size)
        think = self.think_end_token if isinstance(self.think_end_token, str) else None
        for b, row in enumerate(fields):
            answer = postprocess_generated_text(self.tok_decode(out[b, width:].tolist()), stop, think)
            self.rows.append({"context": self._batch[b] if b < len(self._batch) else None, "answer": answer, **row})
