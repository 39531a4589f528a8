"""Small random-initialised Hugging Face directories, written with transformers' save_pretrained and
a tokenizers WordLevel vocabulary: the layouts adaptex loads, nothing downloaded.

Every parameter is perturbed before saving: transformers starts LayerNorm and most linear biases at
zero and norm weights at one, so a loader that never copied them would load the same model."""
from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = ("the a an of to in on at by for with from as is was be are were it this that these those and or but "
         "not no yes model data file line text token head layer router cache window sink stream dense sparse "
         "train eval check export . ,").split()
LAYOUTS = ("gpt2", "llama", "roberta", "distilbert", "bert")
VOCAB = 72


def tokenizer(specials: list[str], template: tuple[str, str] | None = None, unk: str = "<unk>"):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {t: i for i, t in enumerate(specials + list(WORDS))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if template:
        first, last = template
        tok.post_processor = processors.TemplateProcessing(
            single=f"{first} $A {last}", special_tokens=[(first, vocab[first]), (last, vocab[last])])
    return tok


def _model(layout: str, seed: int):
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(initializer_range=0.1)
    if layout == "gpt2":
        cfg = tf.GPT2Config(vocab_size=VOCAB, n_positions=128, n_embd=32, n_layer=2, n_head=4, bos_token_id=2,
                            eos_token_id=2, **common)
        return tf.GPT2LMHeadModel(cfg), tokenizer(["<pad>", "<unk>", "<|endoftext|>"])
    if layout == "llama":
        cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, bos_token_id=2,
                             eos_token_id=3, pad_token_id=0, **common)
        return tf.LlamaForCausalLM(cfg), tokenizer(["<pad>", "<unk>", "<s>", "</s>"])
    if layout == "roberta":
        cfg = tf.RobertaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                               intermediate_size=64, max_position_embeddings=130, type_vocab_size=1, pad_token_id=1,
                               bos_token_id=0, eos_token_id=2, **common)
        return tf.RobertaModel(cfg, add_pooling_layer=False), tokenizer(["<s>", "<pad>", "</s>", "<unk>"], ("<s>", "</s>"))
    if layout == "distilbert":
        cfg = tf.DistilBertConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                                  max_position_embeddings=128, **common)
        return tf.DistilBertModel(cfg), tokenizer(["[PAD]", "[UNK]", "[CLS]", "[SEP]"], ("[CLS]", "[SEP]"), "[UNK]")
    if layout == "bert":  # adaptex's BERT loader wants the tokenizer's vocabulary to be the embedding's rows
        cfg = tf.BertConfig(vocab_size=4 + len(WORDS), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=64, max_position_embeddings=128, **common)
        return tf.BertModel(cfg, add_pooling_layer=False), tokenizer(["[PAD]", "[UNK]", "[CLS]", "[SEP]"],
                                                                     ("[CLS]", "[SEP]"), "[UNK]")
    raise ValueError(layout)


def perturb(model, seed: int, scale: float = 0.05) -> None:
    """Every parameter moved by seeded noise of `scale` (a tied one once), so that none is zero or one."""
    import torch

    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)


def make(layout: str, root: Path, seed: int = 0) -> Path:
    """A directory of `layout` (gpt2, llama, roberta, distilbert, bert) under root: config.json,
    model.safetensors, tokenizer.json; every parameter perturbed."""
    model, tok = _model(layout, seed)
    perturb(model, seed)
    path = Path(root) / layout
    model.eval().save_pretrained(path)
    tok.save(str(path / "tokenizer.json"))
    return path


def corpus(path: Path, lines: int = 240, seed: int = 0) -> Path:
    """A text file of short sentences in the test vocabulary, with paragraph breaks."""
    r = random.Random(seed)
    with open(path, "w") as f:
        for i in range(lines):
            f.write(" ".join(r.choice(WORDS[:-2]) for _ in range(r.randint(4, 18))) + " .\n")
            if i % 9 == 8:
                f.write("\n")
    return path


def jsonl(path: Path, lines: int = 240, seed: int = 0, ids: bool = False) -> Path:
    """A classification file: the label is the cue word each line carries."""
    r = random.Random(seed)
    cues = {"dense": "dense", "sparse": "sparse", "stream": "stream"}
    with open(path, "w") as f:
        for _ in range(lines):
            label = r.choice(sorted(cues))
            words = [r.choice(WORDS[:30]) for _ in range(r.randint(3, 14))]
            words.insert(r.randint(0, len(words)), cues[label])
            row = {"ids": [WORDS.index(w) + 4 for w in words]} if ids else {"text": " ".join(words)}
            f.write(json.dumps({**row, "label": label}) + "\n")
    return path
