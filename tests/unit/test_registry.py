"""The lowering registry: every op x target x variant cell works or refuses with a reason."""
import pytest

from adaptex.exporter import registry, targets
from adaptex.exporter.errors import ExportError, UnsupportedLowering
from adaptex.graphs.ops import OPS


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("target", targets.BUILTIN)
@pytest.mark.parametrize("variant", registry.VARIANTS)
def test_no_empty_cell(op, target, variant):
    targets.load_all()
    cells = registry.cells()
    assert (op, target, variant) in cells, f"no lowering or explicit refusal for {op} on {target} ({variant})"
    try:
        entry = registry.lookup(op, target, variant)
    except UnsupportedLowering as e:
        assert e.reasons and all(len(r) > 20 for r in e.reasons), "a refusal must say why"
        assert target in str(e) and op in str(e)
    else:
        assert entry.fn.__doc__, "a lowering documents what it emits"


def test_unknown_target_and_variant_are_refused_with_choices():
    with pytest.raises(ExportError, match="choose one of onnx, coreml, tensorrt"):
        targets.load("tflite")
    with pytest.raises(UnsupportedLowering, match="no lowering is registered"):
        registry.lookup("adaptex::budgeted_attention", "tflite", "sparse")
    with pytest.raises(UnsupportedLowering, match="choose one of sparse, dense"):
        registry.lookup("adaptex::budgeted_attention", "onnx", "fast")


def test_validator_reasons_are_collected_and_override_restores():
    targets.load_all()
    op = "adaptex::budgeted_attention"

    def picky_lowering(ctx, node):
        """Test lowering."""

    picky = registry.Lowering(op, "onnx", "sparse", picky_lowering,
                              validator=lambda node: "declines nodes without num_heads" if node is None else None)
    with registry.override(picky):
        # the picky entry declines, the next one accepts
        assert registry.lookup(op, "onnx", "sparse").fn.__name__ == "budgeted_attention_onnx_sparse"
        assert registry.lookup(op, "onnx", "sparse", node=object()).fn is picky_lowering
    assert all(e.fn is not picky_lowering for e in registry.cells()[(op, "onnx", "sparse")])


def test_all_declining_lists_every_reason():
    targets.load_all()
    op = "adaptex::budgeted_attention"

    def never(ctx, node):
        """Test lowering."""

    entries = [registry.Lowering(op, "onnx", "dense", never, validator=lambda n, i=i: f"reason {i}") for i in range(2)]
    with registry.override(*entries, replace=True):
        with pytest.raises(UnsupportedLowering) as e:
            registry.lookup(op, "onnx", "dense")
    assert e.value.reasons == ["never: reason 0", "never: reason 1"]
    assert registry.lookup(op, "onnx", "dense").fn.__name__ == "budgeted_attention_onnx_dense"


def test_every_op_has_a_core_ml_translation_and_its_mil_ops_an_evaluator(tmp_path):
    """A new op needs a Core ML emitter for each variant, and every MIL op those emit needs a numpy
    evaluator (the only Core ML oracle on Linux): the op x target test catches a missing one."""
    import adaptex
    from adaptex.runtimes.coreml_mil import EVAL, MilReferenceRunner
    from tests.support import user_models as um

    targets.load_all()
    for op in OPS:
        for variant in registry.VARIANTS:
            emit = registry.lookup(op, "coreml", variant).fn(None, None)
            assert callable(emit), f"{op} {variant}: the Core ML lowering returns no MIL emitter"
    models = [(um.patch_classifier(), um.patch_classifier_example(), None),
              (um.mixed_decoder(), um.decoder_example(), um.decoder_dynamic_shapes())]
    seen = set()
    for i, (model, example, dyn) in enumerate(models):
        for variant in registry.VARIANTS:
            path = tmp_path / f"m{i}{variant}.mlpackage"
            adaptex.export(model, example, path, target="coreml", variant=variant, dynamic_shapes=dyn,
                           validate=False)  # the op types are what this reads
            seen |= {o.op_type for o in MilReferenceRunner(path).program.functions["main"].operations}
    assert seen - {"const"} <= set(EVAL), f"MIL ops without an evaluator: {sorted(seen - set(EVAL) - {'const'})}"


def test_an_unsupported_cell_refuses_the_export_with_its_reason(tiny_checkpoint, tmp_path, capsys):
    """A cell declared with registry.unsupported (as a target that cannot lower an op would) stops the
    export before anything is written: one line naming the op, the target, the variant and the reason."""
    from adaptex.cli import main

    targets.load_all()
    op, reason = "adaptex::budgeted_attention", "this target has no runtime top-k (a planted refusal for the test)"

    def withdrawn(ctx, node):
        """The cell's lowering, withdrawn for the test."""

    placeholder = registry.Lowering(op, "onnx", "sparse", withdrawn, validator=lambda node: "withdrawn for the test")
    with registry.override(placeholder, replace=True):
        registry.unsupported(op, target="onnx", variant="sparse", reason=reason)
        with pytest.raises(UnsupportedLowering) as e:
            registry.lookup(op, "onnx", "sparse")
        assert reason in e.value.reasons
        out = tmp_path / "m.onnx"
        assert main(["export", str(tiny_checkpoint), "--target", "onnx", "-o", str(out)]) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("adaptex: error")]
        assert len(err) == 1 and op in err[0] and "onnx" in err[0] and reason in err[0], err
        assert not out.exists() and list(tmp_path.iterdir()) == []
        # the other variant's cell is untouched
        assert main(["export", str(tiny_checkpoint), "--target", "onnx", "--variant", "dense", "-o", str(out)]) == 0
    assert registry.lookup(op, "onnx", "sparse").fn.__name__ == "budgeted_attention_onnx_sparse"


# the tiny family whose export holds each op
HOLDS = {"adaptex::budgeted_attention": "bf", "adaptex::conditional_ffn": "tsa",
         "adaptex::conditional_attention": "tsa", "adaptex::elastic_attention": "el"}


@pytest.mark.parametrize("target", targets.BUILTIN)
@pytest.mark.parametrize("variant", registry.VARIANTS)
def test_every_cell_is_exported(artifacts, target, variant):
    """Every op x target x variant cell lowers a real model (the session's shared exports): its
    artifact records the cell's own lowering. For TensorRT, the bound ONNX an engine is built from."""
    from adaptex.runtimes.open import read_metadata

    targets.load_all()
    assert set(HOLDS) == set(OPS)
    for op, family in HOLDS.items():
        precision = "fp32" if target == "coreml" else None
        meta = read_metadata(artifacts(family, target, variant, precision))
        assert meta["variant"] == variant
        assert meta["lowerings"][op] == registry.lookup(op, target, variant).fn.__name__
