"""lm-eval's own command line with the ``h2o`` model registered.

    python -m h2o.tasks.lm_eval_cli --model h2o --model_args pretrained=smollm2-135m,policy=h2o,budget=0.2 \
        --tasks bb_copa --include_path tasks --limit 20 --batch_size 4

lm-eval 0.4.13 fills its model registry only by importing modules (no entry-point group is read), so
``lm_eval --model h2o`` cannot find an out-of-tree model; this wrapper imports :mod:`h2o.tasks.lm_eval_model`
(which registers ``h2o``) and hands every argument to lm-eval's CLI unchanged. For ``--model h2o`` the model
arguments (pretrained, policy and its options, semantics, scoring, quant and its ``quant_*`` options, checked
against the head size and rotary embeddings in the model's config), ``--batch_size``, ``--include_path`` and
``--output_path`` are checked first (h2o.core.validate): a bad one is one line and exit status 2, before any
model loads.
"""
from __future__ import annotations

import sys

def validate(args) -> None:
    """BadInput (one line) for a bad h2o model argument or path of a parsed lm-eval command line."""
    from pathlib import Path

    from h2o.assets.model_spec import check_pretrained
    from h2o.core.validate import check, output_dir
    from h2o.assets.model_spec import ModelSpec
    from h2o.tasks.batching import check_batch_size, from_text
    from h2o.tasks.lm_eval_model import QUANT_PREFIX, SCORING, lm_policy, make_lm_quant

    if getattr(args, "include_path", None):
        check(Path(args.include_path).is_dir(), f"--include_path={args.include_path!r}: no such folder")
    if getattr(args, "output_path", None):
        output_dir("--output_path", Path(args.output_path).parent)
    if getattr(args, "model", None) != "h2o":
        return
    options = dict(args.model_args or {}) if isinstance(args.model_args or {}, dict) else {}
    check_pretrained(options.get("pretrained", "smollm2-135m"), "--model_args pretrained")
    lm_policy(options.get("policy", "full"), dict(options), options.get("semantics", "simulated"))
    check(options.get("scoring", "sum") in SCORING,
          f"--model_args scoring={options.get('scoring')!r}: allowed: {', '.join(SCORING)}")
    check_batch_size(from_text(getattr(args, "batch_size", 1)), "--batch_size", schedule=True)
    pretrained = options.get("pretrained", "smollm2-135m")
    quant = make_lm_quant(options.get("quant", "none"), {k: v for k, v in options.items()
                                                         if k.startswith(QUANT_PREFIX)}, pretrained)
    if quant is not None:
        quant.check_geometry(*ModelSpec(str(pretrained), str(pretrained)).geometry())


def main() -> int:
    import h2o.tasks.lm_eval_model  # noqa: F401  (registers --model h2o)
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    from h2o.core.validate import BadInput, fail

    setup_logging()
    parser = HarnessCLI()  # lm_eval.__main__.cli_evaluate, with the check between parsing and running
    args = parser.parse_args()
    try:
        validate(args)
    except BadInput as exc:
        return fail(exc)
    parser.execute(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
