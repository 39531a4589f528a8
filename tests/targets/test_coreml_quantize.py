"""Quantized Core ML packages (exporter/targets/coreml/quantize.py): int8 and palettized weights through
coremltools.optimize.coreml, checked on Linux by the MIL evaluator's decompression of the constexpr ops
(runtimes/coreml_mil_constexpr.py), routers float unless asked."""
from __future__ import annotations

import numpy as np
import pytest
from coremltools.converters.mil.mil.ops.defs.iOS16 import constexpr_ops as ios16
from coremltools.converters.mil.mil.ops.defs.iOS18 import compression as ios18

import adaptex
from adaptex.cli import main
from adaptex.exporter.errors import ExportError
from adaptex.exporter.targets.coreml import quantize as cq
from adaptex.runtimes import coreml_mil, coreml_mil_constexpr as cx
from adaptex.runtimes.open import read_metadata
from tests.support import zoo

pytestmark = pytest.mark.usefixtures("one_torch_thread")
rng = np.random.default_rng(0)


def test_affine_dequantize_matches_coremltools():
    q = rng.integers(-128, 128, size=(6, 5)).astype(np.int8)
    for axis, zp, scale in [(0, np.zeros(6, np.int8), rng.random(6).astype(np.float32)),
                            (1, rng.integers(-3, 3, 5).astype(np.int8), rng.random(5).astype(np.float16)),
                            (0, np.int8(2), np.float32(0.1))]:
        want = ios16.constexpr_affine_dequantize.decompress(q, zp, scale, axis)
        got = cx.affine_dequantize(q, zp, scale, axis)
        assert got.dtype == want.dtype
        np.testing.assert_allclose(got, want, rtol=1e-3 if got.dtype == np.float16 else 1e-6)


def test_blockwise_shift_scale_matches_coremltools():
    data = rng.integers(-8, 8, size=(8, 6)).astype(np.int8)
    scale, offset = rng.random((4, 2)).astype(np.float32), rng.integers(-2, 2, (4, 2)).astype(np.int8)
    for off in (offset, None):
        want = ios18.constexpr_blockwise_shift_scale.decompress(data, scale, off)
        np.testing.assert_allclose(cx.blockwise_shift_scale(data, scale, off), want, rtol=1e-6)
    with pytest.raises(Exception, match="equal blocks"):
        cx.blockwise_shift_scale(data, rng.random((3, 2)).astype(np.float32))


@pytest.mark.parametrize("nbits", [4, 6])
def test_packed_lookup_tables_match_coremltools(nbits):
    """iOS16: the indices packed in bytes, a flat table; iOS18: indices in the output's shape, a table per block."""
    shape = np.array([7, 9], np.uint32)
    idx = rng.integers(0, 2 ** nbits, size=int(shape.prod()))
    packed = np.packbits(((idx[:, None] >> np.arange(nbits)) & 1).astype(np.uint8).ravel(), bitorder="little")
    lut = rng.normal(size=2 ** nbits).astype(np.float32)
    want = ios16.constexpr_lut_to_dense.decompress(lut, packed, shape)
    np.testing.assert_array_equal(cx.lut_to_dense(packed, lut, shape), want)
    np.testing.assert_array_equal(want, lut[idx].reshape(7, 9))
    blocks = rng.normal(size=(7, 3, 2 ** nbits, 1)).astype(np.float32)  # a table per row and per 3 columns
    dense = idx.reshape(7, 9).astype(np.uint8)
    np.testing.assert_array_equal(cx.lut_to_dense(dense, blocks),
                                  ios18.constexpr_lut_to_dense.decompress(dense, blocks, None))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["bf", "tsa", "el", "eldec"])
def test_each_family_quantized_to_int8_passes_check(artifacts, family):
    """Each family's tiny checkpoint at its default Core ML precision (fp16 bodies for the encoders)."""
    path = artifacts(family, "coreml", quantize="int8")
    report = adaptex.check(path, samples=32)
    assert report.passed, report.format()
    assert report.precision == "int8" and report.decisions_vary
    assert read_metadata(path)["quantize"]["quantized"]["tensors"] > 0


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    """The tiny BudgetFormer exported to Core ML fp32 plain, int8, int8 with the routers, and palettize4."""
    root = tmp_path_factory.mktemp("cq")
    out = {}
    for name, options in [("fp32", {}), ("int8", {"quantize": "int8"}),
                          ("int8-routers", {"quantize": "int8", "quantize_routers": True}),
                          ("palettize4", {"quantize": "palettize4"}),
                          ("int8-iOS18", {"quantize": "int8", "min_target": "iOS18"}),
                          ("palettize6-iOS18", {"quantize": "palettize6", "min_target": "iOS18"})]:
        out[name] = root / f"{name}.mlpackage"
        adaptex.export(zoo.tiny_model(), None, out[name], target="coreml", precision="fp32", validate=False,
                       **options)
    return out


