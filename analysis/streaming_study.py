"""The long-stream study (docs/streaming.md; its page: docs/results/streaming_study.md): perplexity per 1k-token window against tokens streamed.

``python -m analysis.streaming_study runs/streaming --out analysis/out/streaming`` reads, from every folder under
the root, the run records of the streaming experiment (``make stream``: ``metrics.json`` with ``task_kind``
streaming and its ``samples.jsonl``, one sample per window) and the window samples written live by
``python -m h2o.tasks.streaming_cli --live DIR`` (``DIR/<label>_<budget>_c<chunk>.jsonl``; the committed study), each
sample with ``tokens``, ``chunk_ppl`` = the window's perplexity, ``ppl`` = everything so far. It writes ``study.png``
(one panel per feeding x budget, each policy relative to StreamingLLM) and ``study.md`` (the table; past 10 windows
also the mean relative window perplexity per block of 10 windows; then each policy's chunked run beside its
token-by-token one: perplexity change and speed-up). A record is labelled by its policy plus every setting (model,
text, tokens, policy option, ...) whose value differs between the records of that policy found.
Curves are compared over the windows every run of a panel has finished (a study cut short stays fair); every window is shown up to 12 of them.
"""
from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from analysis.labels import METHODS, color, label as method_label, marker  # noqa: E402
from analysis.plotting import png  # noqa: E402
from analysis.records import checked_samples, finite, read_jsonl, read_records, warn  # noqa: E402

NAME = re.compile(r"(?P<label>.+)_(?P<budget>\d+)_c(?P<chunk>\d+)$")
BASELINE = "streaming_llm"


def load(root: Path) -> dict[tuple[int, int], dict[str, list[dict]]]:
    """{(chunk, budget): {label: samples}} from the streaming records and the live sample files under ``root``."""
    out: dict[tuple[int, int], dict[str, list[dict]]] = {}
    for f in sorted(root.rglob("*.jsonl")):
        m = NAME.match(f.stem)
        samples = read_jsonl(f) if m else None
        if samples:
            out.setdefault((int(m["chunk"]), int(m["budget"])), {})[m["label"]] = samples
    for chunk, budget, label, samples in records(root):
        out.setdefault((chunk, budget), {})[label] = samples
    return out


WINDOW_FIELDS = ("tokens", "nll", "chunk_ppl")  # what the tables and figure read from a window sample
SETTINGS_SKIP = {"_target_", "name", "budget", "heavy", "recent", "chunk", "shots", "scoring", "add_bos_token"}


def records(root: Path) -> list[tuple[int, int, str, list[dict]]]:
    """(chunk, budget, label, samples) of every finished streaming run record under ``root``."""
    found = []
    for f, rec in read_records(root):  # a torn record: skipped (warned), the others shown
        samples_file = f.parent / "samples.jsonl"
        if not isinstance(rec, dict) or rec.get("task_kind") != "streaming" or not samples_file.exists():
            continue
        if not finite(rec.get("budget")) or not isinstance(rec.get("policy"), str):
            warn(f"skipping run record {f}: budget={rec.get('budget')!r}, policy={rec.get('policy')!r}: expected a "
                 f"token count and a method's name")
            continue
        samples = checked_samples(f.parent, WINDOW_FIELDS, WINDOW_FIELDS)
        if samples is None:  # warned
            continue
        proto = rec.get("protocol") if isinstance(rec.get("protocol"), dict) else {}
        settings = {"model": rec.get("model"), "text": proto.get("text", rec.get("task")),
                    **{k: v for k, v in {**proto, **(rec.get("policy_options") or {})}.items()
                       if k not in SETTINGS_SKIP}}
        found.append((int(proto.get("chunk", rec.get("chunk", 1))), int(rec["budget"]),
                      rec.get("label") or rec["policy"], settings, samples))
    out = []
    for chunk, budget, base, settings, samples in found:
        same = [s for _, _, b, s, _ in found if b == base]
        differ = [k for k in sorted(settings) if any(s.get(k) != settings[k] for s in same)]
        out.append((chunk, budget, ":".join([base, *(f"{k}={settings[k]}" for k in differ)]), samples))
    return out


def common(runs: dict[str, list[dict]]) -> int:
    """Windows every run of the panel has finished."""
    return min(len(s) for s in runs.values())


