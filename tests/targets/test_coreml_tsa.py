"""Core ML target, TSA decoder family: adaptex::conditional_ffn lowered to MIL (sparse: non_zero +
gather_nd + FFN on the kept rows + scatter_nd; dense: every token, update scaled by keep * gate) and
the decoder exported with its KV cache, checked by MIL reference evaluation of the saved packages
against eager TSADecoder(mode="hard"): a prefill with an empty past, then a decode step fed with
the presents."""
import json

import numpy as np
import pytest

from tests.support import zoo

import torch

from adaptex.exporter.targets import coreml as target
from adaptex.graphs.tsa import TSAConfig, TSADecoder
from adaptex.runtimes.coreml_mil import MilReferenceRunner

CFG = dict(vocab_size=32, d_model=32, num_heads=4, num_layers=3, d_ff=64, max_len=32)
B, T = 4, 10  # prefill of T tokens, then one decode step
FP16_TOL = {"atol": 1e-2, "rtol": 1e-2}
FP16_KEEP_MARGIN = 1e-2  # an fp16 keep may differ from eager only where |p - 0.5| is below this


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(4)
    m = TSADecoder(TSAConfig(**CFG)).eval()
    # an untrained tiny model routes by position only; larger token embeddings and sharper routers
    # make keep vary between tokens, rows and layers, in the prefill and in the decode step
    m.tok.weight.data.mul_(50)
    for r in m.routers:
        r.net[0].weight.data.mul_(40)
        r.net[2].weight.data.mul_(40)
    m.ln_f.weight.data.mul_(0.1)  # logits of magnitude ~3, not ~30, with the embeddings (tied) scaled up
    return m


@pytest.fixture(scope="module")
def packages(model, tmp_path_factory):
    d = tmp_path_factory.mktemp("coreml_tsa")
    out = {}
    for variant, precision in (("sparse", "fp32"), ("dense", "fp32"), ("sparse", "fp16")):
        path = d / f"tsa.{variant}.{precision}.mlpackage"
        meta = zoo.export(model, None, path, "coreml", variant=variant, precision=precision)
        out[variant, precision] = path, meta
    return out


def _inputs():
    rng = np.random.default_rng(0)
    ids = rng.integers(1, CFG["vocab_size"], size=(B, T + 1))
    mask = np.ones((B, T + 1), dtype=np.int64)
    mask[2, :3] = 0  # a left-padded row
    ids[2, :3] = 0
    return ids, mask


def _past(presents=None, batch=B):
    L, H, dh = CFG["num_layers"], CFG["num_heads"], CFG["d_model"] // CFG["num_heads"]
    if presents is None:  # a prefill: past length MIN_PAST (0: Core ML accepts an empty cache)
        presents = [(np.zeros((batch, H, target.MIN_PAST, dh), np.float32),) * 2 for _ in range(L)]
    return {f"past_key_values.{i}.{kv}": np.ascontiguousarray(presents[i][j], dtype=np.float32)
            for i in range(L) for j, kv in enumerate(("key", "value"))}


def _eager(model, ids, mask, past=None):
    with torch.no_grad():
        pt = None if past is None else [(torch.from_numpy(k), torch.from_numpy(v)) for k, v in past]
        logits, dec, pres = model(torch.from_numpy(ids), torch.from_numpy(mask), past=pt, mode="hard")
    out = {"logits": logits.numpy()}
    for i, (k, v) in enumerate(pres):
        out[f"present.{i}.key"], out[f"present.{i}.value"] = k.numpy(), v.numpy()
    for li, dd in enumerate(dec, 1):
        out[f"decisions.layer{li}.keep"], out[f"decisions.layer{li}.p"] = dd["keep"].numpy(), dd["p"].numpy()
    return out


