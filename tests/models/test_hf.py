"""Hugging Face checkpoints as frozen backbones: random-initialised GPT-2, LLaMA (grouped-query
attention), RoBERTa and DistilBERT directories written by transformers match transformers on their
dense path; every parameter loaded (BERT too) is its tensor in the file, by name; elastic routers
train on them from a text file, export to ONNX and Core ML, and pass `adaptex check`; the artifacts
carry the tokenizer; bad directories are one-line errors."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from adaptex.cli import main
from adaptex.graphs import checkpoint
from adaptex.graphs.errors import AdaptexError, CheckpointError
from adaptex.graphs.hf import load_decoder, load_encoder
from tests.support import hf_dirs, zoo

DECODERS, ENCODERS = ("gpt2", "llama"), ("roberta", "distilbert")


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {layout: hf_dirs.make(layout, root) for layout in hf_dirs.LAYOUTS}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return hf_dirs.corpus(tmp_path_factory.mktemp("text") / "corpus.txt")


def _batch(B=3, T=20, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, hf_dirs.VOCAB, (B, T), generator=g), torch.ones(B, T, dtype=torch.long)


@pytest.mark.parametrize("layout", DECODERS)
@torch.no_grad()
def test_decoder_dense_path_matches_transformers(dirs, layout):
    import transformers

    ids, mask = _batch()
    mask[1, :5] = 0  # left padding, as batched generation pads
    mask[2, :11] = 0
    net, tok, info = load_decoder(dirs[layout])
    ref = transformers.AutoModelForCausalLM.from_pretrained(dirs[layout]).eval()
    positions = (mask.cumsum(1) - 1).clamp(min=0)  # what generate() passes for a left-padded batch
    want = ref(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    got, presents = net(ids, mask)
    real = mask.bool()
    assert (got - want)[real].abs().max() < 1e-5 and want[real].abs().max() > 0.5
    cfg = net.cfg
    assert presents[0][0].shape == (3, cfg.num_kv_heads, 20, cfg.head_dim)
    if layout == "llama":
        assert cfg.num_kv_heads == 2 and cfg.num_heads == 4  # grouped-query attention
    # prefill then one token at a time on the cache: the same logits
    logits, past = net(ids[:, :12], mask[:, :12])
    steps = [logits]
    for t in range(12, 20):
        step, past = net(ids[:, t:t + 1], mask[:, :t + 1], past)
        steps.append(step)
    assert (torch.cat(steps, 1) - want)[real].abs().max() < 1e-5
    assert info["layout"] == layout and len(info["sha256"]) == 64 and tok.vocab_size == 3 + len(hf_dirs.WORDS) + (
        layout == "llama")


@pytest.mark.parametrize("layout", ENCODERS)
@torch.no_grad()
def test_encoder_dense_path_matches_transformers(dirs, layout):
    import transformers

    ids, mask = _batch()
    mask[1, 15:] = 0
    mask[2, 7:] = 0
    net, tok, info = load_encoder(dirs[layout])
    ids = ids.masked_fill(mask == 0, net.cfg.pad_id)
    want = transformers.AutoModel.from_pretrained(dirs[layout]).eval()(input_ids=ids, attention_mask=mask)
    states, emb = net(ids, mask)
    real = mask.bool()
    assert (states - want.last_hidden_state)[real].abs().max() < 1e-5
    m = mask[..., None].float()
    pooled = torch.nn.functional.normalize((want.last_hidden_state * m).sum(1) / m.sum(1), dim=-1)
    assert (emb - pooled).abs().max() < 1e-5
    text_ids, _ = tok.encode(["the model is dense"])
    first, last = {"roberta": ("<s>", "</s>"), "distilbert": ("[CLS]", "[SEP]")}[layout]
    assert text_ids[0, 0] == tok._tok.token_to_id(first) and text_ids[0, -1] == tok._tok.token_to_id(last)


# what a saved directory holds that is no parameter of the model adaptex loads: GPT-2's causal-mask
# buffers (older transformers), BERT's position ids
_NOT_PARAMETERS = ("attn.bias", "attn.masked_bias", "position_ids")


@pytest.mark.parametrize("layout", hf_dirs.LAYOUTS)
def test_every_loaded_parameter_is_its_tensor_in_the_file(dirs, layout):
    """Each parameter adaptex loads equals, bit for bit, the tensor of its name in model.safetensors,
    and every tensor of the file is loaded once. The test directories perturb every parameter before
    saving, so a bias or norm weight left at its initial value differs from the file."""
    from safetensors.torch import load_file

    from adaptex.graphs.hf.encoders import LAYOUTS as ENCODER_NAMES
    from adaptex.graphs.minilm import _hf_name

    state = load_file(str(dirs[layout] / "model.safetensors"))
    if layout in DECODERS:
        net = load_decoder(dirs[layout])[0]
        prefix = {"gpt2": "transformer.", "llama": "model."}[layout]
        name = lambda n: n if n == "lm_head.weight" else prefix + n
    else:
        net = load_encoder(dirs[layout])[0]
        name = ENCODER_NAMES[layout][1] if layout in ENCODER_NAMES else _hf_name
    used = []
    for ours, param in net.named_parameters():
        theirs = name(ours)
        assert theirs in state, f"{layout}: {ours} loaded from {theirs}, which the file does not hold"
        assert torch.equal(param, state[theirs].float()), f"{layout}: {ours} differs from {theirs} in the file"
        used.append(theirs)
    assert len(used) == len(set(used)), f"{layout}: a file tensor loaded into two parameters"
    tied = {"lm_head.weight"} if layout == "gpt2" else set()  # GPT-2's head is its word embedding
    rest = set(state) - set(used) - tied
    assert not {k for k in rest if not k.endswith(_NOT_PARAMETERS)}, f"{layout}: tensors never loaded: {sorted(rest)}"
    zeros = [n for n, p in net.named_parameters() if not p.any() or bool((p == 1).all())]
    assert not zeros, f"{layout}: parameters still at an initial value in the test directory: {zeros}"


def _spread_llama(path, spread: float = 30.0):
    """An elastic LLaMA decoder whose routers are centred and spread like tests/support/zoo.py's, so that
    head modes vary across inputs."""
    from adaptex.graphs.elastic_decoder import ElasticDecoder

    backbone, _, info = load_decoder(path)
    torch.manual_seed(0)
    model = ElasticDecoder.from_backbone(backbone, sha256=info["sha256"], path=str(path), sink=2, window=6,
                                         pool_tokens=8, router_hidden=16)
    ids, _ = _batch(B=64, T=24, seed=3)
    zoo.center_head_modes(model, ids, spread)
    return model.eval()


@torch.no_grad()
def test_grouped_query_attention_routes_per_kv_head(dirs):
    model = _spread_llama(dirs["llama"])
    ids, mask = _batch(B=16, T=30, seed=4)
    mask[3, :6] = 0
    logits, dec, presents = model(ids, mask)
    sa = torch.stack([d["sa"] for d in dec])  # (L, B, Hkv)
    assert sa.shape == (2, 16, 2) and 0 < sa.float().mean() < 1  # a decision per KV head; both modes occur
    assert presents[0][0].shape == (16, 2, 30, 8)  # the cache holds the KV heads only
    ref, _, _ = model(ids, mask, mode="hard_dense")  # the op against the dense reference, mixed modes
    assert (logits - ref)[mask.bool()].abs().max() < 1e-5
    full, _, _ = model(ids, mask, mode="full")
    fa, _, _ = model(ids, mask, force_sa=[torch.zeros(16, 2, dtype=torch.bool)] * 2)
    assert (fa - full)[mask.bool()].abs().max() < 1e-5
    # an SA KV head streams for both of its query heads: one layer, head modes given per KV head
    layer = model.routers[0]
    q, k, v = torch.randn(1, 4, 30, 8), torch.randn(1, 2, 30, 8), torch.randn(1, 2, 30, 8)
    km = torch.ones(1, 30, dtype=torch.bool)
    from adaptex.graphs.ops.elastic_attention import elastic_attention_dense_reference as ref_attn

    o = layer(q, k, v, km, force_sa=torch.tensor([[True, False]]))
    want = ref_attn(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), torch.tensor([[True, True, False, False]]),
                    km, 2, 6, True)
    assert (o - want).abs().max() < 1e-5


# LLaMA: a larger step moves its routers off the all-FA start within 5 steps, so that the exported
# graphs are checked with both head modes (in one layer or across the two) under grouped-query attention
@pytest.mark.parametrize("layout, extra", [
    pytest.param("gpt2", (), marks=pytest.mark.slow),
    pytest.param("llama", ("--lr", "0.3", "--target-sparsity", "0.5"), marks=pytest.mark.slow), ("roberta", ())])
def test_elastic_routers_from_a_text_file_export_and_check(dirs, corpus, tmp_path, capsys, layout, extra):
    ckpt = tmp_path / "routers"
    assert main(["train", "elastic", "--backbone", str(dirs[layout]), "--data", str(corpus), "--steps", "5",
                 "--batch-size", "4", "--max-tokens", "40", "--window", "8", "--sink", "2", "--eval-size", "16",
                 *extra, "-o", str(ckpt)]) == 0
    info = json.loads((ckpt / "config.json").read_text())
    from safetensors import safe_open

    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        assert all(k.startswith("routers.") for k in f.keys())  # the backbone stays in its directory
    assert info["config"]["backbone_path"] == str(dirs[layout].absolute())
    assert info["training"]["backbone"]["path"] == str(dirs[layout].absolute())
    tokenizer_json = (dirs[layout] / "tokenizer.json").read_text()
    for target, suffix in (("onnx", "onnx"), ("coreml", "mlpackage")):
        art = tmp_path / f"{layout}.{suffix}"
        assert main(["export", str(ckpt), "--target", target, "-o", str(art)]) == 0
        capsys.readouterr()
        assert main(["check", str(art), "--samples", "12"]) == 0
        out = capsys.readouterr().out
        assert "PASSED" in out and "unexcused flips 0" in out, out
        seen = [ln for ln in out.splitlines() if ln.strip().startswith("decisions.layer") and "FA:" in ln]
        modes = {m for ln in seen for m in ("FA", "SA") if f"{m}:0" not in ln}  # the modes some layer took
        assert len(seen) == 2 and (layout != "llama" or modes == {"FA", "SA"}), out
        assert main(["inspect", str(art), "--json"]) == 0
        meta = json.loads(capsys.readouterr().out)
        assert meta["tokenizer"] == {"kind": "tokenizer.json", "pad": meta["tokenizer"]["pad"], "json": tokenizer_json}


def _copy(src, dst, edit=None, drop=()):
    import shutil

    shutil.copytree(src, dst)
    if edit:
        cfg = json.loads((dst / "config.json").read_text())
        cfg.update(edit)
        (dst / "config.json").write_text(json.dumps(cfg))
    for name in drop:
        (dst / name).unlink()
    return dst


@pytest.mark.parametrize("layout, edit, expect", [
    ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4}}, "rope_parameters.rope_type"),
    ("llama", {"hidden_act": "gelu"}, "hidden_act"),
    ("llama", {"tie_word_embeddings": True, "vocab_size": 80}, "model.embed_tokens.weight has shape"),
    ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
    ("gpt2", {"n_embd": None}, "no 'n_embd'"),
    ("roberta", {"position_embedding_type": "relative_key"}, "position_embedding_type"),
    ("gpt2", {"model_type": "mistral"}, "model_type 'mistral' is not"),
])
def test_unsupported_configs_are_refused_naming_the_key(dirs, tmp_path, layout, edit, expect):
    bad = _copy(dirs[layout], tmp_path / "bad", edit)
    load = load_decoder if layout in DECODERS and edit.get("model_type") is None else load_encoder
    with pytest.raises(CheckpointError) as e:
        load(bad)
    assert expect in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_backbone_changes_and_cli_misuse(dirs, corpus, tmp_path, capsys):
    ckpt = tmp_path / "r"
    checkpoint.save(ckpt, _spread_llama(dirs["llama"]), {"description": "test"})
    checkpoint.load(ckpt)  # loads while the directory is as trained
    moved = _copy(dirs["llama"], tmp_path / "llama2")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["config"]["backbone_path"] = str(moved)
    from safetensors.torch import load_file, save_file

    w = load_file(str(moved / "model.safetensors"))
    w["model.norm.weight"] = w["model.norm.weight"] * 2
    save_file(w, str(moved / "model.safetensors"))
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(AdaptexError, match="not the ones these routers were trained on"):
        checkpoint.load(ckpt)
    no_head = _copy(dirs["llama"], tmp_path / "nohead")
    w = load_file(str(no_head / "model.safetensors"))
    del w["lm_head.weight"]
    save_file(w, str(no_head / "model.safetensors"))
    with pytest.raises(CheckpointError, match="lm_head.weight is missing"):
        load_decoder(no_head)
    assert main(["train", "elastic", "--backbone", str(dirs["gpt2"]), "-o", str(tmp_path / "x")]) == 2
    assert "pass --data FILE|DIR" in capsys.readouterr().err
    assert main(["train", "elastic", "--backbone", str(dirs["gpt2"]), "--data", str(corpus), "--tokenizer",
                 str(dirs["gpt2"] / "tokenizer.json"), "-o", str(tmp_path / "x")]) == 2
    assert "brings its own tokenizer" in capsys.readouterr().err
    shard = _copy(dirs["gpt2"], tmp_path / "shard", drop=("model.safetensors",))
    (shard / "model.safetensors.index.json").write_text("{}")
    assert main(["train", "elastic", "--backbone", str(shard), "--data", str(corpus), "-o", str(tmp_path / "x")]) == 2
    assert "sharded checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    assert np.isfinite(cfg["config"]["target_sparsity"])
