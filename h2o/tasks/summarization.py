"""Summarization with HELM's XSUM / CNN-DailyMail settings, generated with the real evicting cache.

Prompt: HELM's summarization adapter (``input_prefix="###\nArticle: "``, ``input_suffix="\n\n"``,
``output_prefix="Summarize the above article in 1 sentence.\n"``, ``output_suffix="\n"``, blocks joined by
``instance_prefix="\n"``; the open test block ends with ``output_prefix.rstrip()``, so the prompt ends on the
instruction's full stop, no newline)::

    ###
    Article: {article}

    Summarize the above article in 1 sentence.
    {summary}
    <blank line>
    ###
    Article: {test article}

    Summarize the above article in 1 sentence.

Articles are whitespace-normalised and cut to ``doc_max_words`` words (HELM's ``doc_max_length``); in-context
examples are train articles of ``shot_min_words``..``shot_max_words`` words, the same ``shots`` for every test
instance, drawn with ``random.Random(subset_seed)``; the test instances are a fixed random subset of
``limit`` (HELM samples its evaluation instances). When a prompt does not fit the model's positions, the last
in-context block is dropped first, as HELM does; with none left the article is cut from the left (HELM would cut
the prompt's end, the instruction included). Tokenized without BOS (``add_bos_token=false``, the paper code's
``add_special_tokens=False``); ``true``/``null`` are lm-eval's meanings (see h2o.tasks.multiple_choice).

Generation: left-padded batches of ``batch_size`` prompts (``auto``: sized to the free GPU memory on the longest
prompt generating all ``max_new_tokens``, before the seed is set; h2o.tasks.batching),
``attach(model, policy, mode="real")`` with a fresh cache per batch (budget = ratio of each prompt's length, fixed
at prefill; eviction runs during decoding), sampling at ``temperature`` (``greedy`` for argmax) after
``torch.manual_seed(seed)``, stop at ``stop`` (``###``) or after ``max_new_tokens``; ``equal_length`` removes
the stop and forces exactly ``max_new_tokens`` (the Self-BLEU protocol). ROUGE-1/2/L F1 with rouge-score
(stemmed, as HELM).
"""
from __future__ import annotations

import random
import sys
from dataclasses import dataclass

import torch
from transformers import StoppingCriteria

from h2o.tasks.base import Result, TaskSpec, adds_bos, check, check_hub_data, clamped, positive_or_none, stderr
from h2o.tasks.batching import BatchSize, Sizing, check_batch_size, choose, record
from h2o.tasks.kv_held import batch_fields

DATASETS = {  # name -> (hub path, config, article field, summary field); bb_xsum is offline (h2o.assets.data)
    "xsum": ("EdinburghNLP/xsum", None, "document", "summary"),
    "cnn_dm": ("abisee/cnn_dailymail", "3.0.0", "article", "highlights"),
    "bb_xsum": (None, None, "document", "summary"),
}


def clean(text: str, max_words: int | None = None) -> str:
    """Newlines to spaces, whitespace runs to one space, at most ``max_words`` words (HELM's _clean_and_truncate)."""
    return " ".join(text.replace("\n", " ").split()[:max_words])


def block(article: str, sentences: int, summary: str | None = None) -> str:
    """One HELM block; ``summary=None`` leaves it open for the model (HELM strips the output prefix's newline)."""
    unit = "sentence" if sentences == 1 else "sentences"
    head = f"###\nArticle: {article}\n\nSummarize the above article in {sentences} {unit}.\n"
    return head.rstrip() if summary is None else f"{head}{summary}\n"


def load_split(dataset: str, split: str) -> list[dict]:
    """Rows ``{"id", "article", "summary"}`` (article not yet cut) of ``train`` or ``test``."""
    if dataset == "bb_xsum":
        from h2o.assets.data import xsum_examples

        return [{"id": r["id"], "article": r["document"], "summary": r["summary"]} for r in xsum_examples(split)]
    import datasets

    path, config, art, summ = DATASETS[dataset]
    ds = datasets.load_dataset(path, config, split=split)
    return [{"id": r.get("id", str(i)), "article": r[art], "summary": r[summ]} for i, r in enumerate(ds)]