def _compare(got: dict, ref: dict, precision: str, errors: dict, where: str) -> None:
    """Assert the package's step outputs match eager; record the largest errors per output kind."""
    assert set(got) == set(ref), (sorted(got), sorted(ref))
    bad_rows = np.zeros(got["logits"].shape[0], dtype=bool)
    for name in [n for n in ref if n.endswith(".keep")]:
        k_got, k_ref = got[name], ref[name]
        assert k_got.dtype == np.float32 and set(np.unique(k_got)) <= {0.0, 1.0}  # Core ML: no bool outputs
        flip = k_got.astype(bool) != k_ref
        if precision == "fp32":
            assert not flip.any(), f"{where} {name}: keep differs from eager at {np.argwhere(flip).tolist()}"
        else:
            p = ref[name.replace(".keep", ".p")]
            near = np.abs(p.astype(np.float64) - 0.5) < FP16_KEEP_MARGIN
            assert not (flip & ~near).any(), f"{where} {name}: unexcused keep flip at {np.argwhere(flip & ~near).tolist()}"
            bad_rows |= flip.any(-1)  # an excused flip changes everything downstream in its row
        errors["keep_flips"] = errors.get("keep_flips", 0) + int(flip.sum())
    for name in [n for n in ref if not n.endswith(".keep")]:
        a, r = got[name][~bad_rows].astype(np.float64), ref[name][~bad_rows].astype(np.float64)
        assert a.shape == r.shape, (name, a.shape, r.shape)
        err = np.abs(a - r)
        kind = name.split(".")[0] if not name.startswith("decisions") else "p"
        errors[kind] = max(errors.get(kind, 0.0), float(err.max(initial=0.0)))
        if precision == "fp32":
            assert err.max(initial=0.0) <= 1e-4, f"{where} {name}: max abs error {err.max():.3e} > 1e-4"
        else:
            need = err - FP16_TOL["rtol"] * np.abs(r)
            assert need.max(initial=0.0) <= FP16_TOL["atol"], f"{where} {name}: error {err.max():.3e} exceeds atol+rtol 1e-2"


def _prefill_then_decode(runner, model, precision):
    """Prefill (past length MIN_PAST) then one decode step fed with the package's own presents."""
    ids, mask = _inputs()
    errors = {}
    feeds = {"input_ids": ids[:, :T].astype(np.int32), "attention_mask": mask[:, :T].astype(np.int32), **_past()}
    got = runner.infer(feeds)
    ref = _eager(model, ids[:, :T], mask[:, :T])
    _compare(got, ref, precision, errors, "prefill")
    L = CFG["num_layers"]
    feeds = {"input_ids": ids[:, T:].astype(np.int32), "attention_mask": mask.astype(np.int32),
             **_past([(got[f"present.{i}.key"], got[f"present.{i}.value"]) for i in range(L)])}
    got2 = runner.infer(feeds)
    ref2 = _eager(model, ids[:, T:], mask, past=[(ref[f"present.{i}.key"], ref[f"present.{i}.value"]) for i in range(L)])
    _compare(got2, ref2, precision, errors, "decode step")
    assert got2["present.0.key"].shape[2] == T + 1
    return ref, ref2, errors


@pytest.mark.parametrize("variant", ["sparse", "dense"])
def test_fp32_package_matches_eager_prefill_and_decode(packages, model, variant):
    runner = MilReferenceRunner(packages[variant, "fp32"][0])
    ref, ref2, errors = _prefill_then_decode(runner, model, "fp32")
    # the routing really varies: kept and skipped tokens in every router, prefill and decode step
    for r in (ref, ref2):
        keeps = np.stack([r[f"decisions.layer{li}.keep"] for li in range(1, CFG["num_layers"])])
        assert keeps.any() and not keeps.all()
    assert errors["keep_flips"] == 0 and max(errors["logits"], errors["present"], errors["p"]) <= 1e-4
    print(f"coreml tsa {variant} fp32 max abs errors: {json.dumps(errors)}")


def test_sparse_step_with_no_token_kept(packages, model):
    """No kept token: the spare row alone is gathered, transformed and dropped; no tensor is empty."""
    runner = MilReferenceRunner(packages["sparse", "fp32"][0])
    ids, mask = _inputs()
    ref = _eager(model, ids[:, :T], mask[:, :T])
    L = CFG["num_layers"]
    pres = [(ref[f"present.{i}.key"], ref[f"present.{i}.value"]) for i in range(L)]
    ref2 = _eager(model, ids[:, T:], mask, past=pres)
    rows = [b for b in range(B) if not any(ref2[f"decisions.layer{li}.keep"][b].any() for li in range(1, L))]
    assert rows, "the fixture should have a decode row that skips every gated FFN"
    b = rows[:1]
    got = runner.infer({"input_ids": ids[b, T:].astype(np.int32), "attention_mask": mask[b].astype(np.int32),
                        **_past([(k[b], v[b]) for k, v in pres], batch=1)})
    for name, r in _eager(model, ids[b, T:], mask[b], past=[(k[b], v[b]) for k, v in pres]).items():
        assert np.abs(got[name].astype(np.float64) - r.astype(np.float64)).max() <= 1e-4, name
    assert runner.findings() == []  # no zero-size intermediate


