"""``h2o-run`` / ``python -m h2o.pipeline.run``: run one config (or a Hydra multirun) and write its record under runs/.

    h2o-run task=bb_copa policy=h2o policy.budget=0.2 task.limit=20
    h2o-run -m experiment=default                          # the experiment's sweep, basic launcher
    h2o-run -m experiment=table1 hydra/launcher=slurm      # = make sweep EXP=table1 LAUNCHER=slurm

Order of work: compose and validate every job (bad values: one line, exit status 2, no model loaded); skip a
run whose folder already has metrics.json; load the model (reused across the jobs of a sweep); attach the
policy; run the task; write config.yaml, samples.jsonl, env.json, then metrics.json last (atomically); mirror
to wandb if ``logger=wandb`` (its failures are printed, never raised; after a multirun, the experiment's summary
run, h2o.pipeline.wandb_summary). A multirun skips the jobs served by the full run (h2o.pipeline.jobs; listed in
``<sweep dir>/served.json``), as the Slurm path does. In a multirun a failing job is recorded in
``<sweep dir>/failures.jsonl`` and the sweep goes on; the failures are printed at the end (exit status 1).
Every job's outcome goes to ``<sweep dir>/jobs.jsonl``.

Test hook: ``H2O_TEST_CRASH_AT=N`` makes the N-th run this process executes die (``os._exit``) after writing
config.yaml and a torn samples.jsonl, as a killed job would.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import sys
import time
import traceback
import uuid
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from h2o.pipeline.jobs import SERVED_FILE, classify, read_served, served_runs
from h2o.pipeline.plan import Plan, prepare
from h2o.pipeline.records import (CONF, append_jsonl, claim, clear_partial, env_info, finished, read_jsonl,
                                  slurm_job_id, write_json, write_jsonl)
from h2o.assets.paths import atomic_write_text
from h2o.assets.resources import check_fits_here
from h2o.core.policies.budget import Unsupported
from h2o.core.validate import ConfigError, fail
from h2o.pipeline.sweep import BAD_INPUT, expand, summary_line
from h2o.tasks.progress import recording, resumed

PARTIAL = "partial"  # per-request results of an unfinished run (resume inside a run)

CRASH_ENV = "H2O_TEST_CRASH_AT"
SWEEP_ENV = "H2O_SWEEP_ID"  # set by main() for a multirun; every job row of the sweep carries it
PASSTHROUGH = ("--help", "-h", "--hydra-help", "--info", "-i", "--cfg", "-c", "--shell-completion", "-sc",
               "--version", "--resolve", "--package", "-p", "--run", "-r")
FLAGS = ("-m", "--multirun", "--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd",
         "--experimental-rerun", *PASSTHROUGH)  # what Hydra's command line takes
SLURM = "hydra/launcher=slurm"  # conf/hydra/launcher/slurm.yaml: handed to h2o.pipeline.launch
_executed = 0  # runs executed (not skipped) by this process


def log(msg: str) -> None:
    print(f"[h2o] {msg}", file=sys.stderr, flush=True)


def seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _crash_hook(path: Path) -> None:
    global _executed
    _executed += 1
    if os.environ.get(CRASH_ENV) == str(_executed):
        (path / "samples.jsonl").write_text('{"doc_id": 0, "torn')
        log(f"{CRASH_ENV}={_executed}: dying on purpose in {path}")
        os._exit(17)


def execute(plan: Plan) -> dict:
    """Run the plan and write its record; returns the metrics.json content."""
    import torch

    started = time.time()
    if plan.cfg.threads:
        torch.set_num_threads(plan.cfg.threads)
    seed_everything(plan.cfg.seed)
    clear_partial(plan.path)
    atomic_write_text(plan.path / "config.yaml", OmegaConf.to_yaml(plan.cfg, resolve=True))
    _crash_hook(plan.path)
    model, tokenizer = plan.model.load()
    with recording(plan.path / PARTIAL):  # per-request results kept across a preemption (h2o.tasks.progress)
        result = plan.task.run(model, tokenizer, plan.policy, plan.semantics, plan.cfg.seed, quant=plan.quant)
    ended = time.time()
    files = result.info.pop("files", {})  # extra record files of a task (observations.json)
    protocol = plan.task.protocol(tokenizer)  # every task setting that changes a number, BOS resolved
    record = {**plan.head(), "scoring": protocol["scoring"], "add_bos_token": protocol["add_bos_token"],
              "protocol": protocol, "n_samples": result.n_samples, "metrics": result.metrics,
              "wall_s": round(ended - started, 3), "batch_size": plan.cfg.task.get("batch_size"),
              "device": str(getattr(model, "device", "")), "dtype": str(getattr(model, "dtype", "")).replace("torch.", ""),
              "resumed_requests": resumed(), **result.info}
    for name, content in files.items():
        write_json(plan.path / name, content)
    write_jsonl(plan.path / "samples.jsonl", result.samples)
    write_json(plan.path / "env.json", env_info(started, ended))
    write_json(plan.path / "metrics.json", record)  # last: the run is finished once this exists
    shutil.rmtree(plan.path / PARTIAL, ignore_errors=True)
    return record


def mirror(cfg: DictConfig, plan: Plan, record: dict) -> None:
    if cfg.logger.get("wandb"):
        from h2o.pipeline.wandb_mirror import mirror_run

        mirror_run(cfg.logger, plan, record)


def run_job(cfg: DictConfig) -> str:
    """One Hydra job: returns its outcome (done, skipped, served, refused, busy, failed)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    sweep_dir = Path(hc.runtime.cwd) / hc.sweep.dir if multirun else None
    return attempt(cfg, sweep_dir, {"job": hc.job.get("num"), "overrides": list(hc.overrides.task),
                                    "sweep_id": os.environ.get(SWEEP_ENV)})


