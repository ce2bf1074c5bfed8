"""lm-eval model ``h2o``: Hugging Face's ``HFLM`` with a KV-cache policy around the model call.

    python -m h2o.tasks.lm_eval_cli --model h2o \
        --model_args pretrained=smollm2-135m,policy=h2o,budget=0.2,heavy_share=0.5 --tasks bb_copa --include_path tasks

model_args beyond HFLM's: ``policy`` (a name of h2o.POLICIES, default full) and its options, spelled as in Hydra
(``policy=h2o policy.budget=0.2`` <-> ``policy=h2o,budget=0.2``: the keys and defaults of conf/policy/<name>.yaml
and the other arguments the factory takes, e.g. ``compress=prefill`` <-> ``+policy.compress=prefill``;
h2o.assets.policy_config), ``semantics`` (simulated; ``reference``: a second spelling of the paper code's rule,
h2o.core.engine), ``scoring`` (sum | mean), ``quant`` (none | uniform | kvquant, h2o.core.quant) with its options
spelled ``quant_<option>``: ``quant=uniform,quant_bits=4,quant_group_size=64`` or ``quant=kvquant,quant_bits=3``
(kvquant's ``quant_calibration`` defaults to ``<cache>/kvquant/<pretrained>.pt``, fitted by
``python -m h2o.assets.calibrate --model <pretrained>``); both paths attend to the values the quantized cache holds.
``pretrained`` also takes ``smollm2-135m``, ``gemma3-270m`` and ``tiny:<arch>``. Integers are token counts.

Only the model call changes:
* log-likelihood requests (multiple choice): one forward pass per batch inside ``attach(model, policy)``, the
  simulated eviction mask; the budget is a ratio of each request's own length (context + continuation, less
  the last token, which is never an input). With ``compress=prefill`` (kvpress's protocol; the methods defined at
  a prompt's end: snapkv, knorm, ...) each request's prompt is its context: the context is compressed once to a
  ratio of its own length when it ends, the continuation sees what is held plus itself, and nothing after is
  evicted (rows sharing a continuation length share one forward with ``prompt_len``; tests/test_methods_experiment.py
  checks the result against the evicting cache fed the context, then the continuation).
* generation requests: ``model.generate`` inside ``attach(model, policy, mode="real")`` with a fresh evicting
  cache per call (left-padded batches); the budget is a ratio of each prompt's length, and each generated row's
  ``(prompt tokens, budget tokens)`` is kept in ``budgets`` (in the order lm-eval generates).
* ``questions=K`` / ``turns=K``: the generation requests sharing a context, compressed once (h2o.tasks.lm_eval_many).
With ``generation_log=<file>`` (or ``track_rows`` set, as h2o.tasks.reasoning does) each generated answer's tokens,
length-limit stop, KV held at its end and peak, and time are kept in ``generations`` (task, doc id, repeat; appended
to the file as JSON lines; h2o.tasks.generation_rows).
Every policy runs through the harness's attention function and cache, ``full`` included (no pass-through to the plain
model): at 100% budget generations equal lm-eval's ``hf`` model token for token and log-likelihoods agree within
float noise (tests/test_long_context.py).

The prompt and the question: a generation request's context may end with a question -- the doc's ``question`` field
(h2o.tasks.niah) or, in lm-eval's RULER tasks, the text from kvpress's question pattern on (h2o.tasks.question_after).
:meth:`H2OLM.question_tokens` gives how many trailing prompt tokens are that question (0 when none is known).
``question=prompt`` (default) compresses the whole context, the question's queries the newest; ``question=after``
(kvpress's query-agnostic protocol) prefills the context less the question alone, the budget a ratio of it, then feeds
the question and generates (``budgets`` then holds each row's context tokens); a request with no question to move is
refused in one line.

Padding fix: HFLM right-pads a log-likelihood batch with zeros and passes no attention mask, so a policy would take
its budget of the padded length. ``_loglikelihood_tokens`` records every request's exact input, and ``_model_call``
recovers each row's true length from it (strip the trailing zeros, then match the known input), moves the pads to
the left with the matching attention mask (the simulated path's exact layout; its right-padded layout starts
evicting too late for the shorter rows, reported to the core), and moves the logits back: budgets stay per
sequence, pads are never attended, and results are identical for any batch size (tested). A row that matches no
known input (only lm-eval's batch-size probe) is taken whole.
``batch_size=auto`` / ``auto:N``: lm-eval's scheduler asks :meth:`H2OLM._detect_batch_size`, which sizes the batch
by h2o.tasks.batching (free GPU memory and a measured per-sequence cost, checked, halved on out-of-memory; a
fixed default on the CPU) instead of lm-eval's halving from 64; each sizing is kept in ``sizings``.

Scoring: ``scoring=sum`` is lm-eval's (summed log-likelihood for ``acc``, byte-normalised for ``acc_norm``);
``scoring=mean`` divides each continuation's log-likelihood by its number of tokens (the paper code's rule), so
``acc`` becomes the per-token-average accuracy. Either way ``cont_tokens`` maps each request's ``(context,
continuation)`` to its continuation's token count, so a caller can apply the other rule to the same log-likelihoods
(h2o.tasks.multiple_choice computes both accuracies from one forward pass).

BOS: ``add_bos_token`` is lm-eval's: ``None`` leaves the tokenizer's default (BOS for LLaMA and OPT), ``False``
encodes without special tokens (the paper code's protocol, the ``h2o`` model's default), ``True`` with them.
lm-eval 0.4.13 fills its model registry by imports only: ``python -m h2o.tasks.lm_eval_cli`` imports this module.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from h2o.assets.model_spec import resolve_pretrained
from h2o.core.attach import attach
from h2o.core.policies import POLICIES, Policy, PolicyError
from h2o.core import engine
from h2o.core.quant import QuantError, Quantizer
from h2o.tasks.batching import Sizing, check_batch_size, choose, from_left_padding, from_text, to_left_padding
from h2o.tasks.question_after import QUESTIONS, check_many, context_then_question, prefill, question_of
from h2o.tasks.generation_rows import GenerationRows, pair
from h2o.tasks.lm_eval_many import AskMany
from h2o.tasks.resume_logs import ResumeLogs

SEMANTICS = ("simulated", "reference")
SCORING = ("sum", "mean")
QUANT_PREFIX = "quant_"


def make_lm_quant(quant: str = "none", options: dict | None = None, pretrained=None):
    """``--model_args quant=<scheme>,quant_<option>=<value>,...`` -> the quantizer (None for ``none``); a bad
    scheme, option or value is a one-line QuantError. ``options``: the ``quant_*`` arguments (prefix kept)."""
    import inspect

    from h2o.assets.paths import calibration_file
    from h2o.core.quant import SCHEMES, QuantError, make_quant

    opts = {k[len(QUANT_PREFIX):]: v for k, v in (options or {}).items()}
    if quant == "none" and opts:
        raise QuantError(f"--model_args {', '.join(options)}: quant=none takes no options; "
                         f"allowed: quant={', quant='.join(s for s in SCHEMES if s != 'none')} with its options")
    if quant in SCHEMES and SCHEMES[quant] is not None:
        allowed = [n for n in inspect.signature(SCHEMES[quant]).parameters]
        bad = next((k for k in opts if k not in allowed), None)
        if bad is not None:
            raise QuantError(f"--model_args {QUANT_PREFIX}{bad}: no such option for quant={quant}; allowed: "
                             f"{', '.join(QUANT_PREFIX + n for n in allowed)}")
    if quant == "kvquant" and "calibration" not in opts and isinstance(pretrained, str):
        opts["calibration"] = str(calibration_file(pretrained))
    return make_quant(quant, **opts)


def lm_policy(policy: str | Policy, args: dict, semantics: str = "simulated") -> Policy:
    """``--model_args policy=<name>,<key>=<value>,...`` -> the policy Hydra builds from ``policy=<name>
    policy.<key>=<value>`` (h2o.assets.policy_config); takes every policy option out of ``args`` (a Policy
    object is used as it is). ``semantics=reference`` (a second spelling, a notice) -> the paper code's rule."""
    from h2o.assets.policy_config import build_policy, notice, option_keys, read_value

    keys = {k for name in POLICIES for k in option_keys(name)}  # every policy's: another policy's is an error
    # lm-eval reads numbers and true/false; a word is read as Hydra reads it (null -> None)
    options = {k: read_value(k, v, f"--model_args {k}={v}") if isinstance(v, str) else v
               for k, v in ((k, args.pop(k)) for k in list(args) if k in keys)}
    if semantics not in SEMANTICS:
        raise PolicyError(f"semantics={semantics!r}: allowed: {', '.join(SEMANTICS)}")
    if isinstance(policy, str):
        policy = build_policy(policy, "--model_args ", **options)
    if semantics == "reference":
        reference = engine.as_paper_rule(policy)
        notice(f"--model_args semantics=reference is spelled policy={reference.name} now; policy={policy.name}")
        policy = reference
    return policy


