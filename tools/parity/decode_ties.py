"""knorm in the decoding timing by hand, two tie orders: where kvpress's and the harness's records differ.

kvpress's ``PrefillDecodingPress(KnormPress to n - 1, DecodingPress(KnormPress, compression_interval=1,
target_size=n - 1))`` written out on transformers' ``DynamicCache``: the context prefilled and pressed to ``n - 1``
keys per KV head, each continuation token fed alone (positions L, L + 1, ...) and the layer's ``n`` keys pressed
back to ``n - 1`` after it. ``--ties topk``: kvpress's own selection, ``torch.topk`` on the row in kvpress's slot
order (the kept keys gathered in ``topk`` order, the newest appended last); ``--ties oldest``: the oldest of exactly
tied keys goes (``select_slot``'s tie rule), the kept keys in position order. Prints the NLL per token of each
prompt's continuation (docs/methods.md, "Measured": ``topk`` gives kvpress's records and the harness's, which carry
kvpress's slot order; ``oldest`` shows what the tie order alone moves).

Runs in the harness's virtualenv (no kvpress):
    PYTHONPATH=. python tools/parity/decode_ties.py --prompts studies/parity/prompts.json --ties topk
"""
from __future__ import annotations

import argparse
import json

import torch
from transformers import DynamicCache


def press(cache, pos: list[torch.Tensor], n: int, ties: str) -> None:
    """Every layer of ``cache`` pressed to its ``n`` keys of lowest norm per KV head; ``pos`` (1, H, S) per layer,
    each slot's position, moves along."""
    for i, layer in enumerate(cache.layers):
        score = -layer.keys.float().norm(dim=-1)  # (1, H, S), KnormPress's score
        if ties == "topk":
            idx = score.topk(n, dim=-1).indices  # (1, H, n) in topk order, as kvpress gathers
        else:  # drop the S - n lowest, the oldest first among exact ties; the rest in position order
            rank = torch.argsort(pos[i], dim=-1, descending=True)  # newest first, then a stable sort by score
            order = rank.gather(-1, torch.argsort(score.gather(-1, rank), dim=-1, descending=True, stable=True))
            idx = order[..., :n]
            idx = idx.gather(-1, pos[i].gather(-1, idx).argsort(-1))  # (1, H, n) in position order
        gather = idx[..., None].expand(-1, -1, -1, layer.keys.shape[-1])
        layer.keys, layer.values = layer.keys.gather(2, gather), layer.values.gather(2, gather)
        pos[i] = pos[i].gather(-1, idx)


def continuation_nll(model, context, cont, n: int, ties: str) -> float:
    """context (1, L), cont (1, m) -> NLL per token of ``cont`` (the first predicted by the context's last
    logits), through the pressed cache."""
    L = context.shape[1]
    cache = DynamicCache()
    with torch.no_grad():
        out = [model(context, cache=cache, use_cache=True).logits[0, -1:]]
        H = cache.layers[0].keys.shape[1]
        pos = [torch.arange(L).view(1, 1, L).expand(1, H, L).clone() for _ in cache.layers]
        press(cache, pos, n - 1, ties)
        for t in range(cont.shape[1] - 1):
            pos = [torch.cat([p, torch.full((1, H, 1), L + t)], -1) for p in pos]
            out.append(model(cont[:, t:t + 1], cache=cache, position_ids=torch.tensor([[L + t]])).logits[0])
            press(cache, pos, n - 1, ties)
    logp = torch.log_softmax(torch.cat(out).float(), -1)
    return -logp.gather(-1, cont[0][:, None]).sum().item() / cont.shape[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", required=True, help="a make parity prompts.json (token ids)")
    ap.add_argument("--ties", choices=("topk", "oldest"), required=True)
    ap.add_argument("--ratio", type=float, default=0.8, help="kvpress's compression_ratio (share removed)")
    a = ap.parse_args()
    from h2o.assets.models import load_model, smollm2_path

    torch.set_num_threads(1)
    model, _ = load_model(str(smollm2_path()), dtype="float32")
    for p in json.loads(open(a.prompts).read())["ppl"]:
        context, cont = torch.tensor([p["context"]]), torch.tensor([p["continuation"]])
        n = int(context.shape[1] * (1 - a.ratio))  # kvpress's kept count; the harness's budget n
        print(f"knorm decode ties={a.ties} {p['id']}: nll/token {continuation_nll(model, context, cont, n, a.ties):.6f}",
              flush=True)


if __name__ == "__main__":
    main()