def test_fp16_package_matches_eager_within_fp16_tolerance(packages, model):
    runner = MilReferenceRunner(packages["sparse", "fp16"][0])
    _, _, errors = _prefill_then_decode(runner, model, "fp16")
    print(f"coreml tsa sparse fp16 max abs errors: {json.dumps(errors)}")


def test_fp16_sparse_package_past_65535_tokens(packages, model):
    """An fp16 convert casts gather_nd indices to uint16: the kept tokens are addressed by (batch,
    token) pairs, so a batch of more than 65535 tokens still gathers and scatters the right rows."""
    runner = MilReferenceRunner(packages["sparse", "fp16"][0])
    rows, T_ = 2100, CFG["max_len"]  # 67200 tokens
    ids = np.random.default_rng(1).integers(1, CFG["vocab_size"], size=(rows, T_))
    mask = np.ones_like(ids)
    got = runner.infer({"input_ids": ids.astype(np.int32), "attention_mask": mask.astype(np.int32),
                        **_past(batch=rows)})
    _compare(got, _eager(model, ids, mask), "fp16", {}, f"{rows * T_} tokens")


def _ops(path):
    return list(MilReferenceRunner(path).program.functions["main"].operations)


def _cffn_ops(path, op="conditional_ffn"):
    """The ops the `op` translation emitted (and coremltools' rewrites of them)."""
    return [o for o in _ops(path) if o.op_type != "const" and (o.name.startswith(op) or o.name.startswith(f"route_{op}"))]


def test_sparse_program_gathers_and_scatters_the_kept_tokens(packages):
    types = [op.op_type for op in _ops(packages["sparse", "fp32"][0])]
    gated = CFG["num_layers"] - 1
    assert types.count("non_zero") == gated and types.count("argsort") == gated
    assert types.count("scatter_nd") == 2 * gated  # the FFN's and the attention's kept rows
    # the FFN's kept rows and their gates; the attention's query rows, bias rows, gates and residual rows
    assert types.count("gather_nd") == 2 * gated + 4 * gated
    cffn = _cffn_ops(packages["sparse", "fp32"][0])
    cattn = _cffn_ops(packages["sparse", "fp32"][0], "conditional_attention")
    scatter = [op for op in cffn + cattn if op.op_type == "scatter_nd"]
    assert len(scatter) == 2 * gated and all(op.inputs["mode"].val == "update" for op in scatter)
    assert [op.op_type for op in cffn if op.op_type in ("layer_norm", "linear", "gelu")] == \
        ["layer_norm", "linear", "gelu", "linear"] * gated
    assert [op.op_type for op in cattn if op.op_type in ("linear", "softmax")] == ["linear", "softmax", "linear"] * gated


def test_dense_program_has_static_shapes(packages):
    """Dense: every token through the FFN, no data-dependent size anywhere in the conditional-ffn part."""
    path = packages["dense", "fp32"][0]
    types = [op.op_type for op in _ops(path)]
    assert "non_zero" not in types and "gather_nd" not in types and "scatter_nd" not in types
    cffn = _cffn_ops(path)
    # elementwise and per-token ops only: no shape, reshape, slice or gather, so no size computed at run time
    assert cffn and {op.op_type for op in cffn} <= {"layer_norm", "linear", "gelu", "cast", "mul", "expand_dims", "add"}
    assert [op.op_type for op in cffn if op.op_type in ("layer_norm", "linear", "gelu")] == \
        ["layer_norm", "linear", "gelu", "linear"] * (CFG["num_layers"] - 1)
    cattn = _cffn_ops(path, "conditional_attention")
    assert cattn and not {"argsort", "slice_by_index", "gather_nd", "range_1d"} & {op.op_type for op in cattn}


