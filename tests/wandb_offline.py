"""Read what an offline wandb run logged, with wandb's own protobuf records (``wandb.proto``).

A ``run-<id>.wandb`` file is a LevelDB-style log: a 7-byte header (``:W&B``, a 2-byte magic, a version byte), then
32 KiB blocks of chunks, each a 7-byte header (CRC32C, length as uint16 little-endian, type: 1 full, 2 first,
3 middle, 4 last) and its bytes; a block's tail shorter than a header is zero padding. A chunk (or a first ..
last sequence) is one serialized ``wandb_internal_pb2.Record``. (wandb 0.31 ships no Python reader.)
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

BLOCK = 32768


def records(path: Path):
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path}: not a wandb run file"
    pos, buf = 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:
            pos += left
            continue
        n, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        buf += data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            buf = b""
            yield rec


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


@dataclass
class OfflineRun:
    folder: Path
    id: str = ""
    name: str = ""
    group: str = ""
    job_type: str = ""
    tags: list = field(default_factory=list)
    config: dict = field(default_factory=dict)
    history: list = field(default_factory=list)   # one dict per step: key -> decoded JSON value
    summary: dict = field(default_factory=dict)
    step_metrics: dict = field(default_factory=dict)  # define_metric: name or glob -> its x axis

    def table(self, key: str) -> dict:
        """A logged wandb.Table (its .table.json: columns, data), found through the history."""
        path = next(h[key + "/path"] for h in reversed(self.history) if key + "/path" in h)
        return json.loads((self.folder / "files" / path).read_text())


def read_run(wandb_file: Path) -> OfflineRun:
    run = OfflineRun(Path(wandb_file).parent)
    for rec in records(wandb_file):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            r = rec.run
            run.id, run.name, run.group, run.job_type, run.tags = (r.run_id, r.display_name, r.run_group,
                                                                   r.job_type, list(r.tags))
            run.config.update({_key(u): json.loads(u.value_json) for u in r.config.update})
        elif kind == "config":
            run.config.update({_key(u): json.loads(u.value_json) for u in rec.config.update})
        elif kind == "history":
            run.history.append({_key(i): json.loads(i.value_json) for i in rec.history.item})
        elif kind == "metric":
            run.step_metrics[rec.metric.name or rec.metric.glob_name] = rec.metric.step_metric
        elif kind == "summary":
            run.summary.update({_key(u): json.loads(u.value_json) for u in rec.summary.update})
    return run


def read_runs(root: Path) -> list[OfflineRun]:
    """Every offline run under ``root`` (any depth), oldest first."""
    return [read_run(f) for f in sorted(Path(root).rglob("offline-run-*/run-*.wandb"))]
