#!/usr/bin/env python3
"""A fake Slurm for tests: sbatch, srun, sacct, squeue, scancel and scontrol on one machine (stdlib only).

Each command is a small script in this folder that runs ``fakeslurm.py <command> ...``; put the folder first on
PATH and set ``FAKE_SLURM_DIR`` to a scratch folder. ``sbatch`` reads ``#SBATCH --array=0-N%P`` and starts a
detached runner that executes each array task as a local background process (``bash <script>``, at most P at a
time) with the SLURM_* variables a real task sees. ``srun`` runs its command with the --output/--error files.
``scancel [--signal SIG] <id>`` signals (or kills) a task; ``scontrol requeue <id>`` marks a task to be run again
when its process ends, as Slurm does for a requeued job (submitit calls it on preemption and timeout).
State: ``$FAKE_SLURM_DIR/<id>.json`` per task (``<job>_<task>``), with State PENDING, RUNNING, COMPLETED, FAILED,
CANCELLED; ``Requeues`` counts the restarts.
"""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(os.environ.get("FAKE_SLURM_DIR", "/tmp/fake-slurm"))
TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "OUT_OF_MEMORY", "NODE_FAIL", "TIMEOUT")


def state_file(task: str) -> Path:
    return ROOT / f"{task}.json"


def read(task: str) -> dict:
    try:
        return json.loads(state_file(task).read_text())
    except (OSError, ValueError):
        return {}


def write(task: str, **fields) -> None:
    data = {**read(task), **fields}
    tmp = state_file(task).with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, state_file(task))


def tasks_of(job: str) -> list[str]:
    """Task ids of ``<job>`` (every array task) or of ``<job>_<i>`` (that one)."""
    if "_" in job:
        return [job] if state_file(job).exists() else []
    return sorted(p.stem for p in ROOT.glob(f"{job}_*.json")) + ([job] if state_file(job).exists() else [])


def sbatch(args: list[str]) -> int:
    script = Path(args[-1]).resolve()
    text = script.read_text()
    ROOT.mkdir(parents=True, exist_ok=True)
    counter = ROOT / "next_id"
    job = int(counter.read_text()) if counter.exists() else 1000
    counter.write_text(str(job + 1))
    m = re.search(r"^#SBATCH --array=(\d+)-(\d+)(?:%(\d+))?", text, re.M)
    if m:
        ids = [f"{job}_{i}" for i in range(int(m.group(1)), int(m.group(2)) + 1)]
        parallel = int(m.group(3) or len(ids))
    else:
        ids, parallel = [str(job)], 1
    for n, task in enumerate(ids):
        write(task, JobID=task, State="PENDING", Requeues=0, Script=str(script), Cwd=os.getcwd(), Uid=job * 1000 + n)
    subprocess.Popen([sys.executable, __file__, "_runner", str(parallel), *ids], start_new_session=True,
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=open(ROOT / f"runner-{job}.log", "a"))
    print(f"Submitted batch job {job}")
    return 0