def test_fp16_package_keeps_routing_in_fp32(packages):
    import coremltools as ct
    from coremltools.converters.mil.mil import types

    path, meta = packages["sparse", "fp16"]
    assert meta["precision"] == "fp16" and meta["routing_precision"] == "fp32"
    ops = _ops(path)
    dtype = {op.name: types.builtin_to_string(op.outputs[0].dtype) for op in ops}
    # the routers: their linears (by weight), relu, squeeze and sigmoid
    router_linear = [op for op in ops if op.op_type == "linear" and op.inputs["weight"].name.startswith("p_model_routers_")]
    assert len(router_linear) == 2 * (CFG["num_layers"] - 1) and {dtype[op.name] for op in router_linear} == {"fp32"}
    assert {dtype[op.name] for op in ops if op.op_type in ("sigmoid", "relu")} == {"fp32"}
    # keep = p <= 0.5 compares fp32 p; the gate and everything named route_ stay fp32
    le = [op for op in ops if op.op_type == "less_equal" and op.inputs["x"].name.startswith("decisions_layer")]
    assert len(le) == CFG["num_layers"] - 1
    assert all(types.builtin_to_string(op.inputs["x"].dtype) == "fp32" for op in le)
    route = [op for op in ops if op.op_type != "const" and op.name.startswith("route_")
             and dtype[op.name] not in ("bool", "int32", "uint16")]
    assert route and {dtype[op.name] for op in route} == {"fp32"}
    # while the body, the FFN on the kept rows included, is fp16
    assert {dtype[op.name] for op in _cffn_ops(path) if op.op_type in ("linear", "gelu")} == {"fp16"}
    # every float output is fp32 in the saved interface, keep as 0/1
    spec = ct.models.MLModel(str(path), skip_model_load=True).get_spec()
    fp32 = ct.proto.FeatureTypes_pb2.ArrayFeatureType.FLOAT32
    assert {o.type.multiArrayType.dataType for o in spec.description.output} == {fp32}


def test_fp16_package_keeps_residual_stream_and_layer_norms_in_fp32(packages):
    """Mixed precision: the residual stream (embedding add, every residual add, conditional_ffn's
    residual add and scatter) and every LayerNorm stay fp32; matmuls, attention and FFN bodies fp16."""
    from coremltools.converters.mil.mil import types

    path, meta = packages["sparse", "fp16"]
    assert meta["residual_precision"] == "fp32"
    ops = [op for op in _ops(path) if op.op_type != "const"]
    dtype = {op.name: types.builtin_to_string(op.outputs[0].dtype) for op in ops}
    L, gated = CFG["num_layers"], CFG["num_layers"] - 1
    ln = [op for op in ops if op.op_type == "layer_norm"]
    assert len(ln) == 2 * L + 1 and {dtype[op.name] for op in ln} == {"fp32"}  # ln1, ln2 (in the op), ln_f
    # the embedding add and the 2 residual adds of block 0, then in each gated block the residual
    # add on the kept rows and the scatter back of conditional_attention and of conditional_ffn
    resid_add = [op for op in ops if op.op_type == "add" and op.name.startswith("resid_")]
    cffn_resid = [op for op in _cffn_ops(path) + _cffn_ops(path, "conditional_attention")
                  if op.op_type == "scatter_nd" or (op.op_type == "add" and op.name.endswith("_new"))]
    assert len(resid_add) == 1 + 2 and len(cffn_resid) == 4 * gated
    assert {dtype[op.name] for op in resid_add + cffn_resid} == {"fp32"}
    assert {dtype[op.name] for op in ops if op.op_type in ("matmul", "softmax", "gelu")} == {"fp16"}


