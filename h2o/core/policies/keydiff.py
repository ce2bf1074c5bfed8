"""keydiff: keep the keys least like their mean direction (KeyDiff, Park et al., arXiv 2504.15364), as kvpress
0.5.5's KeyDiffPress: the anchor ``a[k] = mean_j K[k, j] / |K[k, j]|`` over the held keys of KV head k (after RoPE),
``s[k, j] = -cos(K[k, j], a[k])``. At the end of a prompt only (kvpress's form; the paper's is block-wise, kvpress's
``BlockPress``; not built). Pads and empty slots are left out of the anchor (kvpress has no padding). Computed in
at least fp32 (kvpress: the keys' dtype; the same in fp32)."""
import torch
import torch.nn.functional as F

from .prefill import PrefillOnly


class KeyDiff(PrefillOnly):
    name = "keydiff"
    reads_keys = True

    def cut_score(self, acc, keys, held) -> torch.Tensor:
        """keys (B, H, S, D), held (B, H, S) bool -> (B, H, S) fp32."""
        k = keys.to(torch.promote_types(keys.dtype, torch.float32))
        unit = F.normalize(k, p=2, dim=-1) * held[..., None]  # (B, H, S, D), not held: 0
        anchor = unit.sum(2, keepdim=True) / held.sum(-1).clamp(min=1)[..., None, None]  # (B, H, 1, D)
        return -F.cosine_similarity(k, anchor, dim=-1)
