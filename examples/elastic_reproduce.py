"""Elastic Attention on held-out text: the fraction of streaming (SA) heads and how close the model
stays to full attention, against random routing at the same SA fraction.

    python examples/elastic_reproduce.py [MODEL] [--n 200] [--max-tokens 256]
    python examples/elastic_reproduce.py elastic-charlm [--n 64] [--max-tokens 512]

MODEL is an elastic checkpoint (default: the shipped elastic-minilm; 'adaptex train elastic' writes
new ones). Held-out text: the json and email packages of the Python standard library, which training
never sees. MiniLM: the sentence embedding's cosine to full attention; acceptance (issue 5): >= 50%
SA heads at mean cosine >= 0.98. The elastic decoder (elastic-charlm): next-character loss against
full attention on windows of --max-tokens characters.
"""
import argparse
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from adaptex.graphs import checkpoint  # noqa: E402
from adaptex.graphs.elastic import StdlibText, evaluate_elastic, summary_table_elastic  # noqa: E402
from adaptex.graphs.minilm import MiniLMTokenizer, default_model_dir  # noqa: E402


@torch.no_grad()
def random_routing(model, tok, text, n, max_tokens, fraction, seed=1):
    """Mean cosine when each head is SA with probability `fraction`, independently of the input."""
    rng, g = np.random.default_rng(seed), torch.Generator().manual_seed(seed)
    cos = []
    for start in range(0, n, 16):
        ids, mask = tok.encode(text.sample(min(16, n - start), rng, split="val"), max_length=max_tokens)
        full, _ = model(ids, mask, mode="full")
        force = [torch.rand(ids.shape[0], model.cfg.num_heads, generator=g) < fraction for _ in model.routers]
        emb, _ = model(ids, mask, mode="hard", force_sa=force)
        cos.append(F.cosine_similarity(emb, full, dim=-1))
    return float(torch.cat(cos).mean())


@torch.no_grad()
def random_routing_decoder(model, task, n, context, fraction, seed=1):
    """Elastic decoder: held-out loss when each head is SA with probability `fraction`."""
    rng, g = np.random.default_rng(seed), torch.Generator().manual_seed(seed)
    losses = []
    for start in range(0, n, 8):
        s = rng.integers(0, len(task.val) - context - 1, size=min(8, n - start))
        seq = torch.from_numpy(np.stack([task.val[i:i + context + 1] for i in s]).astype(np.int64))
        force = [torch.rand(len(s), model.cfg.num_heads, generator=g) < fraction for _ in model.routers]
        logits, _, _ = model(seq[:, :-1], mode="hard", force_sa=force)
        losses.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), seq[:, 1:].reshape(-1)))
    return float(torch.stack(losses).mean())


def decoder(model, a):
    from adaptex.graphs.recipes.elastic_decoder import evaluate_elastic_decoder, summary_table_decoder
    from adaptex.graphs.lm_tasks import StdlibChars

    context = a.max_tokens or 512
    task = StdlibChars(context=context)
    r = evaluate_elastic_decoder(model, task, n=a.n or 64, context=context)
    print(summary_table_decoder(r, model.cfg))
    rand = random_routing_decoder(model, task, a.n or 64, context, r["sa_fraction"])
    print(f"random routing at the same SA fraction: loss {rand:.4f} ({100 * (rand / r['full_loss'] - 1):+.2f}% "
          "against full attention)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="elastic-minilm")
    ap.add_argument("--n", type=int, default=None, help="held-out passages (default 200; decoder windows: 64)")
    ap.add_argument("--max-tokens", type=int, default=None, help="default 256 tokens (MiniLM), 512 characters (decoder)")
    a = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    model, info = checkpoint.load(a.model)
    if info["family"] == "elastic_decoder":
        return decoder(model, a)
    a.n, a.max_tokens = a.n or 200, a.max_tokens or 256
    tok = MiniLMTokenizer(default_model_dir() / "tokenizer.json")
    text = StdlibText()
    r = evaluate_elastic(model, tok, text, n=a.n, max_tokens=a.max_tokens, split="val")
    print(summary_table_elastic(r, model.cfg))
    rand = random_routing(model, tok, text, a.n, a.max_tokens, r["sa_fraction"])
    print(f"random routing at the same SA fraction: mean cosine {rand:.4f}")
    ok = r["sa_fraction"] >= 0.5 and r["mean_cosine"] >= 0.98
    print(f"acceptance (>= 50% SA at mean cosine >= 0.98): {'met' if ok else 'NOT met'}")


if __name__ == "__main__":
    main()
