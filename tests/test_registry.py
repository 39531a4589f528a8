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
    from tests import user_models as um

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
            adaptex.export(model, example, path, target="coreml", variant=variant, dynamic_shapes=dyn)
            seen |= {o.op_type for o in MilReferenceRunner(path).program.functions["main"].operations}
    assert seen - {"const"} <= set(EVAL), f"MIL ops without an evaluator: {sorted(seen - set(EVAL) - {'const'})}"