def overall(samples: list[dict]) -> float:
    """Perplexity of the windows given (token-weighted)."""
    n = [s["tokens"] - (samples[i - 1]["tokens"] if i else 0) for i, s in enumerate(samples)]
    return math.exp(sum(s["nll"] * k for s, k in zip(samples, n)) / sum(n))


def behind_from(h2o: list[dict], base: list[dict], span: int = 3) -> int | None:
    """Tokens streamed from which H2O's window perplexity, averaged over ``span`` windows, stays above the
    baseline's to the end (None: never)."""
    diff = [a["nll"] - b["nll"] for a, b in zip(h2o, base)]
    run = [sum(diff[max(0, i - span + 1):i + 1]) / len(diff[max(0, i - span + 1):i + 1]) for i in range(len(diff))]
    start = None
    for i, d in enumerate(run):
        if d > 0 and start is None:
            start = i
        elif d <= 0:
            start = None
    return None if start is None else h2o[start]["tokens"]


def relative(s: list[dict], base: list[dict]) -> list[float]:
    """Each window's perplexity relative to the baseline's in the same window, in percent (< 0: better)."""
    return [100 * (x["chunk_ppl"] / b["chunk_ppl"] - 1) for x, b in zip(s, base)]


def blocks(s: list[dict], base: list[dict], size: int = 10) -> list[tuple[int, int, float, int, int]]:
    """Per block of ``size`` windows: (first token, last token, mean relative window perplexity in percent,
    windows ahead of the baseline, windows in the block). The windows of one stream are not independent samples
    (the cache carries over), so this is a description of the curve, not a test."""
    rel, out = relative(s, base), []
    for i in range(0, len(rel), size):
        r = rel[i:i + size]
        first = s[i - 1]["tokens"] if i else 0
        out.append((first, s[i + len(r) - 1]["tokens"], sum(r) / len(r), sum(x < 0 for x in r), len(r)))
    return out


def table(data) -> str:
    lines = []
    for (chunk, budget), runs in sorted(data.items()):
        n = common(runs)
        feed = "token by token" if chunk == 1 else f"chunks of {chunk}"
        marks = [i for i in range(n) if n <= 12 or (i + 1) in (1, 2, 5, 10, 20, 30, 40, 50) or i == n - 1]
        first = runs[next(iter(runs))]
        head = " | ".join(f"{first[i]['tokens'] / 1000:g}k" for i in marks)
        lines += [f"**{budget}-token cache, {feed}** ({n} windows of {first[0]['tokens'] / 1000:g}k tokens; "
                  f"window perplexity at the k-th "
                  f"thousand tokens, then the perplexity of all {n} windows)", "",
                  f"| policy | {head} | all |", "|---|" + "---|" * (len(marks) + 1)]
        for label, s in sorted(runs.items(), key=lambda kv: overall(kv[1][:n])):
            cells = " | ".join(f"{s[i]['chunk_ppl']:.2f}" for i in marks)
            lines.append(f"| {label} | {cells} | {overall(s[:n]):.2f} |")
        if BASELINE in runs:
            for label in sorted(k for k in runs if k.startswith("h2o")):
                b = behind_from(runs[label][:n], runs[BASELINE][:n])
                ahead = sum(a["nll"] < c["nll"] for a, c in zip(runs[label][:n], runs[BASELINE][:n]))
                lines.append(f"\n{label} vs {BASELINE}: lower window perplexity in {ahead} of {n} windows; "
                             + (f"behind (3-window mean) from {b} tokens to the end" if b is not None
                                else "never behind to the end (3-window mean)"))
                if n > 10:
                    lines.append("; ".join(f"{lo // 1000}-{hi // 1000}k: {m:+.1f}% ({k}/{w} ahead)"
                                           for lo, hi, m, k, w in blocks(runs[label][:n], runs[BASELINE][:n])))
        lines.append("")
    return "\n".join(lines)


def speed(samples: list[dict]) -> float | None:
    """Tokens per second of the windows given (None without window times)."""
    if not all("time_s" in s for s in samples):
        return None
    seconds = sum(s["time_s"] for s in samples)
    return samples[-1]["tokens"] / seconds if seconds > 0 else None


