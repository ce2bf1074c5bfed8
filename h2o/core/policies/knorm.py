"""knorm: keep the keys of lowest L2 norm (KNorm, Devoto et al., arXiv 2406.11430), as kvpress 0.5.5's KnormPress:
``s[k, j] = -|K[k, j]|_2`` of the cached key after RoPE, the norm taken in at least fp32, per KV head; no sinks, no
window.

Timings: ``compress=prefill`` (kvpress's, the default): the prompt cut once to the budget. ``compress=decode``:
kvpress's ``DecodingPress(KnormPress, compression_interval=1, target_size=total - 1)`` after a prefilling
KnormPress to ``total - 1``: the prompt is cut to ``total - 1`` and each arriving token takes the slot of the held
key of highest norm (exact ties as kvpress's ``topk`` on its slot order decides, :mod:`.decoding_press`), so every
query sees ``total`` keys, itself included (docs/methods.md).
No Triton row kernel: on CUDA the simulated path runs the torch row loop (one-line notice)."""
import torch

from .base import READ_KEYS
from .decoding_press import DecodingOrder


class Knorm(DecodingOrder):
    name = "knorm"
    reads = frozenset({READ_KEYS})  # the held keys after RoPE, at the cut and at each decoding step

    def cut_score(self, acc, keys, held) -> torch.Tensor:
        """keys (B, H, S, D) -> (B, H, S) fp32 (fp64 for fp64 keys)."""
        return -torch.linalg.vector_norm(keys, dim=-1, dtype=torch.promote_types(keys.dtype, torch.float32))