# The record's KV fields (h2o.tasks.kv_held.batch_fields: means per sequence over the batches): the bytes stored
# (padding included), and the bytes and tokens (token x KV head entries over the layers) the cache held at the end.
# They differ from the bytes stored where a policy gives heads uneven counts (adakv: heads stored padded to the
# largest).
KV_FIELDS = {"bytes_stored": "kv_bytes_per_seq", "bytes_held": "kv_held_bytes_per_seq",
             "tokens_held": "kv_tokens_per_seq"}


def logged_footprint(entry: dict) -> tuple[dict, int]:
    """(the batch's footprint, its rows) from a resumed batch's log entry, which holds per-sequence values: ``kv``
    the bytes stored, ``held`` [bytes, tokens] held (absent, or tokens None, in a batch logged before they were)."""
    rows = len(entry["samples"])
    held_bytes, tokens = entry.get("held", [entry["kv"], None])

    def total(v):
        return None if v is None else v * rows

    return {"bytes_stored": total(entry["kv"]), "bytes_held": total(held_bytes), "tokens_held": total(tokens)}, rows


class StopOnText(StoppingCriteria):
    """Stopping criterion: a row is done once its new tokens decode to text containing ``stop``."""

    def __init__(self, tokenizer, stop: str, prompt_len: int):
        self.tokenizer, self.stop, self.prompt_len = tokenizer, stop, prompt_len

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        texts = self.tokenizer.batch_decode(input_ids[:, self.prompt_len:], skip_special_tokens=True)
        return torch.tensor([self.stop in t for t in texts], device=input_ids.device)  # (B,)


