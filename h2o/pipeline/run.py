"""``h2o-run`` / ``python -m h2o.pipeline.run``: run one config (or a Hydra multirun) and write its record under runs/.

    h2o-run task=austen_ppl policy=h2o policy.budget=0.2 task.n_windows=4
    h2o-run -m experiment=default                          # the experiment's sweep, basic launcher
    h2o-run -m experiment=table1 hydra/launcher=slurm      # make sweep EXP=table1 LAUNCHER=slurm: h2o.pipeline.launch

Every job of the command line is composed and checked first (h2o.pipeline.sweep: bad values are one line, exit
status 2, no model loaded). A multirun then classifies its jobs (h2o.pipeline.jobs: the same rule as the Slurm
launcher's and ``make status``'s) and lists the ones the full run serves in ``<sweep dir>/served.json``; Hydra's
launcher runs each job (h2o.pipeline.job: skip, claim, run, record). ``hydra/launcher=slurm`` is not handed to
Hydra: the command line, less ``-m`` and that choice, goes to :func:`h2o.pipeline.launch.main` in this process,
which submits only the work left (one array per resource class). After a multirun, the experiment's wandb summary
run (h2o.pipeline.wandb_summary) and the sweep's failures, printed (exit status 1 if any); every job's outcome is in
``<sweep dir>/jobs.jsonl``.
"""
from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import hydra
from omegaconf import DictConfig

from h2o.assets.paths import CONF
from h2o.assets.resources import check_fits_here
from h2o.assets.fetch import FetchError
from h2o.cli.args import fail
from h2o.cli.process import kept
from h2o.core.validate import ConfigError
from h2o.pipeline.job import attempt, log
from h2o.pipeline.jobs import SERVED_FILE, classify, served_runs
from h2o.store.files import read_jsonl, write_json
from h2o.store.folders import finished
from h2o.pipeline.sweep import BAD_INPUT, expand, summary_line

SWEEP_ENV = "H2O_SWEEP_ID"  # set by main() for a multirun; every job row of the sweep carries it
PASSTHROUGH = ("--help", "-h", "--hydra-help", "--info", "-i", "--cfg", "-c", "--shell-completion", "-sc",
               "--version", "--resolve", "--package", "-p", "--run", "-r")
FLAGS = ("-m", "--multirun", "--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd",
         "--experimental-rerun", *PASSTHROUGH)  # what Hydra's command line takes
SLURM = "hydra/launcher=slurm"  # conf/hydra/launcher/slurm.yaml: the Slurm arrays of h2o.pipeline.launch


def run_job(cfg: DictConfig) -> str:
    """One Hydra job: returns its outcome (done, skipped, served, refused, busy, failed)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    sweep_dir = Path(hc.runtime.cwd) / hc.sweep.dir if multirun else None
    return attempt(cfg, sweep_dir, {"job": hc.job.get("num"), "overrides": list(hc.overrides.task),
                                    "sweep_id": os.environ.get(SWEEP_ENV)})


# An absolute config_path (= ../conf): a relative one is resolved as a Python package ("conf") when the module is
# started by the console script h2o-run rather than by `python -m h2o.pipeline.run`, and is then not found.
@hydra.main(version_base="1.3", config_path=str(CONF), config_name="config")
def hydra_main(cfg: DictConfig) -> str:
    return run_job(cfg)


def main(argv: list[str] | None = None) -> int:
    """Validate every job first, then hand the command line to Hydra; report a sweep's failures at the end. The
    process is left as the caller had it (Hydra's log handlers, sys.argv, the environment: h2o.cli.process)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    with kept():
        return _main(argv)


def _main(argv: list[str]) -> int:
    if SLURM in argv:  # one path for `make sweep LAUNCHER=slurm` and this spelling
        from h2o.pipeline.launch import main as launch

        return launch([a for a in argv if a not in ("-m", "--multirun", SLURM)])
    multirun = "-m" in argv or "--multirun" in argv
    sweep_dir = None
    unknown = [a for a in argv if a.startswith("-") and a.split("=")[0] not in FLAGS]
    if unknown:
        return fail(ConfigError(f"{unknown[0]}: unknown option; allowed: key=value overrides, -m/--multirun, "
                                f"--help, --cfg job, --info and Hydra's other flags (see --help)"))
    if not any(a.split("=")[0] in PASSTHROUGH for a in argv):
        overrides = [a for a in argv if not a.startswith("-")]
        try:
            sweep = expand(overrides, multirun)
            for model in {spec.model.key(): spec.model for spec in sweep.specs}.values():
                check_fits_here(model)  # before any job loads anything
            for spec in sweep.specs:  # data a cluster run prefetches (make prefetch): an unfinished run needs it
                if not finished(spec.path):
                    spec.task.check_data()
        except (BAD_INPUT, FetchError) as exc:  # a fetch for an up-front data check says what to do in one line
            return fail(exc)
        if multirun:
            works = classify(sweep.jobs, sweep.specs)
            log(summary_line(sweep, works))
            sweep_id = f"{os.getpid()}-{uuid.uuid4().hex[:6]}"
            os.environ[SWEEP_ENV] = sweep_id  # each job row carries it: the summary counts this process's jobs
            if not any(a.startswith("hydra.sweep.dir=") for a in overrides):
                # a folder of its own per sweep process, not only per second: <experiment>/<date_time>-<pid>-<rand>
                argv.append(f"hydra.sweep.dir={sweep.sweep_dir}-{sweep_id}")
            sweep_dir = Path(next(a for a in argv if a.startswith("hydra.sweep.dir=")).split("=", 1)[1])
            sweep_dir.mkdir(parents=True, exist_ok=True)
            write_json(sweep_dir / SERVED_FILE, served_runs(works))  # read by each job (attempt)
    sys.argv = [sys.argv[0], *argv]
    hydra_main()
    if sweep_dir is None:
        return 0
    if any(spec.cfg.logger.get("wandb") for spec in sweep.specs):
        from h2o.pipeline.wandb_summary import after_sweep

        after_sweep(sweep.specs)  # the experiment's summary run (tables, figures, Fig. 4 plots); never raises
    mine = lambda rows: [r for r in rows if r.get("sweep_id") == os.environ.get(SWEEP_ENV)]  # noqa: E731
    jobs = mine(read_jsonl(sweep_dir / "jobs.jsonl"))
    failures = mine(read_jsonl(sweep_dir / "failures.jsonl"))
    counts = {s: sum(j["status"] == s for j in jobs) for s in ("done", "skipped", "served", "refused", "busy",
                                                               "failed")}
    log(f"sweep {sweep_dir}: " + ", ".join(f"{v} {k}" for k, v in counts.items()))
    for f in failures:
        log(f"FAILED job {f['job']} {' '.join(f['overrides'])}: {f['error']}")
    if failures:
        log(f"{len(failures)} failed job(s); details in {sweep_dir / 'failures.jsonl'}; rerun the same command to retry them")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
