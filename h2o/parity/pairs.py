"""The methods ``make parity`` compares: each kvpress press beside the harness policy with the same rule, shared
by the driver (:mod:`h2o.parity.driver`) and its table (:mod:`h2o.parity.table`)."""
from __future__ import annotations

from pathlib import Path

# the golden numbers CI compares with (h2o.parity.golden records them; h2o.parity.table cites them)
GOLDEN = Path(__file__).resolve().parents[2] / "tests" / "data" / "parity_golden"
RECORD = GOLDEN / "kvpress.json"
RKV_RECORD = GOLDEN / "r_kv.json"  # R-KV's reference scoring (h2o.parity.r_kv)
GKV_RECORD = GOLDEN / "g_kv.json"  # G-KV's reference scoring (h2o.parity.g_kv)
SNAPKV_D_RECORD = GOLDEN / "snapkv_d.json"  # the minghui-liu/kvpress fork's SnapKV-D (h2o.parity.snapkv_d)
BASELINES_RECORD = GOLDEN / "baselines.json"  # TriAttention's own baselines, the fork's H2O (h2o.parity.baselines)
TRI_RECORD = GOLDEN / "triattention.json"  # TriAttention's reference code (h2o.parity.triattention)
TRI_HEAD_RECORD = GOLDEN / "triattention_per_head.json"  # the same in its per_head_pruning (--per-head-pruning)
# largest |NLL per token, kvpress - ours| accepted: fp32 on CPU, two attention implementations (kvpress's sdpa
# or eager under transformers 5.2, the harness's own); the equal methods differ by < 1e-6 (kvpress.json's
# "largest_gap" is the figure measured when it was recorded), one token chosen differently moves it by > 1e-3
TOLERANCE = 2e-5

# kvpress method -> the harness policy with the same rule ((name, options), None: not built yet)
OURS = {
    "full": ("full", {}),
    "streaming_llm": ("streaming_llm", {"sinks": 4}),
    "observed_attention": ("h2_only", {"score": "mean"}),
    "tova": ("tova", {}), "snapkv": ("snapkv", {}), "pyramidkv": ("pyramidkv", {}),
    # kvpress masks Ada-KV's removed keys (a fake key per head) and frees nothing; ours evicts, heads stored padded
    "adakv_snapkv": ("adakv", {"inner": "snapkv"}),
    "knorm": ("knorm", {}), "keydiff": ("keydiff", {}),
    "expected_attention": ("expected_attention", {}), "random": ("random", {"seed": 0}),
    # kvpress masks KVzip's removed keys as Ada-KV's; ours evicts, layers and heads stored padded
    "kvzip": ("kvzip", {}),
    # a diagnostic of the decoding timing, not a kvpress method: StreamingLLMPress with its kept tokens left in
    # position order (tools/parity/kvpress_side.py)
    "streaming_llm_ordered": ("streaming_llm", {"sinks": 4}),
}
EXTRA = {"h2o": ("h2o", {})}  # ours without a kvpress counterpart, shown beside the nearest one (observed_attention)
DECODE = ("streaming_llm", "streaming_llm_ordered", "knorm", "keydiff", "random")  # with a decoding timing here
# ours given the share kept 1 - r: pyramidkv's layer budgets start from L * (1 - r) unrounded; kvzip prunes
# int(numel * r) over all layers and heads
RATIO_BUDGET = ("pyramidkv", "kvzip")
DECODE_ONLY = {"streaming_llm_ordered": "streaming_llm"}  # diagnostic rows: ours is the named method's record


def kept(context_len: int, ratio: float) -> int:
    """kvpress's tokens kept for ``compression_ratio`` ratio: ``int(L * (1 - r))``."""
    return int(context_len * (1 - ratio))
