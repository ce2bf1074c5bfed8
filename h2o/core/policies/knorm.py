"""knorm: keep the keys of lowest L2 norm (KNorm, Devoto et al., arXiv 2406.11430), as kvpress 0.5.5's KnormPress:
``s[k, j] = -|K[k, j]|_2`` of the cached key after RoPE, the norm taken in at least fp32, per KV head; no sinks, no
window. At the end of a prompt only (a per-key score makes a decoding form natural; not built)."""
import torch

from .prefill import PrefillOnly


class Knorm(PrefillOnly):
    name = "knorm"
    reads_keys = True

    def cut_score(self, acc, keys, held) -> torch.Tensor:
        """keys (B, H, S, D) -> (B, H, S) fp32 (fp64 for fp64 keys)."""
        return -torch.linalg.vector_norm(keys, dim=-1, dtype=torch.promote_types(keys.dtype, torch.float32))