def start(task: str) -> subprocess.Popen:
    info = read(task)
    job, _, index = task.partition("_")
    env = {**os.environ, "SLURM_JOB_ID": str(info["Uid"]), "SLURM_JOB_NUM_NODES": "1", "SLURM_NTASKS": "1",
           "SLURM_NODEID": "0", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_JOB_NODELIST": "localhost",
           "SLURM_RESTART_COUNT": str(info.get("Requeues", 0)), "FAKE_SLURM_TASK": task}
    if index:
        env.update(SLURM_ARRAY_JOB_ID=job, SLURM_ARRAY_TASK_ID=index)
    else:
        env["SLURM_JOB_ID"] = job
    proc = subprocess.Popen(["bash", info["Script"]], cwd=info["Cwd"], env=env, start_new_session=True,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    write(task, State="RUNNING", Pid=proc.pid)
    return proc


def runner(parallel: int, ids: list[str]) -> int:
    waiting, running = list(ids), {}
    while waiting or running:
        for task, proc in list(running.items()):
            rc = proc.poll()
            if rc is None:
                continue
            del running[task]
            info = read(task)
            flag = ROOT / f"{task}.requeue"
            if flag.exists():  # requeued (preemption, timeout): run the task again from its script
                flag.unlink()
                write(task, State="PENDING", Requeues=info.get("Requeues", 0) + 1)
                waiting.insert(0, task)
            elif info.get("State") == "CANCELLED":
                pass
            else:
                write(task, State="COMPLETED" if rc == 0 else "FAILED", ExitCode=f"{max(rc, 0)}:0")
        while waiting and len(running) < parallel:
            task = waiting.pop(0)
            if read(task).get("State") == "CANCELLED":
                continue
            running[task] = start(task)
        time.sleep(0.1)
    return 0


def srun(args: list[str]) -> int:
    out = err = None
    while args and args[0].startswith("-"):
        opt = args.pop(0)
        if opt in ("--output", "-o"):
            out = args.pop(0)
        elif opt in ("--error", "-e"):
            err = args.pop(0)
        elif "=" not in opt and opt not in ("--unbuffered", "-u") and args and not args[0].startswith("-"):
            args.pop(0)  # an option's value
    subst = {"%A": os.environ.get("SLURM_ARRAY_JOB_ID", ""), "%a": os.environ.get("SLURM_ARRAY_TASK_ID", ""),
             "%j": os.environ.get("SLURM_JOB_ID", ""), "%t": "0"}
    for name, fd in ((out, 1), (err, 2)):
        if name:
            for k, v in subst.items():
                name = name.replace(k, v)
            Path(name).parent.mkdir(parents=True, exist_ok=True)
            os.dup2(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644), fd)
    if os.environ.get("FAKE_SLURM_TASK"):
        write(os.environ["FAKE_SLURM_TASK"], StepPid=os.getpid())
    os.execvp(args[0], args)


def sacct(args: list[str]) -> int:
    fields = ["JobID", "State"]
    jobs = []
    it = iter(args)
    for a in it:
        if a in ("-o", "--format"):
            fields = next(it).split(",")
        elif a.startswith("--format="):
            fields = a.split("=", 1)[1].split(",")
        elif a in ("-j", "--jobs"):
            jobs += next(it).split(",")
    header = "--noheader" not in args and "-n" not in args
    lines = ["|".join(fields)] if header else []
    for job in jobs:
        for task in tasks_of(job):
            info = {"NodeList": "localhost", "ExitCode": "0:0", **read(task)}
            lines.append("|".join(str(info.get(f, "")) for f in fields))
    print("\n".join(lines))
    return 0


def squeue(args: list[str]) -> int:
    print("JOBID|STATE")
    for f in sorted(ROOT.glob("*.json")):
        info = read(f.stem)
        if info.get("State") not in TERMINAL:
            print(f"{info['JobID']}|{info['State']}")
    return 0


def scancel(args: list[str]) -> int:
    sig = None
    it = iter(args)
    ids = []
    for a in it:
        if a in ("--signal", "-s"):
            sig = next(it)
        elif a.startswith("--signal="):
            sig = a.split("=", 1)[1]
        else:
            ids.append(a)
    for job in ids:
        for task in tasks_of(job):
            info = read(task)
            if info.get("State") != "RUNNING":
                if sig is None and info.get("State") == "PENDING":
                    write(task, State="CANCELLED")
                continue
            if sig is not None:  # like Slurm: to the job's steps (the srun'd process)
                name = sig if sig.startswith("SIG") else f"SIG{sig}"
                os.kill(info.get("StepPid") or info["Pid"], getattr(signal, name))
            else:
                write(task, State="CANCELLED")
                os.killpg(info["Pid"], signal.SIGKILL)
    return 0


def scontrol(args: list[str]) -> int:
    if args[:1] == ["requeue"]:
        for job in args[1].split(","):
            for task in tasks_of(job):
                (ROOT / f"{task}.requeue").touch()
        return 0
    print(f"fake scontrol: {' '.join(args)}: not supported", file=sys.stderr)
    return 1


COMMANDS = {"sbatch": sbatch, "srun": srun, "sacct": sacct, "squeue": squeue, "scancel": scancel,
            "scontrol": scontrol}

if __name__ == "__main__":
    cmd, rest = sys.argv[1], sys.argv[2:]
    if cmd == "_runner":
        sys.exit(runner(int(rest[0]), rest[1:]))
    sys.exit(COMMANDS[cmd](rest))
