"""Hugging Face decoder directories -> graphs.hf.decoders models: config.json parsed (a value the
implementation does not compute is refused, naming the key), weights filled by name, the
tokenizer.json wrapped."""
from __future__ import annotations

from pathlib import Path

from adaptex.graphs.tokenizers import JsonTokenizer
from adaptex.graphs.errors import CheckpointError
from adaptex.graphs.hf.common import (CONFIG, TOKENIZER, check_dir, fill, load_state, need, read_config, refuse, sha256,
                                      strip_prefix)
from adaptex.graphs.hf.decoders import DECODERS, HFDecoder, HFDecoderConfig


def _arch(hf: dict, path: Path, stem: str, default: str) -> None:
    archs = hf.get("architectures") or [default]
    if not all(isinstance(a, str) and a.startswith(stem) for a in archs):
        raise CheckpointError(f"{path / CONFIG}: architectures {archs} found, expected a {stem} model ('{default}')")


def _pad(hf: dict, vocab: int) -> int:
    """The pad id parity and batching use (any id works: padded slots are masked); GPT-2 has none."""
    for key in ("pad_token_id", "eos_token_id", "bos_token_id"):
        v = hf.get(key)
        v = v[0] if isinstance(v, list) and v else v
        if isinstance(v, int) and 0 <= v < vocab:
            return v
    return 0


def gpt2_config(path: Path, hf: dict) -> HFDecoderConfig:
    _arch(hf, path, "GPT2", "GPT2LMHeadModel")
    for key, want in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                      ("add_cross_attention", False)):
        if hf.get(key, want) != want:
            raise refuse(path, key, hf[key], f"{key} = {str(want).lower()}")
    d, H, V = need(hf, "n_embd", path), need(hf, "n_head", path), need(hf, "vocab_size", path)
    act = hf.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh", "gelu", "relu"):
        raise refuse(path, "activation_function", act, "gelu_new, gelu_pytorch_tanh, gelu or relu")
    return HFDecoderConfig(layout="gpt2", vocab_size=V, d_model=d, num_heads=H, num_kv_heads=H, head_dim=d // H,
                           num_layers=need(hf, "n_layer", path), d_ff=int(hf.get("n_inner") or 4 * d),
                           max_len=need(hf, "n_positions", path), norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
                           pad_id=_pad(hf, V), activation=act, tie_embeddings=bool(hf.get("tie_word_embeddings", True)))


def _rope_theta(hf: dict, path: Path) -> float:
    rp = hf.get("rope_parameters")  # transformers 5; 4.x wrote rope_theta and rope_scaling
    if isinstance(rp, dict) and "full_attention" in rp:
        rp = rp["full_attention"]
    if isinstance(rp, dict):
        if rp.get("rope_type", "default") != "default":
            raise refuse(path, "rope_parameters.rope_type", rp["rope_type"], "the default rotary embedding")
        return float(rp.get("rope_theta", hf.get("rope_theta", 10000.0)))
    if hf.get("rope_scaling"):
        raise refuse(path, "rope_scaling", hf["rope_scaling"], "the default rotary embedding (rope_scaling null)")
    return float(hf.get("rope_theta", 10000.0))


def llama_config(path: Path, hf: dict) -> HFDecoderConfig:
    _arch(hf, path, "Llama", "LlamaForCausalLM")
    if hf.get("hidden_act", "silu") != "silu":
        raise refuse(path, "hidden_act", hf["hidden_act"], "hidden_act 'silu' (SwiGLU)")
    d, H, V = need(hf, "hidden_size", path), need(hf, "num_attention_heads", path), need(hf, "vocab_size", path)
    Hk = need(hf, "num_key_value_heads", path) if hf.get("num_key_value_heads") is not None else H
    return HFDecoderConfig(layout="llama", vocab_size=V, d_model=d, num_heads=H, num_kv_heads=Hk,
                           head_dim=need(hf, "head_dim", path) if hf.get("head_dim") else d // H,
                           num_layers=need(hf, "num_hidden_layers", path), d_ff=need(hf, "intermediate_size", path),
                           max_len=need(hf, "max_position_embeddings", path),
                           norm_eps=float(hf.get("rms_norm_eps", 1e-6)), pad_id=_pad(hf, V), activation="silu",
                           rope_theta=_rope_theta(hf, path), attention_bias=bool(hf.get("attention_bias", False)),
                           mlp_bias=bool(hf.get("mlp_bias", False)),
                           tie_embeddings=bool(hf.get("tie_word_embeddings", False)))


PARSERS = {"gpt2": (gpt2_config, "GPT-2"), "llama": (llama_config, "LLaMA")}


def decoder_config(path) -> HFDecoderConfig:
    path = check_dir(path)
    hf = read_config(path)
    kind = hf.get("model_type")
    if kind not in PARSERS:
        raise CheckpointError(f"{path / CONFIG}: model_type {kind!r} is not a decoder adaptex loads; expected one of "
                              f"{', '.join(PARSERS)} (or bert, roberta, distilbert for an encoder)")
    try:
        return PARSERS[kind][0](path, hf)
    except ValueError as e:
        raise CheckpointError(f"{path / CONFIG}: {e}") from None


def load_decoder(path) -> tuple[HFDecoder, JsonTokenizer, dict]:
    """(decoder in eval mode, frozen; its tokenizer; info with layout, path, sha256, config)."""
    cfg = decoder_config(path)
    path = Path(path)
    what = PARSERS[cfg.layout][1]
    net = DECODERS[cfg.layout](cfg)
    state = load_state(path, what)
    prefix, tensors = strip_prefix(state, net.anchor, path, what)
    if not cfg.tie_embeddings:  # the head sits outside the base model's prefix
        head = state.get("lm_head.weight", tensors.get("lm_head.weight"))
        if head is None:
            raise CheckpointError(f"{path}: tie_word_embeddings is false but lm_head.weight is missing; "
                                  "save the model with its LM head (e.g. LlamaForCausalLM)")
        tensors["lm_head.weight"] = head
    fill(net, tensors, path, prefix, what)
    net.eval()
    net.requires_grad_(False)
    try:
        text = (path / TOKENIZER).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path / TOKENIZER}: unreadable ({type(e).__name__}); restore the file") from None
    tok = JsonTokenizer(text, str(path / TOKENIZER), pad_id=cfg.pad_id)
    if tok.vocab_size > cfg.vocab_size:
        raise CheckpointError(f"{path / TOKENIZER}: the tokenizer has {tok.vocab_size} tokens but the embedding "
                              f"{cfg.vocab_size} rows; use the tokenizer.json that ships with these weights")
    info = {"layout": cfg.layout, "path": str(path.absolute()), "sha256": sha256(path), "config": cfg.to_dict()}
    return net, tok, info
