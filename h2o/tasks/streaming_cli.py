"""``python -m h2o.tasks.streaming_cli``: explore streaming from the command line; prints, writes no run record.

Run records come from the experiment only: ``make stream`` = ``h2o-run -m experiment=streaming`` (one run per
policy x budget x chunk, under runs/streaming/). Here: each budget x policy streams the text: ``--policies`` names,
or ``--policy`` (repeated) with options spelled as lm-eval's model_args and Hydra's keys (``--policy
h2o,heavy_share=0.5,score=decay`` <-> ``policy=h2o policy.heavy_share=0.5 policy.score=decay``; also
``h2o:heavy_share=1/2:score=decay``, with a notice); ``--compare-chunk 32`` repeats each run in chunks
and prints the difference; ``--batch`` streams the policies of one budget as one batch (the weights read once per
step: what the long-stream study used); ``--interleave`` advances all runs a window at a time in turns; ``--live``
appends each window's sample to a file as it ends (``python -m analysis.streaming_study`` reads them); ``--json``
appends each run's row (with its samples) as JSON lines.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from h2o.assets.model_spec import check_pretrained
from h2o.tasks.streaming import CHUNK, POSITIONS, WINDOW, Streamer, drive, load_text, text_ids
from h2o.tasks.streaming_parts import HEAVY_SHARE, build_policy, hms, parse_policy, spec_value
from h2o.core.policies import REAL_POLICIES
from h2o.cli.args import ArgParser, choice, guard, positive_int, split_list
from h2o.cli.paths import output_dir, output_file
from h2o.core.validate import ConfigError, check, is_number


def run(model, tokenizer, text: str = "austen", tokens: int = 20000, policies=("h2o", "streaming_llm", "local"),
        budgets=(96, 192, 384), chunk: int = CHUNK, positions: str = "cache", window: int = WINDOW,
        progress: bool = False, heavy_share: float = HEAVY_SHARE, compare_chunk: int = 0, batch: bool = False,
        interleave: bool = False, model_name: str = "", out=None, on_record=None,
        on_sample=None) -> list[tuple[dict, list[dict]]]:
    """Stream the text for each budget x policy spec (:func:`parse_policy`); with ``compare_chunk`` each run is
    repeated with that chunk size and its difference printed. Returns [(row, samples)], a row = the run's
    settings and metrics; ``on_record(row, samples)`` is called as each run finishes (``--json``: a long study
    loses no finished run),
    ``on_sample(label, sample)`` as each window ends. ``batch``: the policies of one budget stream together as
    one batch (:class:`Streamer`). ``interleave``: all streamers advance one window at a time in turns (a study
    cut short still has every curve up to the same length)."""
    ids = text_ids(tokenizer, load_text(text), tokens)
    chunks = [chunk] + ([compare_chunk] if compare_chunk and compare_chunk != chunk else [])
    groups = [(budget, c, group) for budget in budgets for c in chunks
              for group in ([list(policies)] if batch else [[spec] for spec in policies])]
    results = []

    def finish(spec, budget, c, metrics, samples):
        pol = build_policy(spec, budget, heavy_share)
        rec = {"task_kind": "streaming", "task": text, "semantics": "real", "policy": pol.name,
               "label": spec if isinstance(spec, str) else pol.name, "budget": budget, "heavy": pol.heavy,
               "recent": pol.recent, "options": parse_policy(spec)[1] if isinstance(spec, str) else {},
               "chunk": c, "positions": positions, "window": window, "model": model_name,
               "n_samples": metrics["tokens"], "wall_s": metrics["wall_s"], "threads": torch.get_num_threads(),
               "metrics": metrics}
        results.append((rec, samples))
        print_row(rec, out)
        if on_record:
            on_record(rec, samples)
        base = [r for r, _ in results if r["label"] == rec["label"] and r["budget"] == budget and r["chunk"] == chunk]
        if c != chunk and base:
            print_comparison(base[0], rec, out=out)

    def streamer(budget, c, specs):
        live = None if on_sample is None else (lambda b, smp: on_sample(job_label(specs[b], budget, c), smp))
        return Streamer(model, ids, specs, budget, c, positions, window, heavy_share, live)

    def done(st, budget, c, specs):
        for b, spec in enumerate(specs):
            finish(spec, budget, c, st.metrics(b), st.wins[b].samples)

    if not interleave:
        for i, (budget, c, specs) in enumerate(groups):
            st = streamer(budget, c, specs)
            drive(st, progress, runs_left=len(groups) - i)
            done(st, budget, c, specs)
        return results
    streams = [streamer(*g) for g in groups]
    with tqdm(total=len(streams) * streams[0].n_pred, unit="tok", desc="all runs", mininterval=5,
              disable=not progress, file=sys.stderr) as bar:
        while not all(st.done for st in streams):
            for st in streams:
                before = st.s
                st.advance(st.s + window)
                bar.update(st.s - before)
    for st, g in zip(streams, groups):
        done(st, *g)
    return results


def job_label(spec, budget, chunk) -> str:
    """A file-name-safe label of one run: ``h2o_heavy_share1-2_96_c1``."""
    label = spec if isinstance(spec, str) else spec.name
    return f"{label.replace(':', '_').replace(',', '_').replace('=', '').replace('/', '-')}_{budget}_c{chunk}"


def print_row(rec: dict, out=None) -> None:
    m = rec["metrics"]

    def g(x, f, scale=1.0):
        return "-" if x is None else format(x * scale, f)

    print(f"{rec.get('label', rec['policy']):>14} budget {rec['budget']:>5} chunk {rec['chunk']:>3} "
          f"positions {rec['positions']:>5}: "
          f"ppl {m['ppl']:8.3f}  past-context ppl {g(m['ppl_past_context'], '8.3f')}  tokens {m['tokens']}  "
          f"held <= {m['cache_tokens_max']}  max pos {m['max_position_id']}  {m['tok_s']:.1f} tok/s  "
          f"wall {hms(m['wall_s'])}  time/token {g(m['time_per_token_s_start'], '.2f', 1e3)} -> "
          f"{g(m['time_per_token_s_end'], '.2f', 1e3)} ms ({g(m['time_per_token_growth'], '+.1f', 100)}%), CPU/token "
          f"{g(m.get('cpu_per_token_growth'), '+.1f', 100)}%  RSS growth after warm-up "
          f"{g(m['rss_growth'], '+.2f', 100)}% (max {g(m.get('rss_growth_max'), '+.2f', 100)}%)",
          file=out or sys.stdout, flush=True)


def print_comparison(base: dict, other: dict, out=None) -> None:
    """The chunked option's effect beside the token-by-token run: perplexity change and speed-up."""
    a, b = base["metrics"], other["metrics"]
    print(f"{base['label']:>14} budget {base['budget']:>5} chunk {other['chunk']} vs {base['chunk']}: "
          f"ppl {b['ppl']:.3f} vs {a['ppl']:.3f} ({100 * (b['ppl'] / a['ppl'] - 1):+.2f}%), "
          f"{b['tok_s'] / a['tok_s']:.1f}x the speed", file=out or sys.stdout, flush=True)


