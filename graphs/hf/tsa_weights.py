"""A GPT-2 directory's weights as a TSA decoder's (graphs/tsa.py), for `adaptex train tsa --init DIR`."""
from __future__ import annotations

from adaptex.graphs.errors import CheckpointError
from adaptex.graphs.hf import is_decoder_dir, load_decoder


def gpt2_as_tsa(path: str):
    """A GPT-2 directory as a TSA decoder: learned positions, LayerNorms, fused QKV and the tied head map
    one to one; GPT-2's tanh GELU becomes TSA's exact GELU (a few 1e-4 apart: distillation from the
    original closes it). LLaMA (RMSNorm, rotary positions, SwiGLU) has no TSA counterpart. Returns
    (TSAConfig kwargs, init state dict, teacher (ids, mask) -> logits, tokenizer spec, record)."""
    if not is_decoder_dir(path):
        raise CheckpointError(f"--init {path}: a Hugging Face encoder; TSA is a decoder: start from a GPT-2 directory or "
                              "an adaptex decoder checkpoint (put elastic routers on an encoder: adaptex train elastic)")
    net, tok, info = load_decoder(path)
    c = net.cfg
    if c.layout != "gpt2":
        raise CheckpointError(f"--init {path}: a {c.layout} directory; TSA's blocks (LayerNorm, learned or sinusoid "
                              "positions, GELU FFN) map GPT-2 only; put elastic routers on it instead (adaptex train "
                              "elastic --backbone DIR --data FILE)")
    if not c.tie_embeddings or c.activation not in ("gelu_new", "gelu_pytorch_tanh", "gelu"):
        raise CheckpointError(f"--init {path}: a GPT-2 with {'an untied head' if not c.tie_embeddings else c.activation}; "
                              "TSA ties its head to the embeddings and computes GELU")
    kw = dict(vocab_size=c.vocab_size, d_model=c.d_model, num_heads=c.num_heads, num_layers=c.num_layers,
              d_ff=c.d_ff, max_len=c.max_len, positions="learned", ln_eps=c.norm_eps, pad_id=c.pad_id)
    init = {"tok.weight": net.wte.weight, "pos_emb.weight": net.wpe.weight,
            "ln_f.weight": net.ln_f.weight, "ln_f.bias": net.ln_f.bias}
    for i, blk in enumerate(net.h):
        pre = f"blocks.{i}."
        init.update({pre + "ln1.weight": blk.ln_1.weight, pre + "ln1.bias": blk.ln_1.bias,
                     pre + "ln2.weight": blk.ln_2.weight, pre + "ln2.bias": blk.ln_2.bias,
                     pre + "attn.qkv.weight": blk.attn.c_attn.weight.t(), pre + "attn.qkv.bias": blk.attn.c_attn.bias,
                     pre + "attn.proj.weight": blk.attn.c_proj.weight.t(), pre + "attn.proj.bias": blk.attn.c_proj.bias,
                     pre + "ffn.0.weight": blk.mlp.c_fc.weight.t(), pre + "ffn.0.bias": blk.mlp.c_fc.bias,
                     pre + "ffn.2.weight": blk.mlp.c_proj.weight.t(), pre + "ffn.2.bias": blk.mlp.c_proj.bias})
    init = {k: v.detach().clone().contiguous() for k, v in init.items()}
    teacher = lambda ids, mask: net.dense(ids, mask)[0]
    return kw, init, teacher, tok.spec(), {"path": info["path"], "sha256": info["sha256"], "layout": "gpt2"}
