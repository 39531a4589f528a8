"""Hugging Face checkpoints, offline, as frozen backbones for Elastic Attention routers.

A directory holding config.json, model.safetensors and tokenizer.json (what transformers'
save_pretrained and the tokenizers library write) loads without transformers: the forward passes
are adaptex's own (graphs/minilm.py for BERT, RoBERTa and DistilBERT; graphs/hf/decoders.py for
GPT-2 and LLaMA), the weights read with safetensors, and nothing in the directory is executed.
"""
from adaptex.graphs.hf.common import LAYOUTS, model_type  # noqa: F401
from adaptex.graphs.hf.decoders import DECODERS, HFDecoder, HFDecoderConfig  # noqa: F401
from adaptex.graphs.hf.encoders import ENCODERS, load_encoder  # noqa: F401
from adaptex.graphs.hf.loading import decoder_config, load_decoder  # noqa: F401


def is_decoder_dir(path) -> bool:
    """A Hugging Face directory of a decoder layout (GPT-2, LLaMA)."""
    from pathlib import Path

    p = Path(path)
    if not (p.is_dir() and (p / "config.json").is_file()):
        return False
    try:
        return model_type(p) in DECODERS
    except Exception:
        return False
