"""What a resumed run's record needs from before the interruption, for lm-eval's model (h2o.tasks.lm_eval_model.
H2OLM inherits :class:`ResumeLogs`). lm-eval's request cache (h2o.tasks.progress.lm_eval_cache) answers the requests
scored before an interruption without the model, so what the model saw of them (the rows it scored, the prompts
and batches it generated) is kept beside it in the partial folder (h2o.tasks.progress.row_log), each line written
before lm-eval caches the results it belongs to. A run that resumed nothing reads this process's own lists, as
ever; a resumed one reads the logs: ``mean_seq_len`` and ``clamped_requests`` of multiple choice, ``kept_ratio``,
``mean_prompt_tokens``, ``clamped_requests`` and the kv-held fields of the generation tasks.
"""
from __future__ import annotations

import hashlib

import torch


def key(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()


class ResumeLogs:
    """Mixin of H2OLM: reads ``stats``, ``budgets``, ``footprints``, ``_batch`` (the contexts being generated)."""

    def open_logs(self) -> None:
        from h2o.tasks.progress import row_log

        self.row_log, self.prompt_log = row_log("lm_rows"), row_log("lm_prompts")  # None outside a run
        self.batch_log = row_log("lm_batches")
        self._probing = False  # batch_size=auto's probe rows are not the run's

    def log_generated(self, prompt: list[int], held: list[int], footprint: dict, rows: int) -> None:
        """One generate call: each prompt's (tokens, tokens held) keyed by its text (as lm-eval's request cache
        keys it), and the call's footprint keyed by its prompts."""
        if self.prompt_log is None or len(self._batch) != len(prompt):
            return
        self.prompt_log.update({key(t): [int(n), int(k)] for t, n, k in zip(self._batch, prompt, held)})
        self.batch_log.update({key("\x00".join(self._batch)): [footprint, rows]})

    def log_context(self, texts: list[str], prompt: int, held: float, footprint: dict) -> None:
        """A shared context compressed once and asked the requests ``texts`` (h2o.tasks.lm_eval_many): each
        request's (context tokens, tokens held per layer and KV head) keyed by its text, the compressed context's
        footprint once, keyed by the requests' texts; written before lm-eval caches their answers."""
        if self.prompt_log is None:
            return
        self.prompt_log.update({key(t): [int(prompt), held] for t in texts})
        self.batch_log.update({key("\x00".join(texts)): [footprint, 1]})

    def log_rows(self, inps: torch.Tensor, lengths: torch.Tensor, short: list[bool]) -> None:
        """Each scored row's (true length, clamped) into the run's row log, keyed by the row's tokens: lm-eval
        scores one row per distinct model input (its requests grouped by context + continuation[:-1]), so a row
        scored again after an interruption replaces its line and every row counts once."""
        if self.row_log is None or self._probing:
            return
        rows = {}
        for row, n, c in zip(inps.tolist(), lengths.tolist(), short):
            rows[key(repr(row[:n]))] = [int(n), int(bool(c))]
        self.row_log.update(rows)

    def row_stats(self) -> dict:
        """``rows``, ``tokens``, ``clamped`` of every row the run scored, before an interruption too (the row log);
        this process's own (``stats``) outside a run."""
        if self.row_log is None or not self.row_log.resumed:  # nothing from before: this process's, as ever
            return dict(self.stats)
        values = list(self.row_log.rows.values())
        return {**self.stats, "rows": len(values), "tokens": sum(v[0] for v in values),
                "clamped": sum(v[1] for v in values)}

    def all_budgets(self) -> list[tuple[int, int]]:
        """(prompt tokens, tokens held) of every generated prompt of the run, before an interruption too (the
        prompt log, keyed by the prompt's text as lm-eval's request cache keys it); ``budgets`` outside a run."""
        if self.prompt_log is None or not self.prompt_log.resumed:
            return list(self.budgets)
        return [tuple(v) for v in self.prompt_log.rows.values()]

    def all_footprints(self) -> list[tuple[dict, int]]:
        """(cache footprint at its end, rows) of every generate call of the run, before an interruption too (the
        batch log, keyed by the batch's prompts); ``footprints`` outside a run. Equal to an uninterrupted run's
        when the resumed batches are the same (batch_size=1, or an interruption between whole batches)."""
        if self.batch_log is None or not self.batch_log.resumed:
            return list(self.footprints)
        return [(v[0], v[1]) for v in self.batch_log.rows.values()]
