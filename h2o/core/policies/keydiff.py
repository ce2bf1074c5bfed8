"""keydiff: keep the keys least like their mean direction (KeyDiff, Park et al., arXiv 2504.15364), as kvpress
0.5.5's KeyDiffPress: the anchor ``a[k] = mean_j K[k, j] / |K[k, j]|`` over the held keys of KV head k (after RoPE),
``s[k, j] = -cos(K[k, j], a[k])``. Pads and empty slots are left out of the anchor (kvpress has no padding).
Computed in at least fp32 (kvpress: the keys' dtype; the same in fp32). The paper's block-wise form (kvpress's
``BlockPress``) is not built.

Timings: ``compress=prefill`` (kvpress's, the default): the prompt cut once to the budget. ``compress=decode``:
kvpress's ``DecodingPress(KeyDiffPress, compression_interval=1, target_size=total - 1)`` after a prefilling
KeyDiffPress to ``total - 1``: the prompt is cut to ``total - 1`` (the anchor over the whole prompt) and each
arriving token takes the slot of the held key most like the anchor of the held older keys (the arriving key not
in it), exact ties as kvpress's ``topk`` decides (:mod:`.decoding_press`; docs/methods.md). No Triton row kernel: on CUDA the simulated path runs
the torch row loop (one-line notice)."""
import torch
import torch.nn.functional as F

from .base import READ_KEYS
from .decoding_press import DecodingOrder


class KeyDiff(DecodingOrder):
    name = "keydiff"
    reads = frozenset({READ_KEYS})  # the held keys after RoPE, at the cut and at each decoding step

    def cut_score(self, acc, keys, held) -> torch.Tensor:
        """keys (B, H, S, D), held (B, H, S) bool -> (B, H, S) fp32."""
        k = keys.to(torch.promote_types(keys.dtype, torch.float32))
        unit = F.normalize(k, p=2, dim=-1) * held[..., None]  # (B, H, S, D), not held: 0
        anchor = unit.sum(2, keepdim=True) / held.sum(-1).clamp(min=1)[..., None, None]  # (B, H, 1, D)
        return -F.cosine_similarity(k, anchor, dim=-1)