@dataclass
class SummarizationTask(TaskSpec):
    name: str
    dataset: str = "xsum"
    sentences: int = 1
    shots: int = 5
    limit: int | None = 1000
    max_new_tokens: int = 64
    temperature: float = 0.3
    greedy: bool = False
    stop: str | None = "###"
    doc_max_words: int = 512
    shot_min_words: int = 50
    shot_max_words: int = 150
    subset_seed: int = 0
    equal_length: bool = False
    batch_size: BatchSize = 1  # or auto (h2o.tasks.batching); sampled outputs depend on it, greedy ones do not
    add_bos_token: bool | None = False

    kind = "summarization"
    semantics = ("real",)
    quantizes = True

    def __post_init__(self):
        check(self.dataset in DATASETS, f"task.dataset={self.dataset!r}: allowed: {', '.join(DATASETS)}")
        check(isinstance(self.shots, int) and self.shots >= 0, f"task.shots={self.shots!r}: expected an int >= 0")
        for key in ("limit", "max_new_tokens", "doc_max_words", "sentences"):
            positive_or_none(f"task.{key}", getattr(self, key))
        check_batch_size(self.batch_size)
        check(self.greedy or float(self.temperature) > 0, f"task.temperature={self.temperature}: must be > 0 "
                                                          "when sampling (or set task.greedy=true)")
        check(self.add_bos_token in (None, True, False),
              f"task.add_bos_token={self.add_bos_token!r}: allowed: true, false, null (the tokenizer's default)")
        hub_path = DATASETS[self.dataset][0]
        if hub_path is not None:
            check_hub_data(self.name, hub_path, (hub_path, hub_path.split("/")[-1]))

    def check_model(self, model) -> None:
        if self.dataset == "bb_xsum":  # offline data: its usable in-context pool is counted before any model loads
            n = len(self.shot_pool())
            check(self.shots <= n, f"task.shots={self.shots}: bb_xsum has {n} train articles of {self.shot_min_words}-"
                                   f"{self.shot_max_words} words (the in-context pool); allowed: 0-{n}")
        max_pos = model.max_positions()
        check(max_pos is None or self.max_new_tokens <= max_pos // 2,
              f"task.max_new_tokens={self.max_new_tokens}: leaves too little of model {model.name}'s context of "
              f"{max_pos} tokens for the prompt; allowed: 1-{(max_pos or 0) // 2}")

    # ------------------------------------------------------------------------------- prompts
    def examples(self) -> tuple[list[dict], list[dict]]:
        """(in-context examples, test instances), both fixed by ``subset_seed``."""
        rng = random.Random(self.subset_seed)
        pool = self.shot_pool()
        check(len(pool) >= self.shots, f"task.shots={self.shots}: only {len(pool)} train articles of "
                                       f"{self.shot_min_words}-{self.shot_max_words} words")
        shots = rng.sample(pool, self.shots)
        test = load_split(self.dataset, "test")
        if self.limit is not None and self.limit < len(test):
            test = [test[i] for i in sorted(rng.sample(range(len(test)), self.limit))]
        return shots, test

    def shot_pool(self) -> list[dict]:
        """The train articles that may be in-context examples: ``shot_min_words``..``shot_max_words`` words once
        cleaned (cut to ``doc_max_words``)."""
        return [r for r in load_split(self.dataset, "train")
                if self.shot_min_words <= len(clean(r["article"], self.doc_max_words).split()) <= self.shot_max_words]

    def add_bos(self, tokenizer) -> bool:
        return adds_bos(tokenizer, self.add_bos_token)

    def encode_kwargs(self) -> dict:
        """Tokenizer keyword for ``add_bos_token`` (lm-eval's meaning: None = the tokenizer's default)."""
        return {} if self.add_bos_token is None else {"add_special_tokens": self.add_bos_token}

    def prompt(self, shots: list[dict], row: dict, tokenizer, max_tokens: int) -> str:
        """The HELM prompt for one test row, shortened (drop the last blocks, then cut the article) to ``max_tokens``."""
        context = [block(clean(s["article"], self.doc_max_words), self.sentences, clean(s["summary"]))
                   for s in shots]
        article = clean(row["article"], self.doc_max_words)
        while True:
            text = "\n".join([*context, block(article, self.sentences)])  # HELM's instance_prefix
            if len(tokenizer(text, **self.encode_kwargs()).input_ids) <= max_tokens:
                return text
            if context:
                context.pop()
            else:
                words = article.split()
                check(bool(words), f"task.max_new_tokens={self.max_new_tokens}: even an empty article's prompt "
                                   f"does not fit in {max_tokens} tokens; lower task.max_new_tokens")
                article = " ".join(words[len(words) // 10 + 1:])

    # ----------------------------------------------------------------------------- generation
    def run(self, model, tokenizer, policy, semantics: str, seed: int, quant=None) -> Result:
        from tqdm import tqdm

        from h2o.cli.process import rouge_scorer
        from h2o.tasks.progress import RequestLog

        shots, test = self.examples()
        max_pos = getattr(model.config, "max_position_embeddings", None) or 2048
        check(self.max_new_tokens < max_pos, f"task.max_new_tokens={self.max_new_tokens}: no room for a prompt "
                                             f"in the model's context of {max_pos} tokens")
        prompts = [self.prompt(shots, r, tokenizer, max_pos - self.max_new_tokens) for r in test]
        scorer = rouge_scorer().RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
        sizing = self.sizing(model, tokenizer, policy, prompts, quant)  # before the seed: probing draws no sample
        bs = sizing.size
        torch.manual_seed(seed)
        samples, footprints = [], []  # the cache at each batch's end, its rows
        log = RequestLog.open(f"batches{bs}") if self.greedy else None  # resume (greedy: same output)
        for start in tqdm(range(0, len(prompts), bs), desc=f"{self.name} {policy.name}", file=sys.stderr):
            if log is not None and start in log:
                footprints.append(logged_footprint(log[start]))
                samples.extend(log[start]["samples"])
                continue
            batch = prompts[start:start + bs]
            gens, foot, lens = self.generate(model, tokenizer, policy, batch, quant)
            footprints.append((foot, len(batch)))
            done = []
            for row, prompt, gen, n in zip(test[start:start + bs], batch, gens, lens):
                ref = clean(row["summary"])
                scores = scorer.score(ref, gen)
                done.append({"doc_id": row["id"], "prompt": prompt, "generation": gen, "reference": ref,
                             "prompt_tokens": n, **{k: v.fmeasure for k, v in scores.items()}})
            samples.extend(done)
            if log is not None:
                log[start] = {"kv": foot["bytes_stored"] / len(batch),  # per sequence, as logged batches were
                              "held": [foot["bytes_held"] / len(batch), foot["tokens_held"] / len(batch)],
                              "samples": done}
        metrics = {}
        for k in ("rouge1", "rouge2", "rougeL"):
            metrics.update({k: sum(s[k] for s in samples) / len(samples), f"{k}_stderr": stderr([s[k] for s in samples])})
        info = {"mean_prompt_tokens": round(sum(s["prompt_tokens"] for s in samples) / len(samples), 1),
                **batch_fields(footprints, KV_FIELDS),
                "shots_used": len(shots),
                "clamped_requests": clamped(policy, [s["prompt_tokens"] for s in samples]),
                **record(self.batch_size, [sizing])}
        return Result(metrics, samples, info)

    def sizing(self, model, tokenizer, policy, prompts: list[str], quant=None) -> Sizing:
        """The batch size; ``auto`` probes with copies of the longest prompt generating all max_new_tokens."""
        if self.batch_size != "auto":
            return choose(self.batch_size, model, None, len(prompts))
        longest = max(prompts, key=lambda t: len(tokenizer(t, **self.encode_kwargs()).input_ids))
        return choose("auto", model, lambda b: self.generate(model, tokenizer, policy, [longest] * b, quant, True),
                      len(prompts))

    def generate(self, model, tokenizer, policy, prompts: list[str], quant=None,
                 full_length: bool = False) -> tuple[list[str], dict, list[int]]:
        """Left-padded batch generation -> (texts cut at the stop, the cache's footprint at the end (tokens held,
        bytes held and stored: :meth:`h2o.core.cache.EvictingCache.footprint`), prompt lengths); ``quant``: the
        quantizer the cache stores with; ``full_length``: no stop, exactly max_new_tokens (the batch-size probe's
        worst case)."""
        from h2o.core.attach import attach

        tokenizer.padding_side = "left"
        enc = tokenizer(prompts, return_tensors="pt", padding=True, **self.encode_kwargs()).to(model.device)  # (B, P)
        P = enc.input_ids.shape[1]
        kw = dict(max_new_tokens=self.max_new_tokens, do_sample=not self.greedy,
                  pad_token_id=tokenizer.pad_token_id)
        if not self.greedy:
            kw.update(temperature=float(self.temperature), top_p=1.0, top_k=0)
        if self.equal_length or full_length:
            kw["min_new_tokens"] = self.max_new_tokens
        elif self.stop:
            kw["stopping_criteria"] = [StopOnText(tokenizer, self.stop, P)]
        with attach(model, policy, mode="real", quant=quant) as h, torch.no_grad():
            cache = h.new_cache()
            out = model.generate(**enc, cache=cache, **kw)  # (B, P + new)
            foot = cache.footprint()
        texts = tokenizer.batch_decode(out[:, P:], skip_special_tokens=True)
        if self.stop and not self.equal_length:
            texts = [t.split(self.stop)[0] for t in texts]
        return [t.strip() for t in texts], foot, enc.attention_mask.sum(-1).tolist()
