"""Compress once, ask many through lm-eval's ``--model h2o``: ``--model_args questions=K`` or ``turns=K``.

    python -m h2o.tasks.lm_eval_cli --model h2o --tasks niah --include_path tasks \\
        --model_args pretrained=smollm2-135m,policy=snapkv,budget=0.2,questions=3

lm-eval hands the model one generation request per (context, question) and merges ``--model_args`` into the tasks'
metadata, so ``questions=K`` reaches the ``niah`` task too: its data set then holds contexts of K needles, one doc
per question (h2o.tasks.niah_many.dataset). On the model's side the requests are grouped by what they share:
the request's text less its question (the doc's ``question`` field, or RULER's question pattern:
h2o.tasks.question_after.question_of), per task. A group is one context:

* ``questions=K``: the context alone is prefilled into the policy's evicting cache (its cut at the context's end
  under either timing: kvpress's query-agnostic protocol, ``question=after``), once; each question is then fed
  into its own copy of that compressed cache (h2o.tasks.many_questions.copy_of), followed by its greedy answer. No
  question sees another's tokens; under ``full`` each answer is the one the whole context and that question give.
* ``turns=K``: one cache for the group, its questions asked in turn (the doc's ``question_index``, else lm-eval's
  doc order); each turn feeds its question after everything the cache holds (the earlier questions and answers)
  and generates its answer into it (SCBench's multi-turn protocol; h2o.tasks.many_questions.ask). lm-eval's record
  of a turn shows its doc's text (the context and that question); the model saw the earlier turns too.

A group holds at most K requests (fewer where ``--limit`` cut it); more is refused in one line. Tokens: the context
encoded once as lm-eval encodes a request (its BOS rule), each question apart without special tokens (kvpress's
encoding; equal to encoding them together wherever the question starts after a newline: niah and RULER), the context
cut from the left (as lm-eval cuts a prompt) to leave room for its longest question and ``max_gen_toks``. Greedy only
(a sampling request is refused), stopped as lm-eval's generation stops (its ``until`` texts and the end-of-text
token), the answer cut at them as lm-eval cuts it. One context at a time, whatever ``batch_size``. ``budgets`` gets
each question's (context tokens, tokens the compressed context holds per layer and head: the mean), ``footprints``
each context's compressed cache once, and ``contexts`` one row per group (its task, doc ids, context tokens,
footprint). The resume logs (h2o.tasks.resume_logs.ResumeLogs.log_context) keep each group's figures before lm-eval
caches its answers, so a resumed run (RULER's split tasks through h2o-run) records what an uninterrupted one does.
With ``generation_log`` (or ``track_rows``) each answer's row is kept as for ungrouped requests
(:meth:`AskMany.note_answers`). (The pipeline's niah ``task.questions`` / ``task.turns`` run through
h2o.tasks.many_questions, not lm-eval: a run stopped there starts again.)
"""
from __future__ import annotations


def groups(requests, asked: list[str | None]) -> list[tuple[str, list[int]]]:
    """Requests and the question that ends each one's text (None: refused) -> [(the shared context's text, the
    indices of its requests in asking order)], in first-seen order."""
    from h2o.core.policies import PolicyError

    found: dict[tuple, list[int]] = {}
    for i, (req, question) in enumerate(zip(requests, asked)):
        if not question:
            raise PolicyError(f"questions/turns: task {getattr(req, 'task_name', None)}'s request "
                              f"{getattr(req, 'doc_id', None)} has no question to ask after a shared context; "
                              f"allowed: niah and lm-eval's RULER tasks, or questions=1,turns=1")
        text = req.args[0]
        found.setdefault((getattr(req, "task_name", None), text[:len(text) - len(question)]), []).append(i)

    def order(i: int):
        doc = getattr(requests[i], "doc", None)
        index = doc.get("question_index") if isinstance(doc, dict) else None
        doc_id = getattr(requests[i], "doc_id", None)
        return (-1 if index is None else index, i if doc_id is None else doc_id, i)

    return [(context, sorted(members, key=order)) for (_, context), members in found.items()]