TEXTS = ("austen", "moby", "moby_dick", "pg19")
POLICY_NAMES = "h2o,streaming_llm,local"


def validate(args) -> tuple[list[str], list[int]]:
    """Every value checked before the model or the text loads (h2o.cli); returns (specs, budgets)."""
    check_pretrained(args.model, "--model")
    check(args.text in TEXTS or Path(args.text).is_file(), f"--text={args.text!r}: allowed: "
                                                           f"{', '.join(TEXTS)} or an existing text file")
    check(not (args.policy and args.policies), f"--policy {args.policy[0] if args.policy else ''} and --policies "
                                               f"{args.policies}: give one of them")
    flag = "--policy" if args.policy else "--policies"
    specs = args.policy or split_list("--policies", args.policies or POLICY_NAMES, str, "a policy name")
    try:
        names = [parse_policy(spec)[0] for spec in specs]
    except ValueError as err:
        raise ConfigError(f"{flag}={args.policy or args.policies!r}: {err}") from None
    choice(flag, names, REAL_POLICIES)
    budgets = split_list("--budgets", args.budgets, positive_int, "a cache size in tokens (an int >= 1)")
    check(is_number(args.heavy_share), f"--heavy-share={args.heavy_share!r}: expected a number in [0, 1] (1/3 ok)")
    for spec in specs:
        for b in budgets:
            build_policy(spec, b, args.heavy_share)  # PolicyError, e.g. streaming_llm: a budget below sinks + 1
    for flag, low in (("tokens", 1), ("chunk", 1), ("window", 1), ("compare_chunk", 0), ("threads", 0)):
        check(getattr(args, flag) >= low, f"--{flag.replace('_', '-')}={getattr(args, flag)}: must be >= {low}")
    if args.json:
        output_file("--json", args.json)
    if args.live:
        output_dir("--live", args.live)
    check(args.runs is None, f"--runs={args.runs!r}: this command writes no run record; records come from "
                             f"the experiment: make stream, or h2o-run -m experiment=streaming")
    return specs, budgets