def chunk_comparison(data) -> str:
    """Each chunked run beside the token-by-token run of its policy and budget, over their common windows:
    perplexity change and speed-up (what ``make stream``'s chunks of 32 are measured for)."""
    lines = []
    for (chunk, budget), runs in sorted(data.items()):
        base = data.get((1, budget), {})
        for label in sorted(set(runs) & set(base)) if chunk != 1 else []:
            n = min(len(runs[label]), len(base[label]))
            a, b = overall(base[label][:n]), overall(runs[label][:n])
            fast, slow = speed(runs[label][:n]), speed(base[label][:n])
            lines.append(f"- {label} at {budget} tokens, chunks of {chunk} vs token by token: perplexity {b:.3f} vs "
                         f"{a:.3f} ({100 * (b / a - 1):+.2f}%)" + (f", {fast / slow:.1f}x the speed" if fast and slow
                                                                   else "") + f" ({n} windows)")
    return "\n".join(["", "**Chunks vs token by token**", "", *lines, ""]) if lines else ""


def method_of(run: str) -> str:
    """The method a run's label names: the longest :data:`analysis.labels.METHODS` name it is or starts with
    (``h2o_heavy_share1-2``, ``h2o:heavy_share=1/2``: h2o), else the label itself."""
    names = [m for m in METHODS if run == m or run.startswith((f"{m}_", f"{m}:"))]
    return max(names, key=len, default=run)


VARIANTS = ("-", "--", ":", "-.")  # a method's own run solid, its variants (other settings) in these line styles


def styles(runs) -> dict[str, dict]:
    """Each run's line: its method's colour and marker (the one vocabulary of analysis.labels), the method's
    label with the run's settings, solid for the method's own run and another line style per variant."""
    out, seen = {}, {}
    for run in sorted(runs, key=lambda r: (method_of(r) != r, r)):
        m = method_of(run)
        k = seen[m] = seen.get(m, -1) + 1
        rest = run[len(m):].lstrip("_:")
        out[run] = {"color": color(m), "marker": marker(m), "ls": VARIANTS[k % len(VARIANTS)],
                    "label": method_label(m) + (f" ({rest})" if rest else "")}
    return out


def figure(data, out: Path) -> Path:
    """One panel per feeding x budget: each policy's window perplexity relative to StreamingLLM's, in percent
    (below 0: better than StreamingLLM); local, far above, is left to the table. Each method in its colour and
    marker of analysis.labels.METHODS, as in every figure."""
    panels = sorted(data)
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6), squeeze=False)
    for ax, key in zip(axes[0], panels):
        runs, (chunk, budget) = data[key], key
        n = common(runs)
        base = runs.get(BASELINE)
        look = styles(runs)
        for run, s in sorted(runs.items()):
            if base is None or run in (BASELINE, "local"):
                continue
            x, rel = [w["tokens"] / 1000 for w in s[:n]], relative(s[:n], base[:n])
            st = look[run]
            lw = 1.8 if run == "h2o" else 1.0
            if n <= 12:
                ax.plot(x, rel, marker=st["marker"], ms=4, ls=st["ls"], color=st["color"], lw=lw, label=st["label"])
            else:  # long streams: the windows faint, a 5-window running mean on top (a marker every ~n/8 windows)
                ax.plot(x, rel, lw=0.5, alpha=0.35, ls=st["ls"], color=st["color"])
                ax.plot(x, [sum(rel[max(0, i - 4):i + 1]) / len(rel[max(0, i - 4):i + 1]) for i in range(n)],
                        color=st["color"], ls=st["ls"], marker=st["marker"], ms=4, markevery=max(n // 8, 1), lw=lw,
                        label=f"{st['label']} (5-window mean)")
        ax.axhline(0, color=color(BASELINE), lw=0.8, label=f"{method_label(BASELINE)} (0)")
        ax.set(title=f"{budget}-token cache, " + ("token by token" if chunk == 1 else f"chunks of {chunk}"),
               xlabel="tokens streamed (k)", ylabel="window perplexity vs StreamingLLM (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("SmolLM2-135M streaming Austen: perplexity of each 1k-token window", fontsize=10)
    fig.tight_layout()
    return png(fig, out / "study.png", dpi=80)  # fixed metadata: the same records give the same bytes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m analysis.streaming_study", description=__doc__.split("\n")[0])
    p.add_argument("root", help="folder with the live window samples (searched recursively)")
    p.add_argument("--out", default="analysis/out/streaming")
    from analysis.paths import one_line

    args = one_line(p).parse_args(argv)
    data = load(Path(args.root))
    if not data:
        print(f"no streaming run records and no live window samples under {args.root}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    md = table(data) + chunk_comparison(data)
    (out / "study.md").write_text(md)
    print(md)
    print(figure(data, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