@register_model("h2o")
class H2OLM(AskMany, ResumeLogs, GenerationRows, HFLM):
    def __init__(self, pretrained="smollm2-135m", policy: str | Policy = "full", semantics: str = "simulated",
                 scoring: str = "sum", quant: str | Quantizer | None = "none", question: str = "prompt",
                 generation_log: str | None = None, questions: int = 1, turns: int = 1, **kwargs):
        """``policy`` and ``quant``: names with their options in ``kwargs`` (model_args), or built objects;
        ``question``: prompt | after; ``generation_log``: a JSON-lines file each generated answer's row is
        appended to (see the module docstring); ``questions`` / ``turns``: h2o.tasks.lm_eval_many."""
        if question not in QUESTIONS:
            raise PolicyError(f"question={question!r}: allowed: {', '.join(QUESTIONS)}")
        self.many = check_many(questions, turns, "")  # (questions | turns, K) or None
        policy = lm_policy(policy, kwargs, semantics)
        if engine.calibration(policy):  # a model's offline statistics (triattention)
            from h2o.assets.triattention import require

            policy = policy.calibrated(require(pretrained))
        quant_args = {k: kwargs.pop(k) for k in list(kwargs) if k.startswith(QUANT_PREFIX)}
        if isinstance(quant, str):
            quant = make_lm_quant(quant, quant_args, pretrained)
        elif quant_args:
            raise QuantError(f"--model_args {', '.join(quant_args)}: options of a named quant; a built quantizer "
                             f"({quant!r}) takes none")
        if scoring not in SCORING:
            raise PolicyError(f"scoring={scoring!r}: allowed: {', '.join(SCORING)}")
        check_batch_size(from_text(kwargs.get("batch_size", 1)), "batch_size", schedule=True)
        kwargs.setdefault("add_bos_token", False)  # the paper code's protocol (see the module docstring)
        if kwargs.get("device") in (None, "cuda") and not torch.cuda.is_available():
            kwargs["device"] = "cpu"
        super().__init__(pretrained=resolve_pretrained(pretrained), **kwargs)
        # the quantizer every cache of this model stores with, bound: checks the head size and rotary embeddings
        self.quant = quant.bind(self.model) if quant is not None else None
        self.policy, self.scoring = policy, scoring
        self._known: dict[tuple[int, ...], set[int]] = {}  # each request's model input -> its context tokens
        self.cont_tokens: dict[tuple[str, str], int] = {}  # (context, continuation) -> continuation tokens
        self._per_token = False
        self.stats = {"rows": 0, "tokens": 0, "unmatched_rows": 0, "clamped": 0}  # clamped: h2o.tasks.base.clamped
        self.sizings: list[Sizing] = []  # batch sizes chosen for batch_size=auto (h2o.tasks.batching)
        self.budgets: list[tuple[int, int]] = []  # per generated row: (prompt tokens, cache budget in tokens)
        self.footprints: list[tuple[dict, int]] = []  # per generate call: the cache at its end, the rows
        self.questions: dict[str, str] = {}  # generation context -> the question that ends it (question_of)
        self.question = question  # prompt | after: the question inside the compressed prompt or after it
        self._batch: list[str] = []  # the contexts of the batch being generated (tok_batch_encode's strings)
        self.truncate = "left"  # a prompt over max_length - max_gen_toks: lm-eval's left cut, or "middle" (LongBench)
        # per generated answer: tokens, length limit, KV held at its end and peak, time (h2o.tasks.generation_rows)
        self.track_rows = generation_log is not None
        self.generation_log = generation_log
        self.rows: list[dict] = []  # the rows of the current generate_until call, in generation order
        self.generations: list[dict] = []  # per answered request: task, doc id, repeat, the row's fields
        self.contexts: list[dict] = []  # questions / turns: per shared context, its requests and compressed cache
        self.open_logs()  # what a resumed run's record needs from before the interruption (h2o.tasks.resume_logs)

    # ------------------------------------------------------------------ log-likelihood (simulated)
    def loglikelihood(self, requests, disable_tqdm: bool = False):
        self._per_token = self.scoring == "mean"
        try:
            return super().loglikelihood(requests, disable_tqdm)
        finally:
            self._per_token = False

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
        # the exact model input of each request, as HFLM builds it (left-truncated, last token dropped), and how
        # many of its tokens are context (the left cut takes context first; at least one token of prompt)
        self._known = {}
        for _, ctx, cont in requests:
            inp = tuple((ctx + cont)[-(self.max_length + 1):][:-1])
            self._known.setdefault(inp, set()).add(max(len(inp) - (len(cont) - 1), 1))
        self.cont_tokens.update({key: len(cont) for key, _, cont in requests if key is not None})
        res = super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm, override_bs=override_bs)
        if self._per_token:
            res = [(ll / len(cont), greedy) for (ll, greedy), (_, _, cont) in zip(res, requests, strict=True)]
        return res

    def n_cont_tokens(self, context: str, continuation: str) -> int:
        """Tokens of a request's continuation as scored (recorded when scored; else encoded as lm-eval does, e.g.
        for a request answered from lm-eval's request cache on a resumed run)."""
        key = (context, continuation)
        if key not in self.cont_tokens:
            if context == "":  # lm-eval scores it after the prefix token (TemplateLM.loglikelihood)
                enc = self.tok_encode(continuation, add_special_tokens=False)
                self.cont_tokens[key] = len(enc) if self.prefix_token_id != enc[0] else len(enc) - 1
            else:
                self.cont_tokens[key] = len(self._encode_pair(context, continuation)[1])
        return self.cont_tokens[key]

    def _detect_batch_size(self, requests=None, pos: int = 0) -> int:
        """lm-eval's hook for ``batch_size=auto``: the batch for the requests from ``pos`` on (sorted longest
        first), probed with rows of the longest one's length; the probe's rows are not counted in ``stats``."""
        length = (len((requests[pos][1] + requests[pos][2])[-(self.max_length + 1):][:-1]) if requests
                  else self.max_length)

        def step(b: int) -> None:
            ids = torch.ones((b, length), dtype=torch.long, device=self.device)  # (b, L), as lm-eval probes
            F.log_softmax(self._model_call(ids), dim=-1, dtype=self.softmax_dtype)  # (b, L, V), as scored

        stats = dict(self.stats)
        self._probing = True
        try:
            sizing = choose("auto", self.model, step, len(requests) - pos if requests else self.max_batch_size,
                            self.max_batch_size)
        finally:
            self._probing = False
        self.stats = stats
        self.sizings.append(sizing)
        return sizing.size

    def true_lengths(self, inps: torch.Tensor, prompts: list | None = None) -> torch.Tensor:
        """(B, T) right-padded input ids -> (B,) true length of each row (see the module docstring); ``prompts``:
        a list to receive each row's context tokens (an unmatched row: all of it)."""
        lengths = []
        for row in inps.tolist():
            end = len(row)
            while end > 0 and row[end - 1] == 0:
                end -= 1
            match = next((n for n in range(end, len(row) + 1) if tuple(row[:n]) in self._known), None)
            if match is None:
                self.stats["unmatched_rows"] += 1
            lengths.append(len(row) if match is None else match)
            if prompts is not None:
                prompts.append(self.prompt_of(row[:match]) if match is not None else len(row))
        return torch.tensor(lengths, device=inps.device)

    def prompt_of(self, inp: list[int]) -> int:
        """The context tokens of the request whose model input is ``inp`` (compress=prefill compresses them)."""
        found = self._known[tuple(inp)]
        if len(found) > 1:
            raise PolicyError(f"compress=prefill: two requests give one model input of {len(inp)} tokens with "
                              f"contexts of {sorted(found)} tokens, so the prompt to compress is ambiguous; "
                              f"allowed: compress=decode for this task")
        return next(iter(found))

    @property
    def prefill(self) -> bool:
        """Whether log-likelihood requests compress their context once (``compress=prefill``, a budget < 100%)."""
        return engine.compresses_once(self.policy)

    def _model_call(self, inps: torch.Tensor, attn_mask=None, labels=None) -> torch.Tensor:
        """inps (B, T) -> logits (B, T, V) under the policy's simulated mask."""
        prompts: list[int] = []  # compress=prefill: each row's context tokens, the reference of its budget
        lengths = self.true_lengths(inps, prompts if self.prefill else None) if attn_mask is None \
            else attn_mask.sum(-1)
        self.stats["rows"] += inps.shape[0]
        self.stats["tokens"] += int(lengths.sum())
        short = [False] * inps.shape[0] if attn_mask is not None else \
            self.policy.short(torch.tensor(prompts or lengths.tolist(), dtype=torch.long)).tolist()
        self.log_rows(inps, lengths, short)
        if attn_mask is not None:
            return super()._model_call(inps, attn_mask, labels)
        self.stats["clamped"] += sum(short)  # h2o.tasks.base.clamped
        with torch.no_grad():
            if engine.whole_forward(self.policy):  # the paper code's rule: one unpadded sequence at a time
                out = None
                for b, n in enumerate(lengths.tolist()):
                    with attach(self.model, self.policy, prompt_len=prompts[b] if self.prefill else 0,
                                quant=self.quant):
                        logits = self.model(inps[b:b + 1, :n], use_cache=False).logits  # (1, n, V)
                    if out is None:
                        out = logits.new_zeros(inps.shape[0], inps.shape[1], logits.shape[-1])
                    out[b, :n] = logits[0]
                return out
            left, mask = to_left_padding(inps, lengths)  # (B, T) each
            if not self.prefill:
                with attach(self.model, self.policy, quant=self.quant):
                    logits = self.model(left, attention_mask=mask.long(), use_cache=False).logits  # (B, T, V)
                return from_left_padding(logits, lengths)
            after = lengths.cpu() - torch.tensor(prompts)  # (B,) continuation inputs: the prompt ends at T - after
            logits = None
            for c in sorted(set(after.tolist())):
                rows = (after == c).nonzero().flatten().to(inps.device)
                with attach(self.model, self.policy, prompt_len=inps.shape[1] - c, quant=self.quant):
                    part = self.model(left[rows], attention_mask=mask[rows].long(), use_cache=False).logits
                if logits is None:
                    logits = part.new_zeros(inps.shape[0], *part.shape[1:])  # (B, T, V)
                logits[rows] = part
            return from_left_padding(logits, lengths)

    # ---------------------------------------------------------------------- generation (real cache)
    def generate_until(self, requests, disable_tqdm: bool = False):
        if self.many:  # compress once, ask many: one context at a time (h2o.tasks.lm_eval_many)
            return self.generate_many(requests)
        for req in requests:  # the question that ends each context, where the task's doc or RULER names one
            question = question_of(req.args[0], getattr(req, "doc", None), getattr(req, "task_name", None))
            if question:
                self.questions[req.args[0]] = question
            elif self.question == "after":
                raise PolicyError(f"question=after: task {getattr(req, 'task_name', None)}'s request "
                                  f"{getattr(req, 'doc_id', None)} has no question to put after the compressed "
                                  f"context; allowed: niah and lm-eval's RULER tasks, or question=prompt")
        answers = super().generate_until(requests, disable_tqdm)
        if self.track_rows:
            done = pair(requests, answers, self.rows)
            self.rows = []
            self.keep_generations(done)
        return answers

    def tok_batch_encode(self, strings, padding_side="left", left_truncate_len=None, truncation=False):
        """HFLM's; with ``truncate="middle"`` a prompt longer than ``left_truncate_len`` keeps its first and last
        halves instead of its end (LongBench's rule: the question sits at both ends of its prompts)."""
        self._batch = list(strings)
        if self.truncate != "middle" or not left_truncate_len:
            return super().tok_batch_encode(strings, padding_side, left_truncate_len, truncation)
        ids, mask = super().tok_batch_encode(strings, padding_side)  # (B, T) each, left-padded, uncut
        half = left_truncate_len // 2
        rows = [row[m.bool()] for row, m in zip(ids, mask)]
        rows = [r if len(r) <= left_truncate_len else torch.cat([r[:half], r[len(r) - left_truncate_len + half:]])
                for r in rows]
        T = max(len(r) for r in rows)
        out = ids.new_full((len(rows), T), self.tokenizer.pad_token_id or 0)  # (B, T') left-padded again
        cut = mask.new_zeros((len(rows), T))
        for i, r in enumerate(rows):
            out[i, T - len(r):], cut[i, T - len(r):] = r, 1
        return out, cut

    def question_tokens(self, context: str, doc: dict | None = None, task: str | None = None) -> int:
        """Trailing tokens of ``context``'s encoding that are its request's question (0: none known). The question
        is encoded as the end of the prompt: tokens(context) - tokens(context less the question). ``doc`` and
        ``task``: found from them when this process did not generate the request (a resumed run's requests that
        lm-eval's cache answered)."""
        question = self.questions.get(context)
        if question is None and doc is not None:
            question = question_of(context, doc, task)
        if not question:
            return 0
        return len(self.tok_encode(context)) - len(self.tok_encode(context[:-len(question)]))

    def _model_generate(self, context, max_length, stop, **generation_kwargs):
        """context (B, T) left-padded (attention_mask in generation_kwargs) -> (B, T + new) token ids, through the
        evicting cache (every policy, full included)."""
        mask = generation_kwargs.get("attention_mask")
        prompt = (mask.sum(-1) if mask is not None else torch.full((context.shape[0],), context.shape[1])).tolist()
        with attach(self.model, self.policy, mode="real", quant=self.quant) as h:
            cache = h.new_cache()
            watch = self.watch(cache, generation_kwargs) if self.track_rows else None
            if self.question == "after":
                asked = [min(self.question_tokens(s), n - 1) for s, n in zip(self._batch, prompt)]
                out = self.generate_after(context, max_length, stop, cache, asked, generation_kwargs)
                prompt = [n - q for n, q in zip(prompt, asked)]  # the compressed prompt: the context alone
            else:
                out = super()._model_generate(context, max_length, stop, cache=cache, **generation_kwargs)
        held = prompt if engine.keeps_all(self.policy) else cache.figures()["budget"]  # full never evicts
        self.budgets.extend(zip(prompt, held))
        self.log_generated(prompt, held, cache.footprint(), context.shape[0])
        self.footprints.append((cache.footprint(), context.shape[0]))
        if watch is not None:
            self.note_rows(out, context.shape[1], prompt, watch, stop)
        return out

    def generate_after(self, context, max_length, stop, cache, asked: list[int], kwargs: dict) -> torch.Tensor:
        """``question=after``: context (B, T) left-padded, the last ``asked`` tokens of each row its question ->
        (B, T + new) as lm-eval expects. The contexts less their questions are prefilled into ``cache`` (its
        policy's cut at their end), then generate feeds the questions (one chunk) and the answer."""
        ids, mask, split = context_then_question(context, kwargs.pop("attention_mask"), asked)  # (B, C + Q)
        prefill(self.model, ids[:, :split], mask[:, :split], cache)
        # the cache holds the compressed context on purpose: attach's single-use guard is told so
        out = super()._model_generate(ids, max_length + ids.shape[1] - context.shape[1], stop, cache=cache,
                                      attention_mask=mask, continue_cache=True, **kwargs)  # (B, C + Q + new)
        return torch.cat([context, out[:, ids.shape[1]:]], 1)