@guard
def main(argv: list[str] | None = None) -> int:
    p = ArgParser(prog="python -m h2o.tasks.streaming_cli", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--text", default="austen", help="austen, moby, pg19 or a text file")
    p.add_argument("--tokens", type=int, default=20000, help="tokens to stream (up to 1M and more)")
    p.add_argument("--policies", default=None, help=f"policy names, comma-separated (default {POLICY_NAMES})")
    p.add_argument("--policy", action="append", default=None,
                   help="a policy with options (repeat for more): name,key=value,..., e.g. h2o,heavy_share=0.5")
    p.add_argument("--budgets", default="96,192,384", help="cache sizes in tokens, comma-separated")
    p.add_argument("--heavy-share", type=spec_value, default=HEAVY_SHARE,
                   help="heavy hitters' share of the cache unless a spec sets it (default 1/3: 32 + 64 at 96)")
    p.add_argument("--chunk", type=int, default=CHUNK, help="tokens per forward (1: token by token, the default)")
    p.add_argument("--compare-chunk", type=int, default=0,
                   help="also run each policy with this chunk size and print the difference (0: no)")
    p.add_argument("--positions", choices=POSITIONS, default="cache")
    p.add_argument("--window", type=int, default=WINDOW, help="one sample (window perplexity) per this many tokens")
    p.add_argument("--progress", action="store_true", help="a progress bar and a wall-time estimate")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--json", default=None, help="append records (with their samples) here as each run ends")
    p.add_argument("--runs", default=None, help=argparse.SUPPRESS)  # refused: records come from the experiment
    p.add_argument("--live", default=None, help="append each window's sample to LIVE/<run>.jsonl as it ends")
    p.add_argument("--batch", action="store_true",
                   help="stream the policies of one budget together as one batch (weights read once per step)")
    p.add_argument("--interleave", action="store_true",
                   help="advance all runs one window at a time in turns (a study cut short keeps every curve)")
    args = p.parse_args(argv)
    specs, budgets = validate(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    from h2o.assets import models
    from h2o.assets.model_spec import resolve_tiny
    model, tok = models.load_model(resolve_tiny(args.model))

    def save(rec, samples):
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)  # checked creatable before the work
        with open(args.json, "a") as f:
            from h2o.store.strict_json import dumps as strict_dumps  # inf, nan: null
            f.write(strict_dumps({**rec, "samples": samples}) + "\n")

    def live(label, sample):
        with open(Path(args.live) / f"{label}.jsonl", "a") as f:
            from h2o.store.strict_json import dumps as strict_dumps  # inf, nan: null
            f.write(strict_dumps(sample) + "\n")

    if args.live:
        Path(args.live).mkdir(parents=True, exist_ok=True)
    run(model, tok, args.text, args.tokens, specs, budgets, args.chunk, args.positions, args.window,
        args.progress, args.heavy_share, args.compare_chunk, args.batch, args.interleave, model_name=args.model,
        on_record=save if args.json else None, on_sample=live if args.live else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