def attempt(cfg: DictConfig, sweep_dir: Path | None, entry: dict) -> str:
    """Run one composed config unless it is finished or held; returns its outcome (done, skipped, busy,
    failed). ``sweep_dir`` None: a single run (bad input exits 2, errors raise); else a sweep's job, whose
    outcome goes to ``<sweep_dir>/jobs.jsonl`` (and failures.jsonl). Also the body of a Slurm array task's
    runs (h2o.pipeline.launch)."""
    multirun = sweep_dir is not None
    t0 = time.time()

    def outcome(state: str, path=None, exc: BaseException | None = None) -> str:
        if sweep_dir is not None:
            row = {**entry, "status": state, "run_dir": str(path) if path else None, "wall_s": round(time.time() - t0, 2),
                   "slurm_job_id": slurm_job_id()}
            if exc is not None:
                row.update(error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
                append_jsonl(sweep_dir / "failures.jsonl", row)
            append_jsonl(sweep_dir / "jobs.jsonl", row)
        return state

    try:
        plan = prepare(cfg)
        check_fits_here(plan.model)
    except Unsupported as exc:  # a combination that does not exist: listed as refused by the dry run too
        if not multirun:
            sys.exit(fail(exc))
        log(f"refused {entry['overrides']}: {exc}")
        return outcome("refused")
    except BAD_INPUT as exc:
        if not multirun:
            sys.exit(fail(exc))
        log(f"invalid job {entry['overrides']}: {exc}")
        return outcome("failed", exc=exc)
    if finished(plan.path):
        log(f"skip, finished already: {plan.path}")
        return outcome("skipped", plan.path)
    served_by = read_served(sweep_dir).get(str(plan.path)) if multirun else None
    if served_by:  # never evicts: the full run's record is its value (h2o.pipeline.jobs)
        log(f"skip, served by the full run {served_by}: {plan.path}")
        return outcome("served", plan.path)
    with claim(plan.path) as mine:
        if not mine or finished(plan.path):
            log(f"skip, {'being run by another process' if not mine else 'finished already'}: {plan.path}")
            return outcome("busy" if not mine else "skipped", plan.path)
        log(f"run {plan.model.name} {plan.task.name} {plan.policy.name} budget={plan.policy.budget} -> {plan.path}")
        try:
            record = execute(plan)
        except Exception as exc:  # noqa: BLE001 - a failing job must not end the sweep
            if not multirun and isinstance(exc, BAD_INPUT):  # found only once loaded: still one line
                log(f"FAILED {plan.path} (left unfinished)")
                sys.exit(fail(exc))
            if not multirun or cfg.fail_fast:
                raise
            traceback.print_exc()
            log(f"FAILED {plan.path}: {type(exc).__name__}: {exc}")
            return outcome("failed", plan.path, exc)
    log(f"done in {record['wall_s']:.1f} s: {json.dumps(record['metrics'])}")
    mirror(cfg, plan, record)
    return outcome("done", plan.path)


# An absolute config_path (= ../conf): a relative one is resolved as a Python package ("conf") when the module is
# started by the console script h2o-run rather than by `python -m h2o.pipeline.run`, and is then not found.
@hydra.main(version_base="1.3", config_path=str(CONF), config_name="config")
def hydra_main(cfg: DictConfig) -> str:
    return run_job(cfg)


def main(argv: list[str] | None = None) -> int:
    """Validate every job first, then hand the command line to Hydra; report a sweep's failures at the end."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if SLURM in argv:  # the Slurm path is h2o.pipeline.launch's (`make sweep LAUNCHER=slurm`), a program of its own
        import subprocess

        args = [a for a in argv if a not in ("-m", "--multirun", SLURM)]
        return subprocess.call([sys.executable, "-m", "h2o.pipeline.launch", *args])
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
            for model in {plan.model.key(): plan.model for plan in sweep.plans}.values():
                check_fits_here(model)  # before any job loads anything
        except BAD_INPUT as exc:
            return fail(exc)
        if multirun:
            works = classify(sweep.jobs, sweep.plans)
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
    if any(plan.cfg.logger.get("wandb") for plan in sweep.plans):
        from h2o.pipeline.wandb_summary import after_sweep

        after_sweep(sweep.plans)  # the experiment's summary run (tables, figures, Fig. 4 plots); never raises
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
