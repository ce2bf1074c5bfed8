"""A sweep on a Slurm cluster: only the work left, one array per resource class, chunks of runs of one model per
array task (one model load each), submit and return. Hydra composes the jobs, submitit talks to Slurm.

    python -m h2o.pipeline.launch experiment=table1 --dry        # the arrays, their resources and GPU-hours
    python -m h2o.pipeline.launch experiment=table1              # submit, print the job ids, return
    python -m h2o.pipeline.launch experiment=table1 cluster.chunk=4 cluster.partition=gpu

What is dropped before submission: finished runs (a complete metrics.json), duplicates (jobs naming the same run
folder: ``policy=full`` crossed with budgets), runs still pending or running from an earlier submission (sacct),
and runs that never evict (local/h2o/... at budget 1.0 with the
default semantics), which are the full run by construction: their cell is served by the ``full`` record of the
same model, task and settings (listed as ``served`` in ``<sweep dir>/launch.json``; analysis reads full there).
The rule for each state is :mod:`h2o.pipeline.jobs`'s, the same for the local runner and ``make status``;
``h2o-run -m ... hydra/launcher=slurm`` (what ``make sweep LAUNCHER=slurm`` runs) calls :func:`main` with its command
line, in the same process. A setting of conf/cluster.yaml is spelled ``cluster.<key>=...`` or
``hydra.launcher.<key>=...``.

Resources come from the model (``conf/model/*.yaml`` ``resources``), the site's settings and task sizes from
``conf/cluster.yaml``. A chunk holds up to ``cluster.chunk`` runs of one model, cut earlier when its estimated
time passes ``cluster.max_task_min``; an array task runs its chunk in order, each run writing its own record.
A preempted or timed-out task is requeued by submitit (:class:`Chunk` is checkpointable) and starts again at
its first unfinished run; inside a run, requests already scored are read back from its partial log
(h2o.tasks.progress). The submission is written to ``<sweep dir>/launch.json``; ``make status`` reads it.
"""
from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from h2o.cli.process import import_submitit
from h2o.assets.model_spec import ConfigError
from h2o.assets.resources import check_fits_request
from h2o.assets.paths import CONF
from h2o.pipeline.jobs import LAUNCH_FILE, Work, classify, mark_in_flight, served_runs, summary
from h2o.store.files import write_json
from h2o.store.folders import runs_root
from h2o.pipeline.spec import RunSpec
from h2o.pipeline.sweep import BAD_INPUT, SETTING, Composer, expand, split_args

OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def log(msg: str) -> None:
    print(f"[h2o.launch] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------- settings
def cluster_config(overrides: list[str]) -> DictConfig:
    """conf/cluster.yaml with ``cluster.<key>=<value>`` (or ``hydra.launcher.<key>=<value>``) overrides applied,
    resolved."""
    cfg = OmegaConf.load(CONF / "cluster.yaml")
    for item in overrides:
        key, _, value = item.partition("=")
        name = next(key[len(p):] for p in SETTING if key.startswith(p))
        if name.split(".")[0] not in cfg:
            raise ConfigError(f"{key}: no such cluster setting; allowed: {', '.join(k for k in cfg if k != 'task_size')}")
        import yaml

        OmegaConf.update(cfg, name, yaml.safe_load(value) if value else None, merge=True)
    OmegaConf.resolve(cfg)
    for key in ("chunk", "max_task_min", "min_time_min", "array_parallelism"):
        if not isinstance(cfg[key], int) or cfg[key] < 1:
            raise ConfigError(f"cluster.{key}={cfg[key]!r}: expected a positive int")
    return cfg


# ------------------------------------------------------------------------------------------- estimates
def resources(spec: RunSpec) -> dict:
    r = {"gpus": 0, "mem_gb": 16, "cpus": 4, "load_min": 10, "s_per_mtok": 1000, **(spec.model.resources or {})}
    return r


def run_minutes(spec: RunSpec, cluster: DictConfig) -> float:
    """Estimated minutes of one run: the model's seconds per million tokens x the task's size (x limit / docs)."""
    task = spec.task
    if task.kind == "perplexity":
        mtok = task.n_windows * task.window / 1e6
    elif task.kind in ("retrieval", "reasoning", "shared_context"):  # sized by their own grid (their tokens())
        mtok = task.tokens() / 1e6
    else:
        size = cluster.task_size.get(task.name) or cluster.default_task_size
        mtok = float(size.mtok)
        limit = getattr(task, "limit", None)
        if limit and size.docs:
            mtok *= min(1.0, limit / size.docs)
    return resources(spec)["s_per_mtok"] * mtok / 60


@dataclass
class Chunk:
    """One array task: runs of one model, in order. Checkpointable: submitit requeues it on preemption or
    timeout, and the next attempt skips every finished run (each run resumes from its own partial log)."""

    model: str
    jobs: list[list[str]]
    indices: list[int]
    paths: list[str]
    sweep_dir: str
    offline: bool = True
    minutes: float = 0.0  # estimated: model load + its runs
    limit_min: int = 0  # the time limit asked for it

    def __call__(self) -> dict:
        from hydra import initialize_config_dir

        from h2o.pipeline.job import attempt

        if self.offline:
            os.environ.update(OFFLINE_ENV)
        from h2o.store.locks import stale_after

        outcomes = {}
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            compose = Composer()
            run = lambda i, job: attempt(compose(job), Path(self.sweep_dir), {"job": i, "overrides": job})  # noqa: E731
            for index, job in zip(self.indices, self.jobs):
                outcomes[index] = run(index, job)
            # "busy": a lock file left by this task's killed attempt on another node; taken over once stale
            deadline = time.time() + stale_after() + 60
            while "busy" in outcomes.values() and time.time() < deadline:
                time.sleep(min(30.0, stale_after() / 10 + 1))
                for index, job in zip(self.indices, self.jobs):
                    if outcomes[index] == "busy":
                        outcomes[index] = run(index, job)
        failed = [i for i, s in outcomes.items() if s == "failed"]
        if failed:
            raise RuntimeError(f"{len(failed)} of {len(outcomes)} runs failed (jobs {failed}); see "
                               f"{Path(self.sweep_dir) / 'failures.jsonl'}")
        return outcomes

    def checkpoint(self, *args, **kwargs):
        """submitit's hook on preemption / timeout: resubmit the same chunk (finished runs are skipped)."""
        return import_submitit().helpers.DelayedSubmission(self)


@dataclass
class Array:
    """One resource class: every chunk whose model asks for the same GPUs, memory and CPUs."""

    key: tuple[int, float, int]
    models: list[str] = field(default_factory=list)
    chunks: list[Chunk] = field(default_factory=list)

    @property
    def time_min(self) -> int:
        return max((c.limit_min for c in self.chunks), default=0)

    def gpu_hours(self) -> float:
        return self.key[0] * sum(c.minutes for c in self.chunks) / 60


def arrays(works: list[Work], cluster: DictConfig, sweep_dir: str) -> list[Array]:
    """Chunks of the todo runs (one model each, sweep order), grouped into one array per resource class."""
    by_model: dict[str, list[Work]] = {}
    for w in works:
        if w.state == "todo":
            by_model.setdefault(w.spec.model.name, []).append(w)
    out: dict[tuple, Array] = {}
    for model, items in by_model.items():
        r = resources(items[0].spec)
        key = (int(r["gpus"]), float(r["mem_gb"]), int(r["cpus"]))
        array = out.setdefault(key, Array(key))
        array.models.append(model)
        current: list[Work] = []

        def close():
            if current:
                minutes = r["load_min"] + sum(run_minutes(w.spec, cluster) for w in current)
                limit = max(math.ceil(minutes * cluster.time_factor), cluster.min_time_min)
                if cluster.max_time_min:  # the site's limit: a longer run resumes after each requeue
                    limit = min(limit, cluster.max_time_min)
                array.chunks.append(Chunk(model, [w.overrides for w in current], [w.index for w in current],
                                          [str(w.spec.path) for w in current], sweep_dir, bool(cluster.offline),
                                          minutes, limit))
                current.clear()

        for w in items:
            over = current and (r["load_min"] + sum(run_minutes(x.spec, cluster) for x in [*current, w])
                                > cluster.max_task_min)
            if len(current) >= cluster.chunk or over:
                close()
            current.append(w)
        close()
    return list(out.values())


def describe(works: list[Work], arrs: list[Array], cluster: DictConfig, refused: int = 0) -> str:
    lines = [summary(works) + (f"; {refused} refused (not run)" if refused else "")]
    total_gpu_h = 0.0
    for i, a in enumerate(arrs):
        gpus, mem, cpus = a.key
        runs = sum(len(c.jobs) for c in a.chunks)
        total_gpu_h += a.gpu_hours()
        lines.append(f"array {i}: gpus={gpus} mem={mem:g}G cpus={cpus} time={a.time_min}min  {len(a.chunks)} tasks, "
                     f"{runs} runs (chunk <= {cluster.chunk})  ~{a.gpu_hours():.1f} GPU-h  models: {', '.join(a.models)}")
    runs = sum(len(c.jobs) for a in arrs for c in a.chunks)
    lines.append(f"total: {len(arrs)} arrays, {sum(len(a.chunks) for a in arrs)} tasks, {runs} runs, "
                 f"~{total_gpu_h:.1f} GPU-h estimated (time limits: x{cluster.time_factor:g} the estimate)")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- submit
def submit(arrs: list[Array], cluster: DictConfig, sweep_dir: Path, experiment: str) -> list[dict]:
    """One submitit array per resource class; returns what launch.json records (job ids, chunks)."""
    submitit = import_submitit()

    records = []
    for i, a in enumerate(arrs):
        gpus, mem, cpus = a.key
        ex = submitit.SlurmExecutor(folder=sweep_dir / "slurm" / "%j", max_num_timeout=cluster.max_num_timeout)
        params = dict(job_name=f"h2o-{experiment}-{i}", mem=f"{int(math.ceil(mem))}GB", cpus_per_task=cpus,
                      time=a.time_min, array_parallelism=cluster.array_parallelism,
                      signal_delay_s=cluster.signal_delay_s, setup=list(cluster.setup),
                      additional_parameters={"requeue": True})
        if gpus:
            params["gpus_per_node"] = gpus
        for key in ("partition", "account", "qos", "constraint"):
            if cluster[key]:
                params[key] = cluster[key]
        ex.update_parameters(**params)
        with ex.batch():
            jobs = [ex.submit(chunk) for chunk in a.chunks]
        ids = [j.job_id for j in jobs]
        log(f"array {i} ({', '.join(a.models)}): {len(ids)} tasks submitted as {ids[0].split('_')[0]} "
            f"(gpus={gpus} mem={mem:g}G cpus={cpus} time={a.time_min}min)")
        records.append({"array": i, "gpus": gpus, "mem_gb": mem, "cpus": cpus, "time_min": a.time_min,
                        "tasks": [{"job_id": jid, "model": c.model, "runs": c.paths, "jobs": c.indices}
                                  for jid, c in zip(ids, a.chunks)]})
    return records


def check_assets(works: list[Work]) -> None:
    """ConfigError (one line) when a model or data set the runs left need is not in the local cache (compute
    nodes are offline): run ``make prefetch`` first."""
    from h2o.pipeline.prefetch import missing_data, missing_model

    for w in works:
        if w.state == "todo":
            why = missing_model(w.spec.model) or missing_data(w.spec.task)
            if why:
                raise ConfigError(f"{w.spec.model.name} x {w.spec.task.name}: {why}; run `make prefetch EXP=...` on "
                                  f"the login node first (or cluster.offline=false where compute nodes reach the hub)")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    flags, cluster_args, overrides = split_args(argv)
    dry = "--dry" in flags
    unknown = [f for f in flags if f not in ("--dry", "--list")]
    if unknown:
        print(f"error: {unknown[0]}: unknown flag; allowed: --dry, --list", file=sys.stderr)
        return 2
    try:
        cluster = cluster_config(cluster_args)
        sweep = expand(overrides, multirun=True)
        for spec in sweep.specs:  # the weights vs what each array task asks of its node
            check_fits_request(spec.model)
        works = classify(sweep.jobs, sweep.specs)
        sweep_dir = Path(sweep.sweep_dir).resolve()
        mark_in_flight(works, sweep_dir.parent)  # submitted before and still pending or running: not again
        arrs = arrays(works, cluster, str(sweep_dir))
        if not dry and cluster.offline:
            check_assets(works)
    except BAD_INPUT as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if "--list" in flags:
        from h2o.pipeline.sweep import describe as list_jobs

        print(list_jobs(sweep, runs_root(sweep.specs[0].cfg) if sweep.specs else None))
    print(describe(works, arrs, cluster, len(sweep.refused)))
    if dry or not arrs:
        return 0
    experiment = sweep.specs[0].cfg.experiment_name
    sweep_dir.mkdir(parents=True, exist_ok=True)
    submitted = submit(arrs, cluster, sweep_dir, experiment)
    served = [{"run": run, "served_by": full} for run, full in served_runs(works).items()]
    write_json(sweep_dir / LAUNCH_FILE, {"experiment": experiment, "submitted": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                         "overrides": overrides, "arrays": submitted, "served": served})
    ids = [t["job_id"] for a in submitted for t in a["tasks"]]
    print(f"submitted {len(ids)} array tasks: {' '.join(sorted({i.split('_')[0] for i in ids}))}; "
          f"progress: make status EXP={experiment}; tables whenever you like: make tables")
    return 0


if __name__ == "__main__":
    sys.exit(main())