class AskMany:
    """The grouped generation of :class:`h2o.tasks.lm_eval_model.H2OLM` (``self.many``: (mode, K) or None)."""

    many: tuple[str, int] | None = None

    def generate_many(self, requests) -> list[str]:
        """lm-eval's ``generate_until`` for ``questions`` / ``turns`` above 1: every request's answer, in order."""
        import torch
        from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

        from h2o.core.policies import PolicyError
        from h2o.tasks.many_questions import ask, kv_entries_per_token
        from h2o.tasks.question_after import question_of

        mode, k = self.many
        asked = [question_of(r.args[0], getattr(r, "doc", None), getattr(r, "task_name", None)) for r in requests]
        answers: list[str | None] = [None] * len(requests)
        eos = self.tok_decode(self.eot_token_id, skip_special_tokens=False)
        think = self.think_end_token if isinstance(self.think_end_token, str) else None
        for context, members in groups(requests, asked):
            first = requests[members[0]]
            if len(members) > k:
                raise PolicyError(f"{mode}={k}: task {getattr(first, 'task_name', None)} asks one context "
                                  f"{len(members)} questions (docs {[requests[i].doc_id for i in members]}); "
                                  f"allowed: {mode}={len(members)} or more, as the task's data")
            kwargs = normalize_gen_kwargs(first.args[1], self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_new = kwargs.pop("max_gen_toks")
            if kwargs.get("do_sample"):
                raise PolicyError(f"{mode}={k}: --gen_kwargs do_sample=true: the shared context answers greedily; "
                                  f"allowed: do_sample=false")
            questions = [self.tok_encode(asked[i], add_special_tokens=False) for i in members]
            ctx = self.tok_encode(context, left_truncate_len=self.max_length - max_new - max(map(len, questions)))

            def done(out: list[int]) -> bool:
                return out[-1] == self.eot_token_id or any(s and s in self.tok_decode(out) for s in until)

            steps: list | None = [] if self.track_rows else None
            with torch.no_grad():
                outs, compressed, _ = ask(self.model, self.policy, ctx, questions, max_new, done, mode == "turns",
                                          self.quant, steps=steps)
            held = round(compressed["tokens_held"] / kv_entries_per_token(self.model), 1)
            self.log_context([requests[i].args[0] for i in members], len(ctx), held, compressed)
            for i, out in zip(members, outs):
                text = postprocess_generated_text(self.tok_decode(out), until, think)
                answers[i] = text
                self.budgets.append((len(ctx), held))
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
            if steps is not None:
                self.note_answers([requests[i] for i in members], len(ctx), questions, outs, steps, done)
            self.footprints.append((compressed, 1))
            self.contexts.append({"task": getattr(first, "task_name", None), "mode": mode,
                                  "doc_ids": [requests[i].doc_id for i in members], "context_tokens": len(ctx),
                                  "question_tokens": [len(q) for q in questions], "footprint": compressed})
        return answers

    def note_answers(self, members, context: int, questions: list[list[int]], outs: list[list[int]],
                     steps: list, done) -> None:
        """Each answer's row (h2o.tasks.generation_rows.FIELDS, keyed by task, doc id and repeat 0) into
        ``generations`` and the ``generation_log`` file: prompt tokens (the context and its question), tokens
        generated (up to the stop, counted), whether it stopped at the length limit, the entries held at its last
        step and at their most, their bytes (None with a KV quantizer), and the seconds from its question's feed to
        its last step; ``steps``: each answer's StepWatch (h2o.tasks.many_questions.ask)."""
        from h2o.tasks.generation_rows import fields
        from h2o.tasks.kv_held import entry_bytes

        size = entry_bytes(self.model, self.quant)
        rows = [{"task": getattr(req, "task_name", None), "doc_id": getattr(req, "doc_id", None), "repeat": 0,
                 **fields(context + len(q), len(out), not done(out), [h[0] for h in watch.held], watch.times[-1],
                          size)}
                for req, q, out, watch in zip(members, questions, outs, steps)]
        self.keep_generations(rows)
