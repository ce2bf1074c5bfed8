"""lm-eval's own command line with the ``h2o`` model registered.

    python -m h2o.tasks.lm_eval_cli --model h2o --model_args pretrained=smollm2-135m,policy=h2o,budget=0.2 \
        --tasks bb_copa --include_path tasks --limit 20 --batch_size 4

lm-eval 0.4.13 fills its model registry only by importing modules (no entry-point group is read), so
``lm_eval --model h2o`` cannot find an out-of-tree model; this wrapper imports :mod:`h2o.tasks.lm_eval_model`
(which registers ``h2o``) and hands every argument to lm-eval's CLI unchanged. For ``--model h2o`` the model
arguments (pretrained, policy and its options, semantics, scoring, question, questions, turns, quant and its
``quant_*`` options, checked against the head size and rotary embeddings in the model's config), ``--batch_size``,
``--include_path`` and ``--output_path`` are checked first (h2o.cli): a bad one is one line and exit status 2,
before any model loads. A RULER task (``--tasks niah_single_2``, ``ruler``, ...) gets its essay haystack from the
project's books through h2o.tasks.ruler_offline (``H2O_RULER_HAYSTACK=austen | moby_dick | essays``, default austen).
"""
from __future__ import annotations

import sys

from h2o.cli.process import kept
from h2o.core.validate import ConfigError

OWN_KEYS = ("pretrained", "policy", "semantics", "scoring", "quant", "question",  # H2OLM's own model_args
            "generation_log", "questions", "turns")