def test_decoder_package_interface_and_metadata(packages):
    import coremltools as ct

    path, meta = packages["sparse", "fp32"]
    L, H, dh = CFG["num_layers"], CFG["num_heads"], CFG["d_model"] // CFG["num_heads"]
    assert meta["family"] == "tsa" and meta["target"] == "coreml" and meta["variant"] == "sparse"
    assert meta["keep_threshold"] == 0.5 and meta["kv_cache_bound"] == CFG["max_len"]
    assert "budget_range" not in meta and meta["min_past_sequence"] == target.MIN_PAST == 0
    assert meta["lowerings"] == {"adaptex::conditional_attention": "conditional_attention_coreml_sparse",
                                 "adaptex::conditional_ffn": "conditional_ffn_coreml_sparse"}
    runner = MilReferenceRunner(path)
    specs = runner.input_metadata()
    assert list(specs) == ["input_ids", "attention_mask"] + [
        f"past_key_values.{i}.{kv}" for i in range(L) for kv in ("key", "value")]
    assert specs["input_ids"].dtype == specs["attention_mask"].dtype == "int32"
    assert specs["past_key_values.1.value"].dtype == "float32"
    assert specs["past_key_values.1.value"].shape == ("batch", H, "past_sequence", dh)
    m = ct.models.MLModel(str(path), skip_model_load=True)
    spec = m.get_spec()
    assert [o.name for o in spec.description.output] == [s["coreml_name"] for s in meta["outputs"].values()]
    assert all(i.shortDescription for i in spec.description.input)
    assert all(o.shortDescription for o in spec.description.output)
    ranges = {i.name: [(r.lowerBound, r.upperBound) for r in i.type.multiArrayType.shapeRange.sizeRanges]
              for i in spec.description.input}
    assert ranges["input_ids"] == [(1, 4096), (1, 32)] and ranges["attention_mask"] == [(1, 4096), (1, 32)]
    assert ranges["past_key_values_0_key"] == [(1, 4096), (H, H), (0, 31), (dh, dh)]
    ud = m.user_defined_metadata
    assert ud["adaptex.family"] == "tsa" and json.loads(ud["adaptex.keep_threshold"]) == 0.5
    assert "fp32 routing" in m.short_description


def test_decoder_feeds_are_validated(packages):
    from adaptex.graphs.errors import InputError

    runner = MilReferenceRunner(packages["sparse", "fp32"][0])
    ids = np.ones((1, 4), np.int32)
    with pytest.raises(InputError, match="attention_mask: shape"):
        runner.infer({"input_ids": ids, "attention_mask": np.ones((1, 3), np.int32), **_past(batch=1)})
    with pytest.raises(InputError, match="dtype int64, expected int32"):
        runner.infer({"input_ids": ids.astype(np.int64), "attention_mask": ids, **_past(batch=1)})


def test_stock_counterpart_of_a_decoder_converts_and_computes_hard_dense(model, tmp_path):
    """`adaptex bench`'s naive counterpart of a decoder: its hard_dense path (every token through every
    FFN, no adaptex op) converted by stock coremltools, with the adaptive package's inputs."""
    from adaptex.runtimes.coreml_mil import load_program, run

    from adaptex.exporter.targets.coreml.convert import export_stock
    from adaptex.graphs.family import family_contract

    contract = family_contract(model)
    path = export_stock(model, contract, tmp_path / "naive.mlpackage", contract.counterpart_modes["naive"], prec="fp32")
    _, program = load_program(path)
    ids, mask = _inputs()
    feeds = {"input_ids": ids[:, :T].astype(np.int32), "attention_mask": mask[:, :T].astype(np.int32),
             **{n.replace(".", "_"): a for n, a in _past().items()}}
    out = run(program, feeds)
    with torch.no_grad():
        logits, dec, _ = model(torch.from_numpy(ids[:, :T]), torch.from_numpy(mask[:, :T]), mode="hard_dense")
    assert np.abs(out["logits"] - logits.numpy()).max() <= 1e-4
    assert (out["decisions_layer1_keep"].astype(bool) == dec[0]["keep"].numpy()).all()


def test_tsa_packages_default_to_fp32_bodies():
    """fp16 bodies missed the fp16 tolerance on the shipped character LM (README), so a TSA package
    is fp32 unless fp16 is asked for; BudgetFormer keeps the fp16 default."""
    from adaptex.graphs.budgetformer import BudgetFormerConfig
    from adaptex.graphs.tsa import TSAConfig

    from adaptex.graphs.family import family_contract

    assert target.default_precision(family_contract(TSAConfig(vocab_size=32))) == "fp32"
    assert target.default_precision(family_contract(BudgetFormerConfig())) == "fp32"  # its fp16 fails the audit