def _ops(path):
    return coreml_mil.load_program(path)[1].functions["main"].operations


def _size(path):
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


@pytest.mark.parametrize("package, kernel", [("int8", "constexpr_affine_dequantize"),
                                             ("palettize4", "constexpr_lut_to_dense"),
                                             ("int8-iOS18", "constexpr_blockwise_shift_scale"),
                                             ("palettize6-iOS18", "constexpr_lut_to_dense")])
def test_a_quantized_package_passes_check_within_its_bounds(packages, package, kernel):
    """iOS16/17 and iOS18 packages write different constexpr ops (iOS18's tables per 16 channels)."""
    path, scheme = packages[package], package.split("-")[0]
    report = adaptex.check(path, zoo.tiny_model(), samples=48)
    assert report.passed, report.format()
    assert report.precision == scheme and report.flip_bound is not None and report.decisions_vary
    q = read_metadata(path)["quantize"]
    assert ("per 16 output channels" in q["weights"]) == (package == "palettize6-iOS18")
    assert q["scheme"] == scheme and q["routers"] == "fp32" and q["kernels"] == [kernel]
    compressed = [op for op in _ops(path) if op.op_type == kernel]
    assert len(compressed) == q["quantized"]["tensors"] >= 6
    assert _size(path) < 0.7 * _size(packages["fp32"])


def test_no_float_copy_of_a_compressed_weight_stays_in_the_package(packages):
    ops = _ops(packages["int8"])
    compressed = [op for op in ops if op.op_type == "constexpr_affine_dequantize"]
    floats = [op.outputs[0].val for op in ops if op.op_type == "const" and isinstance(op.outputs[0].val, np.ndarray)
              and op.outputs[0].val.dtype.kind == "f"]
    for op in compressed:
        shape = tuple(op.outputs[0].shape)
        assert not any(f.shape == shape for f in floats), op.name


def test_routers_stay_float_unless_asked(packages):
    """Routers' matrices stay fp32 consts; asked, those of MIN_ELEMENTS values or more are compressed
    like any other weight (smaller ones stay float in every package)."""
    plain, asked = read_metadata(packages["int8"])["quantize"], read_metadata(packages["int8-routers"])["quantize"]
    consts = {op.name: op.outputs[0].val for op in _ops(packages["int8"]) if op.op_type == "const"}
    assert all(consts[n].dtype == np.float32 for n in plain["fp32_routers"])
    routers = [n for n in plain["fp32_routers"] if consts[n].ndim == 2 and consts[n].size >= cq.MIN_ELEMENTS]
    assert len(routers) >= 4
    assert asked["routers"] == "quantized" and asked["fp32_routers"] == []
    left = {op.name for op in _ops(packages["int8-routers"]) if op.op_type == "const"}
    assert not left & set(routers)
    assert asked["quantized"]["tensors"] == plain["quantized"]["tensors"] + len(routers)


@pytest.mark.parametrize("options, says", [({"quantize": "int4"}, "coreml target quantizes to int8 or palettize4"),
                                           ({"quantize_routers": True}, "--quantize-routers quantizes")])
def test_a_bad_coreml_quantize_option_is_refused_in_one_line(tmp_path, options, says):
    with pytest.raises(ExportError, match=says) as e:
        adaptex.export(zoo.tiny_model(), None, tmp_path / "x.mlpackage", target="coreml", **options)
    assert "\n" not in str(e.value) and not (tmp_path / "x.mlpackage").exists()


def test_the_cli_quantizes_a_checkpoint_and_check_verifies_it(artifacts, tmp_path, capsys):
    out = tmp_path / "bf.mlpackage"
    ckpt = artifacts.checkpoints / "bf"
    assert main(["export", str(ckpt), "--target", "coreml", "--precision", "fp32", "--quantize", "palettize6",
                 "--no-validate", "-o", str(out)]) == 0
    assert main(["check", str(out), "--samples", "24"]) == 0
    said = capsys.readouterr().out
    assert "palettize6 tolerance" in said and "PASSED" in said
