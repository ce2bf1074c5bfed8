"""One job of a run or a sweep: a composed config checked into its spec, skipped when finished, held or served by
the full run, else run and written as its record under runs/. The body of every launcher's job: ``h2o-run`` (one
run, or each job of a Hydra multirun: basic or submitit_local) and each run of a Slurm array task
(h2o.pipeline.launch).

Order of work: check the config (h2o.pipeline.spec; bad values: one line, exit status 2 for a single run, no model
loaded); skip a run whose folder already has metrics.json, or that the full run serves (``<sweep dir>/served.json``,
written by h2o-run before the first job: h2o.pipeline.jobs); claim the folder; load the model (reused across the
jobs of a process); run the task; write config.yaml, samples.jsonl, env.json, then metrics.json last (atomically);
mirror to wandb if ``logger=wandb`` (its failures are printed, never raised). A sweep's job outcome goes to
``<sweep dir>/jobs.jsonl`` and a failure to ``failures.jsonl``; the sweep goes on.

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
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from h2o.assets.resources import check_fits_here
from h2o.cli.args import fail
from h2o.core.policies.budget import Unsupported
from h2o.core.validate import BadInput
from h2o.pipeline.jobs import read_served
from h2o.store.env import env_info, slurm_job_id
from h2o.store.files import append_jsonl, atomic_write_text, write_json, write_jsonl
from h2o.store.folders import claim, clear_partial, finished
from h2o.pipeline.spec import RunSpec, prepare
from h2o.tasks.progress import recording, resumed

PARTIAL = "partial"  # per-request results of an unfinished run (resume inside a run)
CRASH_ENV = "H2O_TEST_CRASH_AT"
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


def execute(spec: RunSpec) -> dict:
    """Run the spec and write its record; returns the metrics.json content. torch's thread count, which the spec
    may set for its run, is the caller's again afterwards (a sweep's jobs may share one process)."""
    import torch

    threads = torch.get_num_threads()
    try:
        return _execute(spec)
    finally:
        torch.set_num_threads(threads)


def _execute(spec: RunSpec) -> dict:
    import torch

    started = time.time()
    if spec.settings.threads:
        torch.set_num_threads(spec.settings.threads)
    seed_everything(spec.settings.seed)
    clear_partial(spec.path)
    atomic_write_text(spec.path / "config.yaml", OmegaConf.to_yaml(spec.cfg, resolve=True))
    _crash_hook(spec.path)
    model, tokenizer = spec.model.load()
    with recording(spec.path / PARTIAL):  # per-request results kept across a preemption (h2o.tasks.progress)
        result = spec.task.run(model, tokenizer, spec.policy, spec.semantics, spec.settings.seed, quant=spec.quant)
    ended = time.time()
    files = result.info.pop("files", {})  # extra record files of a task (observations.json)
    protocol = spec.task.protocol(tokenizer)  # every task setting that changes a number, BOS resolved
    record = spec.record({"scoring": protocol["scoring"], "add_bos_token": protocol["add_bos_token"],
                          "protocol": protocol, "n_samples": result.n_samples, "metrics": result.metrics,
                          "wall_s": round(ended - started, 3), "batch_size": spec.cfg.task.get("batch_size"),
                          "device": str(getattr(model, "device", "")),
                          "dtype": str(getattr(model, "dtype", "")).replace("torch.", ""),
                          "resumed_requests": resumed()}, result.info)  # h2o.pipeline.fields: one rule
    for name, content in files.items():
        write_json(spec.path / name, content)
    write_jsonl(spec.path / "samples.jsonl", result.samples)
    write_json(spec.path / "env.json", env_info(started, ended))
    write_json(spec.path / "metrics.json", record)  # last: the run is finished once this exists
    shutil.rmtree(spec.path / PARTIAL, ignore_errors=True)
    return record


def mirror(spec: RunSpec, record: dict) -> None:
    """The record to wandb with ``logger=wandb`` (its failures printed, never raised: h2o.pipeline.wandb_mirror)."""
    if spec.cfg.logger.get("wandb"):
        from h2o.pipeline.wandb_mirror import mirror_run

        mirror_run(spec.cfg.logger, spec, record)


def attempt(cfg: DictConfig, sweep_dir: Path | None, entry: dict) -> str:
    """Run one composed config unless it is finished or held; returns its outcome (done, skipped, served,
    refused, busy, failed). ``sweep_dir`` None: a single run (bad input exits 2, errors raise); else a sweep's job, whose
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
        spec = prepare(cfg)
        check_fits_here(spec.model)
        if not finished(spec.path):  # a finished run reads no data; a dry run is never here (h2o.pipeline.sweep)
            spec.task.check_data()  # data a cluster run prefetches: refused here, before the model loads
    except Unsupported as exc:  # a combination that does not exist: listed as refused by the dry run too
        if not multirun:
            sys.exit(fail(exc))
        log(f"refused {entry['overrides']}: {exc}")
        return outcome("refused")
    except BadInput as exc:
        if not multirun:
            sys.exit(fail(exc))
        log(f"invalid job {entry['overrides']}: {exc}")
        return outcome("failed", exc=exc)
    if finished(spec.path):
        log(f"skip, finished already: {spec.path}")
        return outcome("skipped", spec.path)
    served_by = read_served(sweep_dir).get(str(spec.path)) if multirun else None
    if served_by:  # never evicts: the full run's record is its value (h2o.pipeline.jobs)
        log(f"skip, served by the full run {served_by}: {spec.path}")
        return outcome("served", spec.path)
    with claim(spec.path) as mine:
        if not mine or finished(spec.path):
            log(f"skip, {'being run by another process' if not mine else 'finished already'}: {spec.path}")
            return outcome("busy" if not mine else "skipped", spec.path)
        log(f"run {spec.model.name} {spec.task.name} {spec.policy.name} budget={spec.policy.budget} -> {spec.path}")
        try:
            record = execute(spec)
        except Exception as exc:  # noqa: BLE001 - a failing job must not end the sweep
            if not multirun and isinstance(exc, BadInput):  # found only once loaded: still one line
                log(f"FAILED {spec.path} (left unfinished)")
                sys.exit(fail(exc))
            if not multirun or spec.settings.fail_fast:
                raise
            traceback.print_exc()
            log(f"FAILED {spec.path}: {type(exc).__name__}: {exc}")
            return outcome("failed", spec.path, exc)
    log(f"done in {record['wall_s']:.1f} s: {json.dumps(record['metrics'])}")
    mirror(spec, record)
    return outcome("done", spec.path)
