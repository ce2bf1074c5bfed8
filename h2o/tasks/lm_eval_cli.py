"""lm-eval's own command line with the ``h2o`` model registered.

    python -m h2o.tasks.lm_eval_cli --model h2o --model_args pretrained=smollm2-135m,policy=h2o,budget=0.2 \
        --tasks bb_copa --include_path tasks --limit 20 --batch_size 4

lm-eval 0.4.13 fills its model registry only by importing modules (no entry-point group is read), so
``lm_eval --model h2o`` cannot find an out-of-tree model; this wrapper imports :mod:`h2o.tasks.lm_eval_model`
(which registers ``h2o``) and hands every argument to lm-eval's CLI unchanged.
"""
from __future__ import annotations


def main() -> None:
    import h2o.tasks.lm_eval_model  # noqa: F401  (registers --model h2o)
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