def check_keys(options: dict, policy, tasks=None) -> None:
    """ConfigError (one line) for a ``--model_args`` key that is neither H2OLM's own (:data:`OWN_KEYS`, the
    ``quant_*`` options), an option of a policy (another policy's is refused by lm_policy, naming it), nor an
    argument of lm-eval's HFLM (the rest would reach transformers' from_pretrained and fail there); and for a bad
    ``question``, ``questions`` or ``turns`` (above 1: on each of ``--tasks``, h2o-run's rule). The allowed list
    names all three."""
    import inspect

    from h2o.assets.policy_config import option_keys
    from h2o.core.policies import POLICIES
    from h2o.core.validate import check
    from h2o.tasks.question_after import check_many, check_many_task
    from h2o.tasks.lm_eval_model import QUANT_PREFIX, HFLM
    from h2o.tasks.question_after import QUESTIONS

    question = options.get("question", "prompt")
    check(question in QUESTIONS, f"--model_args question={question!r}: allowed: {', '.join(QUESTIONS)}")
    many = check_many(options.get("questions", 1), options.get("turns", 1))
    for task in task_names(tasks) if many else ():
        check_many_task(*many, task)
    hflm = [k for k, p in inspect.signature(HFLM.__init__).parameters.items()
            if k != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    policy_keys = {k for name in POLICIES for k in option_keys(name)}
    for key, value in options.items():
        if key in OWN_KEYS or key.startswith(QUANT_PREFIX) or key in policy_keys or key in hflm:
            continue
        own = [k for k in option_keys(policy.name) if k != "name"]
        raise ConfigError(f"--model_args {key}={value}: no such option of --model h2o (policy={policy.name}); "
                          f"allowed: {', '.join(OWN_KEYS)}, quant_<option>, policy={policy.name}'s options "
                          f"({', '.join(own) or 'none'}), lm-eval's HFLM arguments ({', '.join(hflm)})")


def validate(args) -> None:
    """BadInput (one line) for a bad h2o model argument or path of a parsed lm-eval command line."""
    from pathlib import Path

    from h2o.assets.model_spec import check_pretrained
    from h2o.cli.paths import abbrev, output_dir, path_error
    from h2o.core.validate import check
    from h2o.assets.model_spec import ModelSpec
    from h2o.tasks.base import check_room
    from h2o.tasks.batching import check_batch_size, from_text
    from h2o.tasks.lm_eval_model import QUANT_PREFIX, SCORING, lm_policy, make_lm_quant

    if getattr(args, "include_path", None):
        why = path_error(args.include_path)
        check(why is None and Path(args.include_path).is_dir(),
              f"--include_path={abbrev(args.include_path)}: {why or 'no such folder'}; expected a folder of task YAMLs")
    if getattr(args, "output_path", None):
        output_dir("--output_path", Path(args.output_path).parent)
    check_sampling(getattr(args, "gen_kwargs", None))
    check_metadata(getattr(args, "metadata", None), getattr(args, "tasks", None))
    if getattr(args, "model", None) != "h2o":
        return
    options = dict(args.model_args or {}) if isinstance(args.model_args or {}, dict) else {}
    thinking = options.get("enable_thinking")
    check(thinking in (None, True, False),
          f"--model_args enable_thinking={thinking!r}: allowed: true, false (absent: the chat template's default)")
    check(thinking is not True or options.get("think_end_token"),
          "--model_args enable_thinking=true without think_end_token: lm-eval scores the text after the end of the "
          "thinking; allowed: think_end_token=<its text> (e.g. </think>)")
    check_pretrained(options.get("pretrained", "smollm2-135m"), "--model_args pretrained")
    policy = lm_policy(options.get("policy", "full"), dict(options), options.get("semantics", "simulated"))
    check_keys(options, policy, getattr(args, "tasks", None))
    pretrained = str(options.get("pretrained", "smollm2-135m"))
    spec = ModelSpec(pretrained, pretrained)
    longest = spec.max_positions()
    gen = (args.gen_kwargs if isinstance(getattr(args, "gen_kwargs", None), dict) else {}).get("max_gen_toks")
    if gen is not None:  # an int >= 1 (check_sampling)
        check_room("--gen_kwargs max_gen_toks", gen, longest, pretrained)
    if longest:
        policy.check_reach(longest, "the model's longest context")
        policy.check_run_counts(longest, "the model's longest context")
    if getattr(policy, "reads_queries", False):  # expected_attention: a rotary model, read from its config
        policy.check_rotary(spec.geometry()[1], pretrained)
    check(options.get("scoring", "sum") in SCORING,
          f"--model_args scoring={options.get('scoring')!r}: allowed: {', '.join(SCORING)}")
    check_batch_size(from_text(getattr(args, "batch_size", 1)), "--batch_size", schedule=True)
    if options.get("generation_log"):
        output_dir("--model_args generation_log", Path(str(options["generation_log"])).parent)
    quant = make_lm_quant(options.get("quant", "none"), {k: v for k, v in options.items()
                                                         if k.startswith(QUANT_PREFIX)}, pretrained)
    if quant is not None:
        quant.check_geometry(*ModelSpec(str(pretrained), str(pretrained)).geometry())


def check_metadata(metadata, tasks) -> None:
    """``--metadata samples`` on niah or RULER's split tasks: h2o-run's bound (h2o.tasks.long_context.check_drawn)."""
    from h2o.tasks.long_context import check_drawn
    from h2o.tasks.ruler_offline import SPLIT_SOURCES as SOURCES

    if isinstance(metadata, dict) and "samples" in metadata and {"niah", *SOURCES} & set(task_names(tasks)):
        check_drawn("--metadata samples", metadata["samples"])


def check_sampling(gen_kwargs) -> None:
    """BadInput for a bad ``--gen_kwargs`` sampling value: the reasoning tasks' rule (h2o.tasks.reasoning)."""
    from h2o.tasks.reasoning import check_sampling as check_values

    check_values("--gen_kwargs ", gen_kwargs if isinstance(gen_kwargs, dict) else {})


@kept()  # lm-eval's logging set-up and its handlers stay inside the command (tests call it in process)
def main() -> int:
    import h2o.tasks.lm_eval_model  # noqa: F401  (registers --model h2o)
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    from h2o.cli.args import fail
    from h2o.core.validate import BadInput

    setup_logging()
    parser = HarnessCLI()  # lm_eval.__main__.cli_evaluate, with the check between parsing and running
    args = parser.parse_args()
    try:
        validate(args)
        if uses_ruler(getattr(args, "tasks", None)):  # RULER's essay haystack: a book, offline ($H2O_RULER_HAYSTACK)
            from h2o.tasks.ruler_offline import from_env

            from_env()
            check_qa_data(getattr(args, "tasks", None))
    except BadInput as exc:
        return fail(exc)
    parser.execute(args)
    return 0


def check_qa_data(tasks) -> None:
    """ConfigError when ``--tasks`` names RULER's qa tasks (or the ``ruler`` group) and their JSON file is not in
    the cache (lm-eval would download it mid-run, after the model loaded, and fail offline): ``make prefetch``."""
    from h2o.tasks.long_context_data import qa
    from h2o.tasks.ruler_offline import QA_TASKS

    names = set(task_names(tasks))
    for task in sorted(QA_TASKS):
        asset = qa(task)
        if (task in names or "ruler" in names) and not asset.cached():
            raise ConfigError(f"--tasks {task}: its data are not on this machine ({asset.what}); allowed: fetch "
                              f"them first with `python -m h2o.pipeline.prefetch task={task}` (make prefetch), on a "
                              f"machine with internet")


def task_names(tasks) -> list[str]:
    """lm-eval's ``--tasks`` (a comma-separated text or a list) as names."""
    names = tasks.split(",") if isinstance(tasks, str) else list(tasks or [])
    return [str(n).strip() for n in names if str(n).strip()]


def uses_ruler(tasks) -> bool:
    """Whether lm-eval's ``--tasks`` name a RULER task or group."""
    from h2o.tasks.long_context import ruler_folder
    from h2o.tasks.multiple_choice import yaml_task_names

    return bool(set(task_names(tasks)) & {*yaml_task_names(ruler_folder()), "ruler"})


if __name__ == "__main__":
    sys.exit(main())
