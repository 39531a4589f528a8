"""A static check of an ONNX model against the rules of TensorRT's ONNX parser, runnable anywhere.

TensorRT cannot run on most machines that export models, so the ONNX handed to its parser is
checked here instead: every node, including those inside model-local functions (which the parser
inlines), against a table of rules. Each rule names the TensorRT versions it holds for and is listed
in docs/tensorrt.md; `lint(model, version)` returns the violations of the rules that hold for
`version`, each naming its rule. A rule here is what the parser is documented (or was reported) to
refuse; it is not a guarantee that an engine builds, which only TensorRT itself can give.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

DEFAULT_VERSION = "10.0"  # the oldest 10.x: every rule only relaxes in later versions, so it is the strictest

# ai.onnx operators the TensorRT 10 parser imports (its operator support matrix, "Y" rows), restricted
# to those an exported Transformer can contain plus common neighbours. An op missing from this set is
# reported by `operator-table`; add one only with the parser's matrix saying it is supported.
SUPPORTED_OPS = frozenset("""
Abs Acos Acosh Add And ArgMax ArgMin Asin Asinh Atan Atanh AveragePool BatchNormalization Cast CastLike
Ceil Celu Clip Concat Constant ConstantOfShape Conv ConvTranspose Cos Cosh CumSum DepthToSpace
DequantizeLinear Div Dropout Einsum Elu Equal Erf Exp Expand EyeLike Flatten Floor Gather GatherElements
GatherND Gelu Gemm GlobalAveragePool GlobalMaxPool Greater GreaterOrEqual GroupNormalization HardSigmoid
HardSwish Identity If InstanceNormalization IsInf IsNaN LayerNormalization LeakyRelu Less LessOrEqual Log
LogSoftmax Loop LpNormalization MatMul Max MaxPool Mean Min Mod Mul Neg NonZero Not OneHot Or Pad Pow PRelu
QuantizeLinear Range Reciprocal ReduceL1 ReduceL2 ReduceLogSum ReduceLogSumExp ReduceMax ReduceMean ReduceMin
ReduceProd ReduceSum ReduceSumSquare Relu Reshape Resize Round ScatterElements ScatterND Selu Shape Shrink
Sigmoid Sign Sin Sinh Size Slice Softmax Softplus Softsign SpaceToDepth Split Sqrt Squeeze Sub Sum Tan Tanh
ThresholdedRelu Tile TopK Transpose Trilu Unsqueeze Where Xor
""".split())

# ...and those its matrix marks unsupported ("N"), reported by name.
UNSUPPORTED_OPS = frozenset("""
AffineGrid Bernoulli BitShift BitwiseAnd BitwiseNot BitwiseOr BitwiseXor CenterCropPad Col2Im Compress
ConcatFromSequence ConvInteger DFT Det DynamicQuantizeLinear ImageDecoder MatMulInteger MaxRoiPool MaxUnpool
MelWeightMatrix Multinomial NegativeLogLikelihoodLoss Optional OptionalGetElement OptionalHasElement QLinearConv
QLinearMatMul RegexFullMatch SequenceAt SequenceConstruct SequenceEmpty SequenceErase SequenceInsert
SequenceLength SequenceMap SoftmaxCrossEntropyLoss SplitToSequence StringConcat StringNormalizer StringSplit
TfIdfVectorizer Unique
""".split())

# TensorRT's DataType has no such tensors (NvInferRuntimeBase.h: kFLOAT, kHALF, kBF16, kINT8, kINT32,
# kINT64, kBOOL, kUINT8, kFP8, kINT4)
BAD_DTYPES = {TensorProto.STRING: "string", TensorProto.COMPLEX64: "complex64", TensorProto.COMPLEX128: "complex128",
              TensorProto.UINT16: "uint16", TensorProto.UINT32: "uint32", TensorProto.UINT64: "uint64",
              TensorProto.INT16: "int16", TensorProto.DOUBLE: "float64"}
TOPK_MAX_K = 3840


def _version(v: str) -> tuple[int, int]:
    parts = str(v).split(".")
    if not all(p.isascii() and p.isdigit() for p in parts[:2]):
        raise ValueError(f"TensorRT version {v!r} is not of the form MAJOR.MINOR (e.g. 10.8)")
    return int(parts[0]), int(parts[1]) if len(parts) > 1 else 0


@dataclass
class Where:
    """Where a node sits: the main graph, or a function body reached through a call node."""
    node: onnx.NodeProto
    function: str | None = None  # the local function's name, when the node is inside one
    call: str | None = None  # the calling node's name

    def describe(self) -> str:
        name = self.node.name or "(unnamed)"
        inside = f" in function {self.function} (called by {self.call})" if self.function else ""
        return f"{self.node.op_type} node {name}{inside}"


@dataclass
class Context:
    """What rules may look up about values: dtypes, shapes, constants, producers."""
    dtypes: dict[str, int] = field(default_factory=dict)
    shapes: dict[str, list] = field(default_factory=dict)  # ints, or dim names / None when dynamic
    constants: dict[str, np.ndarray] = field(default_factory=dict)
    graph_io: set = field(default_factory=set)
    opset: int = 0
    version: tuple[int, int] = (10, 0)

    def const(self, name: str):
        return self.constants.get(name)


@dataclass(frozen=True)
class Rule:
    name: str
    since: str | None  # first TensorRT version the rule holds for (None: every version)
    until: str | None  # last version it holds for (None: still holds)
    what: str  # one line for the docs table
    check: Callable[[onnx.NodeProto, Context], "str | None"]
    source: str = ""

    def holds_for(self, version: tuple[int, int]) -> bool:
        return (self.since is None or version >= _version(self.since)) and (
            self.until is None or version <= _version(self.until))

    def span(self) -> str:
        lo, hi = self.since or "all", self.until
        return f"{lo}+" if hi is None and self.since else (f"{lo}-{hi}" if hi else "all")


@dataclass(frozen=True)
class Violation:
    rule: str
    where: str
    message: str

    def __str__(self) -> str:
        return f"[{self.rule}] {self.where}: {self.message}"


# --- rules ----------------------------------------------------------------------------------------

def _attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            v = onnx.helper.get_attribute_value(a)
            return v.decode() if isinstance(v, bytes) else v
    return default


def _has_attr(node: onnx.NodeProto, name: str) -> bool:
    return any(a.name == name for a in node.attribute)


def _operator_table(node, ctx):
    if node.domain not in ("", "ai.onnx"):
        return None  # custom domains: `custom-op-body`
    if node.op_type in UNSUPPORTED_OPS:
        return f"{node.op_type} is marked unsupported in TensorRT's ONNX operator matrix"
    if node.op_type not in SUPPORTED_OPS:
        return (f"{node.op_type} is not in adaptex's table of operators TensorRT's parser imports; "
                "express it with supported operators")
    return None


def _topk_sorted(node, ctx):
    if node.op_type == "TopK" and _attr(node, "sorted", 1) == 0:
        return "sorted=0: TensorRT's operator matrix requires sorted=1 (its TopK always sorts); set sorted=1"
    return None


def _topk_k_initializer(node, ctx):
    if node.op_type == "TopK" and len(node.input) > 1 and ctx.const(node.input[1]) is None:
        return ("K is computed at run time; TensorRT before 8.6 needs K as an initializer "
                "('K must be an initializer'); build with TensorRT 10 or export the dense variant")
    return None


def _topk_k_limit(node, ctx):
    if node.op_type != "TopK" or len(node.input) < 2:
        return None
    k = ctx.const(node.input[1])
    if k is not None:
        k = int(np.asarray(k).reshape(-1)[0])
        return None if k <= TOPK_MAX_K else f"K = {k} exceeds TensorRT's TopK limit of {TOPK_MAX_K}"
    shape = ctx.shapes.get(node.input[0])
    axis = _attr(node, "axis", -1)
    dim = shape[axis] if shape and -len(shape) <= axis < len(shape) else None
    if isinstance(dim, int) and dim > 0:
        return None if dim <= TOPK_MAX_K else \
            f"runtime K over an axis of {dim} > {TOPK_MAX_K} elements may exceed TensorRT's TopK limit"
    return (f"runtime K over an axis of unknown size: nothing bounds K by {TOPK_MAX_K} (a larger K fails when "
            "the engine runs, not when it builds); give the axis a static size")


def _scatternd_reduction(node, ctx):
    if node.op_type == "ScatterND" and _attr(node, "reduction", "none") != "none":
        return (f"reduction={_attr(node, 'reduction')!r}: TensorRT's ScatterND only overwrites; "
                "drop the reduction (or accumulate with ScatterElements)")
    return None


def _scatternd_reduction_attr(node, ctx):
    if node.op_type == "ScatterND" and _has_attr(node, "reduction"):
        return ("carries a 'reduction' attribute (even 'none'); TensorRT up to 10.8 refuses any; "
                "omit the attribute")
    return None


def _if_branches(node, ctx):
    if node.op_type != "If":
        return None
    then_g, else_g = _attr(node, "then_branch"), _attr(node, "else_branch")
    if then_g is None or else_g is None:
        return None
    if len(then_g.output) != len(else_g.output):
        return f"the branches give {len(then_g.output)} and {len(else_g.output)} outputs; give both the same"
    for i, (a, b) in enumerate(zip(then_g.output, else_g.output)):
        ra = len(a.type.tensor_type.shape.dim) if a.type.tensor_type.HasField("shape") else None
        rb = len(b.type.tensor_type.shape.dim) if b.type.tensor_type.HasField("shape") else None
        if ra is not None and rb is not None and ra != rb:
            return f"output {i}: the then branch has rank {ra} and the else branch rank {rb}; make them equal"
        if a.name == b.name:
            return f"output {i}: both branches name it {a.name!r}; give the branches' outputs different names"
    return None


_REDUCE = {"ReduceMax", "ReduceMin", "ReduceMean", "ReduceProd", "ReduceL1", "ReduceL2", "ReduceLogSum",
           "ReduceLogSumExp", "ReduceSumSquare"}


def _axes_input(node, ctx) -> int | None:
    if node.op_type in ("Squeeze", "Unsqueeze", "ReduceSum") or (node.op_type in _REDUCE and ctx.opset >= 18):
        return 1 if len(node.input) > 1 and node.input[1] else None
    return None


def _axes_constant(node, ctx):
    idx = _axes_input(node, ctx)
    if idx is not None and ctx.const(node.input[idx]) is None:
        return f"its axes (input {idx}) are computed at run time; TensorRT needs them as a constant"
    return None


def _squeeze_axes_omitted(node, ctx):
    if node.op_type == "Squeeze" and (len(node.input) < 2 or not node.input[1]) and not _has_attr(node, "axes"):
        shape = ctx.shapes.get(node.input[0])
        if shape is None or any(not isinstance(d, int) or d <= 0 for d in shape):
            return "no axes on an input of dynamic shape; name the axes to squeeze"
    return None


def _dtypes(node, ctx):
    for name in list(node.input) + list(node.output):
        t = ctx.dtypes.get(name)
        if t in BAD_DTYPES:
            return f"value {name!r} has dtype {BAD_DTYPES[t]}, which TensorRT has no tensors for"
        if t == TensorProto.UINT8 and name not in ctx.graph_io:
            return f"value {name!r} is uint8 inside the graph; TensorRT takes uint8 only as a network input or output"
    return None


_NONZERO_TYPES = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.INT32, TensorProto.INT64,
                  TensorProto.INT8, TensorProto.BOOL}


def _nonzero_type(node, ctx):
    if node.op_type == "NonZero":
        t = ctx.dtypes.get(node.input[0])
        if t is not None and t not in _NONZERO_TYPES:
            return f"input of dtype {onnx.helper.tensor_dtype_to_string(t)}; cast it to bool or float first"
    return None


def _layernorm_outputs(node, ctx):
    if node.op_type == "LayerNormalization" and len([o for o in node.output if o]) > 1:
        return "uses the Mean / InvStdDev outputs; TensorRT gives only Y"
    return None


def _split_args(node, ctx):
    if node.op_type == "Split" and _has_attr(node, "num_outputs"):
        if len(node.input) > 1 and node.input[1]:
            return "has both a 'split' input and 'num_outputs'; give one"
        if _attr(node, "num_outputs") != len(node.output):
            return f"num_outputs={_attr(node, 'num_outputs')} but {len(node.output)} outputs"
    return None


def _cumsum_float(node, ctx):
    if node.op_type == "CumSum":
        t = ctx.dtypes.get(node.input[0])
        if t is not None and t not in (TensorProto.FLOAT, TensorProto.FLOAT16):
            return (f"CumSum over {onnx.helper.tensor_dtype_to_string(t).split('.')[-1].lower()}: TensorRT before "
                    "10.8 sums float32 and float16 only; cast to float (counts are exact below 2^24)")
    return None


def _gemm_dtype(node, ctx):
    if node.op_type in ("Gemm", "MatMul"):
        for name in node.input[:2]:
            if ctx.dtypes.get(name) in (TensorProto.INT32, TensorProto.INT64, TensorProto.INT8):
                return f"integer operand {name!r}; TensorRT multiplies floating-point matrices only"
    return None


RULES: list[Rule] = [
    Rule("operator-table", None, None,
         "every ai.onnx node is an operator the parser imports (not an N row of its operator matrix)",
         _operator_table, "onnx-tensorrt docs/operators.md (10.15)"),
    Rule("custom-op-body", None, None,
         "a custom-domain node has a model-local function of its name (inlined since 9.0) or a named plugin",
         lambda n, c: None, "onnx-tensorrt Changelog 9.0 (local functions)"),
    Rule("function-call-arity", "9.0", None,
         "a call to a local function passes as many inputs as the function declares",
         lambda n, c: None, "onnx-tensorrt ModelImporter (local function import)"),
    Rule("function-names-private", "9.0", "10.7",
         "a local function's formal inputs and outputs share no name with a main-graph tensor",
         lambda n, c: None, "onnx-tensorrt Changelog 10.8 (function inputs bound to same-named outer tensors)"),
    Rule("function-attr-ref", "9.0", None,
         "attribute references in function bodies are scalars, lists or tensors (not graphs, dtypes or string lists)",
         lambda n, c: None, "onnx-tensorrt OnnxAttrs.cpp"),
    Rule("topk-sorted", None, None, "TopK has sorted=1", _topk_sorted, "onnx-tensorrt docs/operators.md (10.15)"),
    Rule("topk-k-initializer", None, "8.5", "TopK's K is an initializer (a runtime K arrived in 8.6)",
         _topk_k_initializer, "onnx-tensorrt Changelog 8.6; NVIDIA/TensorRT#2721"),
    Rule("topk-k-limit", "8.6", None,
         f"TopK's K is at most {TOPK_MAX_K}: a constant, or bounded by a static axis size", _topk_k_limit,
         "TensorRT operator docs: TopK"),
    Rule("scatternd-reduction", None, None, "ScatterND has no reduction other than 'none'", _scatternd_reduction,
         "onnx-tensorrt docs/operators.md (10.15)"),
    Rule("scatternd-reduction-attr", None, "10.8", "ScatterND carries no 'reduction' attribute at all",
         _scatternd_reduction_attr, "onnx-tensorrt Changelog 10.9 (opset 18+ ScatterND fixed)"),
    Rule("if-branches", None, None,
         "If's branches give as many outputs, of equal rank, under different names", _if_branches,
         "onnx-tensorrt docs/operators.md (10.15): If"),
    Rule("axes-constant", None, None, "Squeeze / Unsqueeze / Reduce* axes are constants", _axes_constant,
         "onnx-tensorrt docs/operators.md (10.15)"),
    Rule("squeeze-axes-omitted", None, "11.4", "Squeeze without axes has an input of static shape",
         _squeeze_axes_omitted, "TensorRT 11.5 release notes"),
    Rule("tensor-dtype", None, None,
         "no string, complex, float64, int16 or unsigned 16-64-bit tensors; uint8 only at the graph's edge",
         _dtypes, "onnx-tensorrt docs/operators.md (types); NvInferRuntimeBase.h DataType"),
    Rule("nonzero-input-type", "8.5", None, "NonZero's input is float, int or bool", _nonzero_type,
         "onnx-tensorrt NonZero importer"),
    Rule("layernorm-outputs", "8.6", None, "LayerNormalization's Mean and InvStdDev outputs are unused",
         _layernorm_outputs, "onnx-tensorrt op checkers"),
    Rule("split-arguments", None, None, "Split gives either a split input or num_outputs, matching its outputs",
         _split_args, "onnx-tensorrt Split importer"),
    Rule("float-matmul", None, None, "Gemm and MatMul multiply floating-point operands", _gemm_dtype,
         "onnx-tensorrt docs/operators.md (10.15)"),
    Rule("cumsum-float", None, "10.7", "CumSum sums float32 or float16 (int32/int64 arrived in 10.8)", _cumsum_float,
         "onnx-tensorrt docs/operators.md before 10.8 (CumSum: FP32, FP16) and its 10.8 changelog"),
]
RULES_BY_NAME = {r.name: r for r in RULES}
MODEL_RULES = {"custom-op-body", "function-call-arity", "function-attr-ref", "function-names-private"}  # checked on the model, not per node


# --- the walk -------------------------------------------------------------------------------------

def _named_copy(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy whose nodes all have names, function bodies' (their branches' too) prefixed by their function."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for i, n in enumerate(m.graph.node):
        if not n.name:
            n.name = f"{n.op_type}_{i}"
    for f in m.functions:
        for i, n in enumerate(f.node):
            n.name = f"{f.name}/{n.name or f'{n.op_type}_{i}'}"
            _name_branches(n)
    return m


def _name_branches(node: onnx.NodeProto) -> None:
    # the unnamed nodes of a node's subgraphs (If branches) take the node's name and the branch's
    for a in node.attribute:
        for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
            for j, n in enumerate(g.node):
                n.name = n.name or f"{node.name}.{a.name}/{n.op_type}_{j}"
                _name_branches(n)


def _context(model: onnx.ModelProto, version: tuple[int, int]) -> tuple[onnx.ModelProto, Context]:
    """The inlined model (what the parser builds from) with inferred dtypes and shapes."""
    import onnx.inliner

    inlined = onnx.inliner.inline_local_functions(model)
    try:
        inferred = onnx.shape_inference.infer_shapes(inlined, data_prop=True)
    except Exception:
        inferred = inlined
    ctx = Context(version=version)
    ctx.opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    g = inferred.graph
    for vi in list(g.input) + list(g.output) + list(g.value_info):
        tt = vi.type.tensor_type
        ctx.dtypes[vi.name] = tt.elem_type
        if tt.HasField("shape"):
            ctx.shapes[vi.name] = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                                   for d in tt.shape.dim]
    for sub in _all_graphs(g):  # If/Loop bodies have initializers and constants of their own
        for init in sub.initializer:
            ctx.constants[init.name] = numpy_helper.to_array(init)
            ctx.dtypes[init.name] = init.data_type
            ctx.shapes[init.name] = list(init.dims)
        for n in sub.node:
            if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value":
                ctx.constants[n.output[0]] = numpy_helper.to_array(n.attribute[0].t)
    return inferred, ctx


def _all_graphs(graph: onnx.GraphProto):
    yield graph
    for n in graph.node:
        for a in n.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                yield from _all_graphs(a.g)
            elif a.type == onnx.AttributeProto.GRAPHS:
                for g in a.graphs:
                    yield from _all_graphs(g)


def _where(node: onnx.NodeProto, functions: set[str], callers: dict[str, list[str]]) -> str:
    # inlined nodes are named "<function>/<node>__<call index>" (see _named_copy and onnx.inliner)
    name = node.name
    fn = name.split("/", 1)[0] if "/" in name else None
    if fn in functions:
        base, _, idx = name.rpartition("__")
        calls = callers.get(fn, [])
        call = calls[int(idx) - 1] if idx.isdigit() and 0 < int(idx) <= len(calls) else None
        inside = f"in function {fn}" + (f" (called by {call})" if call else "")
        return f"{node.op_type} node {base.split('/', 1)[1] if base else name} {inside}"
    return f"{node.op_type} node {name}"


def _model_violations(named: onnx.ModelProto, active: set[str], plugins: tuple[str, ...],
                      callers: dict[str, list[str]], ver: tuple[int, int]) -> list[Violation]:
    out = []
    inlines = ver >= (9, 0)  # local functions are inlined since TensorRT 9.0; before, only plugins serve
    bodies = {f.name: f for f in named.functions}  # the parser matches functions by name only
    for n in named.graph.node:
        if n.domain in ("", "ai.onnx"):
            continue
        callers.setdefault(n.op_type, []).append(n.name)
        f = bodies.get(n.op_type)
        plugin = n.op_type in plugins or f"{n.domain}.{n.op_type}" in plugins
        if (f is None or not inlines) and not plugin and "custom-op-body" in active:
            why = "has no model-local function" if inlines else "needs a plugin (TensorRT before 9.0 inlines no functions)"
            out.append(Violation("custom-op-body", f"{n.op_type} node {n.name}",
                                 f"custom op {n.domain}.{n.op_type} {why} and no plugin was named; "
                                 "ship its body in model.functions and build with TensorRT 10"))
        if f is not None and len(n.input) != len(f.input) and "function-call-arity" in active:
            out.append(Violation("function-call-arity", f"{n.op_type} node {n.name}",
                                 f"passes {len(n.input)} inputs to function {f.name}, which declares {len(f.input)}"))
    if "custom-op-body" in active:  # inside the bodies: another runtime's contrib op (ONNX Runtime's
        # com.microsoft kernels) is no TensorRT operator, and no body ships for it
        for f in named.functions:
            for n in (x for g in _all_graphs(onnx.helper.make_graph(f.node, f.name, [], [])) for x in g.node):
                if n.domain in ("", "ai.onnx") or n.op_type in bodies:
                    continue
                if n.op_type in plugins or f"{n.domain}.{n.op_type}" in plugins:
                    continue
                out.append(Violation("custom-op-body", f"{n.op_type} node {n.name}",
                                     f"{n.domain}.{n.op_type} inside function {f.name} is neither a model-local "
                                     "function nor a named plugin, so TensorRT's parser cannot import it; export "
                                     "for --target tensorrt (its bodies use standard operators only)"))
    if "function-names-private" in active:
        g = named.graph
        outer = {v.name for v in list(g.input) + list(g.output)} | {i.name for i in g.initializer} | \
            {o for n in g.node for o in n.output}
        for f in named.functions:
            clash = sorted(outer & (set(f.input) | set(f.output)))
            if clash:
                out.append(Violation("function-names-private", f"function {f.name}",
                                     f"its formal names {clash[:3]} are also main-graph tensors, which TensorRT "
                                     "before 10.8 binds instead of the call's arguments; rename them"))
    if "function-attr-ref" in active:
        bad = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS, onnx.AttributeProto.STRINGS)
        for f in named.functions:
            for n in f.node:
                for a in n.attribute:
                    if a.ref_attr_name and (a.type in bad or (n.op_type == "Cast" and a.name == "to")):
                        out.append(Violation("function-attr-ref", f"{n.op_type} node {n.name}",
                                             f"attribute {a.name} refers to the caller's {a.ref_attr_name}, which "
                                             "TensorRT's parser does not resolve for this kind; write the value in"))
    return out


def lint(model: onnx.ModelProto, version: str = DEFAULT_VERSION, plugins: tuple[str, ...] = ()) -> list[Violation]:
    """Every violation, by rule, of the rules that hold for TensorRT `version`. `plugins` names
    custom ops (Op or domain.Op) that a registered plugin implements instead of a function."""
    ver = _version(version)
    active = {r.name for r in RULES if r.holds_for(ver)}
    named = _named_copy(model)
    callers: dict[str, list[str]] = {}
    out = _model_violations(named, active, plugins, callers, ver)
    functions = {f.name for f in named.functions}
    inlined, ctx = _context(named, ver)
    ctx.graph_io = {v.name for v in list(model.graph.input) + list(model.graph.output)}
    node_rules = [r for r in RULES if r.name in active and r.name not in MODEL_RULES]
    for node in _all_nodes(inlined.graph):
        for rule in node_rules:
            msg = rule.check(node, ctx)
            if msg:
                out.append(Violation(rule.name, _where(node, functions, callers), msg))
    return out


def _all_nodes(graph: onnx.GraphProto):
    """Every node, If/Loop bodies included."""
    for g in _all_graphs(graph):
        yield from g.node


def rules_table() -> str:
    """The rule table as markdown (docs/tensorrt.md embeds it; a test keeps the two equal)."""
    rows = ["| rule | TensorRT versions | what the parser needs | source |", "|---|---|---|---|"]
    for r in RULES:
        rows.append(f"| `{r.name}` | {r.span()} | {r.what} | {r.source} |")
    return "\n".join(rows)


if __name__ == "__main__":  # print the docs' rule table
    print(rules_table())
