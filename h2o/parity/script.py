"""What the reference scripts (``python -m h2o.parity.{r_kv,g_kv,snapkv_d,baselines,triattention} --reference DIR
[--golden]``) share: their command line, the reference checkout's commit, and the end of a run: the summary
printed, and with ``--golden`` the record written (``made_by``, ``reference``, the committed tiny model, then the
script's own fields, in that order)."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path


def arguments(module: str, doc: str, reference: str, record: Path, argv=None, before: tuple = (),
              after: tuple = ()) -> argparse.Namespace:
    """``--reference`` (required; ``reference``: its help), ``--golden`` (write ``record``), and the script's own
    options as ``(flag, add_argument's keywords)``: ``before`` ``--golden`` and ``after`` it."""
    ap = argparse.ArgumentParser(prog=f"python -m {module}", description=doc.splitlines()[0])
    ap.add_argument("--reference", required=True, help=reference)
    for flag, options in before:
        ap.add_argument(flag, **options)
    ap.add_argument("--golden", action="store_true", help=f"write the golden numbers ({record})")
    for flag, options in after:
        ap.add_argument(flag, **options)
    return ap.parse_args(argv)


def commit(root: Path | str, given: str | None = None) -> str | None:
    """The checkout's HEAD (``given`` instead, where DIR is an export); None where neither says one."""
    return (given or subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                                    text=True).stdout).strip() or None


def report(a: argparse.Namespace, module: str, record: Path, printed, reference: dict, fields: dict) -> int:
    """Print ``printed``; with ``--golden``, write ``record``: who made it, ``reference`` (the repository, its
    commit, its files), the committed tiny model's folder and sha256, then ``fields``."""
    from h2o.parity.golden import MODEL_DIR, weights_sha256
    from h2o.parity.pairs import GOLDEN

    print(json.dumps(printed, indent=1))
    if a.golden:
        out = {"made_by": f"python -m {module} --reference DIR --golden", "reference": reference,
               "model": {"folder": str(MODEL_DIR.relative_to(GOLDEN.parents[2])), "sha256": weights_sha256()},
               **fields}
        record.write_text(json.dumps(out, separators=(",", ":")) + "\n")
        print(f"golden numbers: {record}", file=sys.stderr)
    return 0
