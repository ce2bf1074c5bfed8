"""The recommended wandb workspace for this harness, as code (``wandb-workspaces``; saving it needs a login).

    python -m h2o.pipeline.wandb_workspace --entity ME --project h2o-repro          print the sections
    python -m h2o.pipeline.wandb_workspace --entity ME --project h2o-repro --save   create it on the server

Sections (the keys are those h2o.pipeline.wandb_mirror and wandb_summary log):

* Paper tables: the summary runs' ``tables/<name>`` (analysis' tables, typed columns).
* Figures: the summary runs' ``figures/*`` images and the paper-vs-ours ``report``.
* Metric vs budget: one point per record run (x = config budget, y = acc / rouge2 / ppl); the summary run's
  ``fig4/*`` charts are the same points as native line plots (one line per policy, full flat).
* Benchmarks: decode throughput, KV bytes and their ratios to the full cache.
* Streaming: perplexity and cache size against tokens streamed (``stream/*`` history).
"""
from __future__ import annotations

import argparse
import sys

TABLES = ("table1", "table2", "table6", "table8", "table9", "table10", "helm_0shot", "helm_5shot", "rouge",
          "self_bleu", "perplexity", "benchmark")
FIGURES = ("figures/fig4_budget_curves", "figures/streaming_ppl", "figures/fig2_observations", "report")
BUDGET_METRICS = ("acc", "rouge2", "ppl")
BENCH_METRICS = ("decode_tok_s", "vs_full.decode_tok_s", "kv_bytes", "vs_full.kv_bytes")
STREAM_METRICS = ("stream/ppl", "stream/chunk_ppl", "stream/cache_tokens", "stream/time_per_token_s")


def workspace(entity: str, project: str, name: str = "H2O paper"):
    import wandb_workspaces.reports.v2 as wr
    import wandb_workspaces.workspaces as ws

    sections = [
        ws.Section(name="Paper tables", is_open=True,
                   panels=[wr.WeavePanelSummaryTable(table_name=f"tables/{t}") for t in TABLES]),
        ws.Section(name="Figures and report", is_open=True,
                   panels=[wr.MediaBrowser(title=k, media_keys=[k]) for k in FIGURES]),
        ws.Section(name="Metric vs budget", is_open=True,
                   panels=[wr.ScatterPlot(title=f"{m} vs budget (one point per record)", x=wr.Config("budget"),
                                          y=wr.SummaryMetric(m)) for m in BUDGET_METRICS]),
        ws.Section(name="Benchmarks", panels=[wr.BarPlot(title=m, metrics=[m], groupby=wr.Config("policy"))
                                              for m in BENCH_METRICS]),
        ws.Section(name="Streaming", panels=[wr.LinePlot(title=f"{m} vs tokens", x="stream/tokens", y=[m])
                                             for m in STREAM_METRICS]),
    ]
    return ws.Workspace(entity=entity, project=project, name=name, sections=sections,
                        runset_settings=ws.RunsetSettings(groupby=[]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m h2o.pipeline.wandb_workspace", description=__doc__.split("\n")[0])
    p.add_argument("--entity", required=True)
    p.add_argument("--project", default="h2o-repro")
    p.add_argument("--name", default="H2O paper")
    p.add_argument("--save", action="store_true", help="create the workspace on the server (needs `wandb login`)")
    from h2o.cli.args import one_line

    args = one_line(p).parse_args(argv)
    try:
        w = workspace(args.entity, args.project, args.name)
    except ImportError:
        print("error: wandb-workspaces is not installed; `pip install wandb-workspaces`", file=sys.stderr)
        return 2
    for section in w.sections:
        print(f"{section.name}: {len(section.panels)} panels")
    if args.save:
        print(w.save().url)
    return 0


if __name__ == "__main__":
    sys.exit(main())
