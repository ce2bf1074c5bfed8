"""One small interface between the eviction core and the rest (h2o.core.engine): nothing outside ``h2o/core`` reads a
policy's flags (every flag a policy class declares), one module outside ``h2o/core/policies`` names the paper code's
rule, no function of the core takes more than 8 parameters (a constructor, transformers' attention-function
signature and Triton kernels aside); the engine's answers, and the record's held tokens under ``interval`` equal to
the evicting cache's."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

from h2o import make_policy
from h2o.assets.models import tiny_model
from h2o.core import engine
from h2o.core.policies import Policy
from h2o.tasks.kv_held import measured, simulated_held

ROOT = Path(__file__).resolve().parents[1] / "h2o"


def declared_flags(classes) -> set[str]:
    """The flags ``classes`` declare: class attributes that are no method (``schedule`` among them)."""
    return {k for cls in classes for k, v in vars(cls).items() if not k.startswith("_") and not callable(v)
            and not isinstance(v, (property, staticmethod, classmethod))} - {"name", "registry"}


def policy_flags() -> set[str]:
    """Every flag a policy class declares (:func:`declared_flags`) and what follows from them (the Policy's
    properties: ``is_full``, ``needs_scores``, ``reads_keys``...); not its schedule's spelling (``compress``,
    ``interval``: the run's config, in every record) nor ``quant`` (a notice of its second spelling)."""
    derived = {k for cls in [Policy, *Policy.registry.values()] for k, v in vars(cls).items()
               if isinstance(v, property)}  # a rule's own answers too (triattention's needs_calibration)
    return (declared_flags([Policy, *Policy.registry.values()]) | derived) - {"compress", "interval", "quant"}


def test_the_policy_interface_declares_at_most_8_flags_the_rest_follows():
    """Issue 47: what a rule declares is at most 8 flags; ``needs_scores``, ``reads_keys``, ``reads_queries``,
    ``reads_logits`` follow from ``reads``, ``position_only`` and ``window_closed_form`` from ``closed_form``,
    ``whole_forward`` from the rule defining ``forward_mask``."""
    own = declared_flags([Policy])
    assert own == {"evicts", "reads", "closed_form", "splits", "pooled", "schedule", "real_only", "cut_room"}
    derived = {"needs_scores", "reads_keys", "reads_queries", "reads_logits", "position_only", "window_closed_form",
               "whole_forward"}
    assert derived <= policy_flags() and not derived & declared_flags([Policy])
    rules = {name: make_policy(name) for name in ("r_kv", "h2o", "knorm", "expected_attention", "local", "fixed")}
    assert [n for n, p in rules.items() if p.reads_logits] == ["r_kv"]
    assert [n for n, p in rules.items() if p.reads_keys] == ["r_kv", "knorm"]
    assert [n for n, p in rules.items() if p.reads_queries] == ["expected_attention"]
    assert [n for n, p in rules.items() if p.window_closed_form] == ["local"]
    assert [n for n, p in rules.items() if p.position_only] == ["local", "fixed"]
    assert make_policy("h2o_reference").whole_forward and not make_policy("h2o").whole_forward


FLAGS = re.compile(r"(?<!engine)\.(" + "|".join(sorted(policy_flags())) + r")\b")  # engine.<flag>(...): its answer


def sources(under: Path, outside: Path | None = None) -> list[Path]:
    return [f for f in sorted(under.rglob("*.py")) if outside is None or outside not in f.parents]


def test_nothing_outside_the_core_reads_a_policys_flags():
    """Every flag of every registered policy class (:func:`policy_flags`: 18 names; three before issue 47)."""
    assert {"evicts", "pooled", "reads", "real_only", "reads_logits", "whole_forward", "schedule",
            "needs_scores", "needs_calibration"} <= policy_flags()
    found = [f"{f.relative_to(ROOT)}:{n}" for f in sources(ROOT, ROOT / "core")
             for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1)
             if FLAGS.search(line) and not line.lstrip().startswith(("from ", "import "))]
    assert found == []


def test_one_module_outside_the_policies_names_the_paper_codes_rule():
    naming = [str(f.relative_to(ROOT)) for f in sources(ROOT, ROOT / "core" / "policies")
              if engine.PAPER_RULE in f.read_text(encoding="utf-8")]
    assert naming == ["core/engine.py"]


def parameters(fn: ast.FunctionDef) -> int:
    a = fn.args
    names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)] + [x.arg for x in (a.vararg, a.kwarg) if x]
    return len([n for n in names if n not in ("self", "cls")])


def test_no_core_function_takes_more_than_eight_parameters():
    exempt = {"__init__", "h2o_attention"}  # a policy's constructor; transformers' attention-function signature
    over = []
    for f in sources(ROOT / "core"):
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.FunctionDef) or node.name in exempt:
                continue
            if any("triton" in ast.unparse(d) for d in node.decorator_list):  # a Triton kernel
                continue
            if parameters(node) > 8:
                over.append(f"{f.relative_to(ROOT)}:{node.name} ({parameters(node)})")
    assert over == []


def test_the_engines_answers():
    assert engine.keeps_all(make_policy("full")) and engine.keeps_all(make_policy("h2o", budget=1.0))
    assert not engine.keeps_all(make_policy("h2o", budget=0.2))
    assert engine.drops_tokens(make_policy("h2o")) and not engine.drops_tokens(make_policy("topk"))
    assert engine.compresses_once(make_policy("snapkv")) and not engine.compresses_once(make_policy("h2o"))
    assert not engine.compresses_once(make_policy("h2o", budget=1.0, compress="prefill"))
    assert engine.held_budget(make_policy("h2o", budget=0.2), 100) == 20  # 10 heavy + 10 recent
    assert engine.held_budget(make_policy("full"), 100) == 100
    every = make_policy("h2o", budget=0.2, compress="interval", interval=4)
    assert engine.held_by_formula(every, [None, None]) and not engine.held_by_formula(every, [16, None])
    assert engine.held_by_formula(make_policy("h2o"), [16]) and not engine.held_by_formula(make_policy("adakv"), [None])
    assert engine.whole_forward(make_policy(engine.PAPER_RULE)) and not engine.whole_forward(make_policy("h2o"))
    assert engine.as_paper_rule(make_policy("h2o")).name == engine.PAPER_RULE


@pytest.mark.parametrize("context", [32, None])
@pytest.mark.parametrize("every", [1, 3, 5])
def test_the_interval_formula_is_the_evicting_caches_footprint(context, every):
    """The record's held tokens under ``interval`` (h2o.core.schedule.Schedule.held) are what the cache holds after
    the window's prompt and its continuation, one token at a time."""
    W = 48
    model = tiny_model("llama_gqa", seed=3)
    ids = torch.randint(3, 128, (2, W), generator=torch.Generator().manual_seed(5))
    policy = make_policy("h2o", budget=0.3, compress="interval", interval=every)
    cut, end = measured(model, policy, ids, context, batch=2)
    held = simulated_held(model, policy, W, context)
    if context:
        assert (held["kv_tokens_cut"], held["kv_bytes_cut"]) == (cut["tokens_held"], cut["bytes_held"])
    assert (held["kv_tokens_end"], held["kv_bytes_end"]) == (end["tokens_held"], end["bytes_held"])
