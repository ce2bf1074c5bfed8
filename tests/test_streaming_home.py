"""The streaming task lives in h2o/tasks/ (a task, not a measurement); its older home h2o.bench.streaming still
runs as ``python -m h2o.bench.streaming`` and re-exports the same objects, so configs and records naming
``h2o.bench.streaming.StreamingTask`` keep working."""
from __future__ import annotations

import runpy
import sys

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from h2o.assets.paths import CONF


def test_the_older_module_names_are_the_same_objects():
    from h2o.bench import stream_parts, streaming, streaming_cli
    from h2o.tasks import streaming as task, streaming_cli as cli, streaming_parts as parts

    assert streaming.StreamingTask is task.StreamingTask and streaming.Streamer is task.Streamer
    assert streaming.stream is task.stream and streaming.KeyShifter is task.KeyShifter
    assert streaming_cli.main is cli.main and streaming_cli.run is cli.run
    assert stream_parts.build_policy is parts.build_policy and stream_parts.Windows is parts.Windows


def test_the_task_config_and_an_older_record_build_one_task():
    node = OmegaConf.load(CONF / "task" / "bench_streaming.yaml")
    assert node._target_ == "h2o.tasks.streaming.StreamingTask"
    older = OmegaConf.merge(node, {"_target_": "h2o.bench.streaming.StreamingTask"})  # a record's config.yaml
    assert instantiate(node) == instantiate(older) and type(instantiate(older)).__module__ == "h2o.tasks.streaming"


@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")  # runpy: the module was imported before
@pytest.mark.parametrize("module", ["h2o.bench.streaming", "h2o.tasks.streaming"])
def test_python_m_runs_the_command_line(module, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [module, "--help"])
    with pytest.raises(SystemExit) as e:
        runpy.run_module(module, run_name="__main__")
    assert e.value.code == 0 and "usage: python -m h2o.bench.streaming" in capsys.readouterr().out
