"""adaptex.nn.adapt: a pretrained transformers model (BERT, GPT-2, LLaMA: random-initialised directories
written by save_pretrained, every parameter perturbed so that a copying bug shows), or a
model of torch nn.MultiheadAttention layers, made adaptive in one call. With routing off it computes
what it computed before; only the routers train; it exports (validated) and passes `check` on padded,
varied inputs."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import adaptex
import adaptex.nn as ann
from tests.support import hf_dirs

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

ROUTER = dict(sink=2, window=4, router_hidden=16, pool_tokens=4)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {layout: hf_dirs.make(layout, root) for layout in ("bert", "gpt2", "llama")}


class Outputs(torch.nn.Module):
    """A transformers model as adaptex exports it: (input_ids, attention_mask) -> its main output."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, input_ids, attention_mask):
        if hasattr(self.net, "lm_head"):
            return self.net(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        return self.net(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


def _pretrained(path, layout: str):
    """The directory's model (tests.support.hf_dirs perturbs every parameter), and an adapt-ready copy."""
    import transformers

    if layout == "bert":
        net = transformers.BertModel.from_pretrained(path, add_pooling_layer=False)
    else:
        net = transformers.AutoModelForCausalLM.from_pretrained(path)
    net.eval()
    return Outputs(net).eval(), Outputs(copy.deepcopy(net)).eval()


def _vocab(model) -> int:
    return model.net.config.vocab_size


def _padded(vocab: int, B: int = 3, T: int = 12, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    for b in range(1, B):
        mask[b, T - 3 * b:] = 0
    return ids, mask


def _varied(vocab: int, n: int = 8, seed: int = 0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        B, T = [1, 2, 4][i % 3], int(rng.choice([1, 5, 16]))
        ids = rng.integers(4, vocab, (B, T)).astype(np.int64)
        mask = np.ones((B, T), np.int64)
        if B > 1 and T > 1:
            mask[1:, rng.integers(1, T):] = 0
        out.append((ids, mask))
    return out


CASES = [("bert", "budgeted"), ("bert", "elastic"), ("gpt2", "elastic"), ("llama", "elastic")]


@pytest.mark.parametrize("layout, kind", CASES)
@torch.no_grad()
def test_routing_off_computes_what_the_model_computed(dirs, layout, kind):
    ref, model = _pretrained(dirs[layout], layout)
    frozen = {n: p.clone() for n, p in model.named_parameters()}
    ann.adapt(model, kind, **ROUTER)
    ids, mask = _padded(_vocab(model))
    want = ref(ids, mask)
    with ann.adaptive_mode("dense"):
        got = model(ids, mask)
    real = mask.bool()
    assert (got - want)[real].abs().max() < 1e-5 and want[real].abs().max() > 0.5
    assert (model(ids, mask) - want)[real].abs().max() > 1e-3  # routed (hard mode): heads dropped or streaming
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".router." in n or ".elastic." in n for n in trainable)
    assert not any(p.requires_grad for n, p in model.named_parameters() if n in frozen)
    layers = [m for m in model.modules() if isinstance(m, (ann.BudgetedAttention, ann.ElasticAttention))]
    assert len(layers) == 2  # every layer of the two-layer model
    if layout == "llama":
        assert layers[0].kv_groups == 2  # grouped-query attention kept grouped: a decision per KV head


def _train(model, ref, kind: str, steps: int = 3) -> None:
    """A few steps on the routers: match the original's outputs, plus the kind's routing loss."""
    routers = [p for p in model.parameters() if p.requires_grad]
    before = [p.clone() for p in routers]
    backbone = {n: p.clone() for n, p in model.named_parameters() if not p.requires_grad}
    opt = torch.optim.Adam(routers, lr=1e-2)
    ids, mask = _padded(_vocab(model))
    with torch.no_grad():
        want = ref(ids, mask)
    model.train()
    for _ in range(steps):
        with ann.record_decisions(model) as rec:
            out = model(ids, mask)
        routing = ann.budget_loss(rec) if kind == "budgeted" else (ann.sparsity(rec) - 0.5) ** 2
        loss = (out - want).pow(2).mean() + routing
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    assert all(not torch.equal(a, b) for a, b in zip(before, routers))
    assert all(torch.equal(p, backbone[n]) for n, p in model.named_parameters() if n in backbone)


@pytest.mark.parametrize("layout, kind", [c if c in (("bert", "budgeted"), ("llama", "elastic")) else
                                          pytest.param(*c, marks=pytest.mark.slow) for c in CASES])
def test_routers_train_then_the_model_exports_and_passes_check(dirs, layout, kind, tmp_path):
    ref, model = _pretrained(dirs[layout], layout)
    ann.adapt(model, kind, **ROUTER)
    _train(model, ref, kind)
    example = (torch.randint(4, _vocab(model), (2, 10)), torch.ones(2, 10, dtype=torch.long))
    path = tmp_path / f"{layout}.onnx"
    meta = adaptex.export(model, example, path)  # validated on derived inputs before it is written
    field = "k" if kind == "budgeted" else "sa"
    assert sum(name.endswith(f".{field}") for name in meta["decisions"]) == 2
    assert meta["inputs"]["attention_mask"].get("mask") is True
    report = adaptex.check(path, model, inputs=_varied(_vocab(model)))
    assert report.passed, report.format()


def test_a_budgeted_bert_becomes_a_checked_coreml_package(dirs, tmp_path):
    """docs/api.md's one-call path, on a BERT directory."""
    ref, model = _pretrained(dirs["bert"], "bert")
    ann.adapt(model, "budgeted", router_hidden=16)
    example = (torch.randint(4, _vocab(model), (2, 10)), torch.ones(2, 10, dtype=torch.long))
    path = tmp_path / "bert.mlpackage"
    adaptex.export(model, example, path, target="coreml", precision="fp32")
    report = adaptex.check(path, model, inputs=_varied(_vocab(model), 4))
    assert report.passed, report.format()


def test_decoders_take_elastic_heads_not_budgeted_ones(dirs):
    _, model = _pretrained(dirs["gpt2"], "gpt2")
    with pytest.raises(ValueError, match="kind='elastic'"):
        ann.adapt(model, "budgeted")
    with pytest.raises(ValueError, match="no attention adapt knows"):
        ann.adapt(torch.nn.Linear(3, 3), "elastic")


class Encoder(torch.nn.Module):
    """torch's own encoder layers (key padding mask), mean-pooled."""

    def __init__(self, batch_first: bool, norm_first: bool):
        super().__init__()
        layer = torch.nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=batch_first,
                                                 norm_first=norm_first)
        self.encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.embed, self.batch_first = torch.nn.Linear(5, 16), batch_first

    def forward(self, features, mask):
        x = self.embed(features)
        x = x if self.batch_first else x.transpose(0, 1)
        y = self.encoder(x, src_key_padding_mask=~mask.bool())
        y = y if self.batch_first else y.transpose(0, 1)
        m = mask.to(y.dtype)[..., None]
        return (y * m).sum(1) / m.sum(1)


@pytest.mark.parametrize("kind, batch_first, norm_first", [("budgeted", True, False), ("elastic", False, True)])
def test_multihead_attention_layers_adapt(kind, batch_first, norm_first, tmp_path):
    torch.manual_seed(0)
    ref = Encoder(batch_first, norm_first).eval()
    model = ann.adapt(copy.deepcopy(ref), kind, **ROUTER)
    x, mask = torch.randn(3, 9, 5), torch.ones(3, 9, dtype=torch.bool)
    mask[1, 6:] = False
    mask[2, 2:] = False
    with torch.no_grad(), ann.adaptive_mode("dense"):
        assert (model(x, mask) - ref(x, mask)).abs().max() < 1e-5
    if kind == "budgeted":  # one export of torch's layers, validated
        example = (torch.randn(2, 8, 5), torch.ones(2, 8, dtype=torch.bool))
        adaptex.export(model, example, tmp_path / "enc.onnx")
        assert adaptex.check(tmp_path / "enc.onnx", model, inputs=[(x, mask)]).passed
