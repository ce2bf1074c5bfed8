"""What h2o.tasks.long_generation measures of each answer: its tokens up to EOS, where it departs from the full
cache's answer, its repetition, the KV it held along the way, and the run's aggregates; and the full cache's
answers kept by their inputs (:class:`ReferenceAnswers`)."""
from __future__ import annotations

import hashlib
import json
import math

import torch

from h2o.tasks.base import stderr


def eos_ids(model, tokenizer) -> set[int]:
    """The token ids that end an answer: the tokenizer's EOS and the generation config's."""
    ids = getattr(model.generation_config, "eos_token_id", None)
    return {tokenizer.eos_token_id, *([ids] if isinstance(ids, int) else ids or [])} - {None}


def answers(out: torch.Tensor, width: int, eos: set[int]) -> list[list[int]]:
    """(b, width + new) output -> each row's answer ids up to and including its first EOS (all new ids if none)."""
    rows = []
    for tokens in out[:, width:].tolist():
        end = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
        rows.append(tokens[:end])
    return rows


def row_fields(out: torch.Tensor, width: int, watch, eos: set[int], per_entry: int) -> list[dict]:
    """Each row's h2o.tasks.generation_rows fields (generated tokens, length-limit stop, KV held at its end and peak,
    time)."""
    from h2o.tasks.generation_rows import row_fields as fields

    return fields(out, width, [width] * out.shape[0], watch, eos, [], None, per_entry)


def first_departure(mine: list[int], ref: list[int]) -> int:
    """The index of the first token where ``mine`` differs from ``ref``; the shorter length where one is a prefix of
    the other (equal answers: their length)."""
    return next((i for i, (a, b) in enumerate(zip(mine, ref)) if a != b), min(len(mine), len(ref)))


def distinct(tokens: list[int], n: int) -> float | None:
    """The share of distinct ``n``-grams among an answer's ``n``-grams (1: no repeat); None for fewer than n tokens."""
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else None


def answer_measures(mine: list[int], ref: list[int], n: int) -> dict:
    return {"first_departure": first_departure(mine, ref), "identical": mine == ref,
            f"distinct_{n}": distinct(mine, n), f"ref_distinct_{n}": distinct(ref, n)}


def trace(watch, row: int, generated: int, every: int, per_entry: int) -> list[int]:
    """The bytes row ``row`` held at steps 0, every, 2 x every, ... of its generation (step k: the cache the k-th new
    token is predicted from), up to its last step."""
    last = min(max(generated - 1, 0), len(watch.held) - 1)
    return [watch.held[k][row] * per_entry for k in range(0, last + 1, every)]


def metrics(samples: list[dict], n: int) -> dict:
    """Means over prompts, with the standard error and 95% interval of the headline's."""
    out = {}
    for key in ("tf_nll_per_token", "tf_top1", "first_departure", "gen_tokens", f"distinct_{n}", "kv_bytes_peak",
                "kv_bytes_end", "time_s"):
        values = [s[key] for s in samples if s.get(key) is not None]
        out[key] = sum(values) / len(values) if values else None
        if key in ("tf_nll_per_token", "tf_top1", "first_departure", f"distinct_{n}") and values:
            se = stderr(values)
            out.update({f"{key}_stderr": se, f"{key}_ci95_low": out[key] - 1.96 * se,
                        f"{key}_ci95_high": out[key] + 1.96 * se})
    out["tf_ppl"] = math.exp(out["tf_nll_per_token"]) if out.get("tf_nll_per_token") is not None else None
    out["at_limit_share"] = sum(bool(s["at_limit"]) for s in samples) / len(samples) if samples else None
    out["identical_share"] = sum(bool(s["identical"]) for s in samples) / len(samples) if samples else None
    return out


class ReferenceAnswers:
    """The full cache's greedy answers of one task's prompts on one model, per batch, kept in
    ``<cache>/long_generation/<key>/batch<start>.json``; the key hashes everything that fixes them (the model's
    config, dtype and a checksum of its weights, the prompt ids, the batch size, max_new_tokens, torch's and
    transformers' versions)."""

    def __init__(self, task, model, ids: torch.Tensor):
        import transformers

        from h2o.assets.paths import cache_dir

        weights = next(model.parameters())
        what = {"config": model.config.to_json_string(use_diff=False), "dtype": str(model.dtype),
                "weights": float(weights.detach().double().abs().sum()), "ids": ids.tolist(),
                "batch_size": task.batch_size, "max_new_tokens": task.max_new_tokens, "torch": torch.__version__,
                "transformers": transformers.__version__, "device": str(model.device.type)}
        self.key = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]
        self.folder = cache_dir() / "long_generation" / self.key
        self.computed = self.read = 0

    def keep(self, start: int, rows: list[list[int]]) -> None:
        from h2o.store.files import atomic_write_text

        self.folder.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.folder / f"batch{start}.json", json.dumps(rows))

    def get(self, start: int, compute) -> list[list[int]]:
        """The batch's answers: read where kept, else ``compute()`` (and kept)."""
        path = self.folder / f"batch{start}.json"
        if path.is_file():
            self.read += 1
            return json.loads(path.read_text(encoding="utf-8"))
        rows = compute()
        self.computed += 1
        self.keep(start, rows)
        return rows

    def describe(self) -> dict:
        return {"key": self.key, "batches_read": self.read, "batches_computed": self.computed}
