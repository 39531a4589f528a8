"""Quantized ONNX artifacts: a pass over an exported model that stores its weight matrices in int8
(or 4 bits) and runs them through ONNX Runtime's integer kernels, routers left fp32.

What it rewrites, in the main graph and every subgraph:
- MatMul / Gemm with a weight initializer: DynamicQuantizeLinear on the activation (uint8, one scale
  per call), MatMulInteger on the int8 weight, the product scaled back by the activation's scale times
  one scale per output column (ONNX Runtime fuses this into DynamicQuantizeMatMul); int4: MatMulNBits
  with one scale per block of `block` rows of a column;
- Gather of an embedding table: the int8 rows and their scales gathered, then dequantized (only the
  rows a call reads are ever made float);
- an adaptex op whose weights are initializers: its body is specialised (one overload per scheme).
  The body's weight-only part (layouts such as the per-head [H, d, 3hd] view of a QKV matrix) is
  evaluated here, once, and its results become the op's inputs: a matrix that reaches a MatMul only
  through Gathers (the selected heads) is stored int8 with one scale per head and column, and the
  Gathers read the int8 tensor and its scales, so heads are selected *before* dequantisation.
Routing layers' weights (graphs.nn.ROUTING_LAYERS, found by the exporter's trace record on each node)
stay fp32 unless `routers=True`: a router's score near its boundary flips under int8 noise.
"""
from __future__ import annotations

import ast

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from adaptex.exporter.errors import ExportError
from adaptex.exporter.quantize import Scheme
from adaptex.exporter.quantize import scheme_option as _scheme_option
from adaptex.exporter.targets.onnx.passes import subgraphs

SCHEMES = ("int8", "int4")
INT4_BLOCK = 32  # MatMulNBits' block along K: 32 is ONNX Runtime's default and its fastest CPU kernel
MS_DOMAIN = "com.microsoft"
_CLASS_KEY = "pkg.torch.onnx.class_hierarchy"


def scheme_option(value, routers=None) -> Scheme | None:
    """The quantize option as a Scheme (None: not quantized); a one-line error for a bad value."""
    return _scheme_option(value, routers, "onnx", SCHEMES)


# --- which initializers ---------------------------------------------------------------------------------

def _graphs(graph: onnx.GraphProto):
    yield graph
    for n in graph.node:
        for g in subgraphs(n):
            yield from _graphs(g)


def _all_nodes(proto: onnx.ModelProto):
    """(graph, node) for every node of the main graph, its subgraphs and the functions' bodies."""
    for g in _graphs(proto.graph):
        for n in g.node:
            yield g, n
    for f in proto.functions:
        for n in f.node:
            yield f, n
            for sub in subgraphs(n):
                for g in _graphs(sub):
                    for m in g.node:
                        yield g, m


def routing_initializers(proto: onnx.ModelProto) -> set[str]:
    """Initializers read by a node traced inside a routing layer (its trace record names the class),
    other than an adaptex op's call (its body is the layer's work, not its routing)."""
    from adaptex.graphs.nn import routing_class_names

    routing = set(routing_class_names())
    inits = {i.name for g in _graphs(proto.graph) for i in g.initializer}
    out = set()
    for g in _graphs(proto.graph):
        for n in g.node:
            if n.domain == "adaptex":
                continue
            record = next((p.value for p in n.metadata_props if p.key == _CLASS_KEY), None)
            try:
                classes = set(ast.literal_eval(record)) if record else set()
            except (ValueError, SyntaxError):
                classes = set()
            if classes & routing:
                out |= {i for i in n.input if i in inits}
    return out


# --- quantizing one tensor ----------------------------------------------------------------------------------

def int8_columns(w: np.ndarray, axis: int = -2) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 with one scale per slice along every axis but `axis` (the one reduced over):
    (int8 values, fp32 scales with `axis` kept as size 1)."""
    amax = np.abs(w).max(axis=axis, keepdims=True).astype(np.float32)
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
    return q, scale


def int4_blocks(w: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray, int]:
    """MatMulNBits' layout of a [K, N] weight: (uint8 [N, blocks, block/2] packed nibbles, fp32
    [N * blocks] scales, blocks). Symmetric 4 bits around the zero point 8 (the kernel's default)."""
    k, n = w.shape
    blocks = -(-k // block)
    padded = np.zeros((blocks * block, n), np.float32)
    padded[:k] = w
    cols = padded.T.reshape(n, blocks, block)  # (N, blocks, block)
    amax = np.abs(cols).max(axis=-1, keepdims=True)
    scale = np.where(amax > 0, amax / 7.0, 1.0).astype(np.float32)
    q = (np.clip(np.rint(cols / scale), -8, 7) + 8).astype(np.uint8)
    packed = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)  # low nibble first
    return packed, scale.reshape(-1), blocks


# --- the pass ---------------------------------------------------------------------------------------------

class _Pass:
    def __init__(self, proto: onnx.ModelProto, scheme: Scheme):
        self.proto, self.scheme = proto, scheme
        # a program merged behind an If keeps the weights only it reads in its branch (dispatch.py)
        self.inits = {i.name: i for g in _graphs(proto.graph) for i in g.initializer}
        self.routers = set() if scheme.routers else routing_initializers(proto)
        self.blocked = _read_otherwise(proto, set(self.inits))
        self.new_inits: dict[str, onnx.TensorProto] = {}
        self.by_content: dict[tuple, str] = {}
        self.cache: dict[tuple, tuple[str, ...]] = {}
        self.count = 0
        self.counts = {"matrices": 0, "embeddings": 0, "op_body_tensors": 0}

    def name(self, stem: str) -> str:
        self.count += 1
        return f"quant.{self.count}.{stem}"

    def add(self, name: str, array: np.ndarray) -> str:
        """An initializer holding `array`; one already added with the same contents where there is one
        (an op body computes one weight layout in two branches)."""
        import hashlib

        array = np.ascontiguousarray(array)
        key = (array.dtype.str, array.shape, hashlib.sha256(array.tobytes()).hexdigest())
        if key in self.by_content:
            return self.by_content[key]
        self.new_inits[name] = numpy_helper.from_array(array, name)
        self.by_content[key] = name
        return name

    def weight(self, name: str) -> np.ndarray | None:
        """The fp32 matrix an initializer holds, or None where it is not one this pass quantizes."""
        t = self.inits.get(name)
        if t is None or t.data_type != TensorProto.FLOAT or len(t.dims) != 2 or name in self.routers \
                or name in self.blocked:
            return None
        return numpy_helper.to_array(t)

    # -- integer MatMul --

    def int8_matmul(self, a: str, bq: str, bs: str, out: str, tag: str, fused: bool = True) -> list[onnx.NodeProto]:
        """out = a @ dequant(bq, bs): the activation quantized at run time, the product on integers.
        fused: the product scaled by (a's scale x bs) in one Mul, the pattern ONNX Runtime fuses into
        DynamicQuantizeMatMul (for a constant bq); else scaled twice, which it leaves alone: its fused
        kernel gave wrong values for a bq computed at run time with per-column scales (ONNX Runtime
        1.32, the op bodies' gathered heads: errors of 0.9 of the output's largest value)."""
        aq, ascale, azero, yi, yf, s = (f"{tag}.{k}" for k in ("a_q", "a_scale", "a_zero", "int32", "float", "scale"))
        head = [helper.make_node("DynamicQuantizeLinear", [a], [aq, ascale, azero], name=f"{tag}.quantize"),
                helper.make_node("MatMulInteger", [aq, bq, azero], [yi], name=f"{tag}.matmul"),
                helper.make_node("Cast", [yi], [yf], to=TensorProto.FLOAT, name=f"{tag}.cast")]
        if fused:
            return head + [helper.make_node("Mul", [ascale, bs], [s], name=f"{tag}.scales"),
                           helper.make_node("Mul", [yf, s], [out], name=f"{tag}.dequantize")]
        return head + [helper.make_node("Mul", [yf, ascale], [s], name=f"{tag}.activation_scale"),
                       helper.make_node("Mul", [s, bs], [out], name=f"{tag}.dequantize")]

    def matmul(self, a: str, name: str, w: np.ndarray, key: tuple, out: str) -> list[onnx.NodeProto]:
        """a @ w (w: [K, N]) on the scheme's kernel."""
        tag = self.name("matmul")
        if self.scheme.bits == 4 and w.shape[0] >= INT4_BLOCK:
            if key not in self.cache:
                packed, scales, _ = int4_blocks(w, INT4_BLOCK)
                self.cache[key] = (self.add(f"{name}.int4", packed), self.add(f"{name}.int4_scales", scales))
            bq, bs = self.cache[key]
            k, n = w.shape
            return [helper.make_node("MatMulNBits", [a, bq, bs], [out], domain=MS_DOMAIN, name=tag, K=k, N=n, bits=4,
                                     block_size=INT4_BLOCK)]
        if key not in self.cache:
            q, s = int8_columns(w)
            self.cache[key] = (self.add(f"{name}.int8", q), self.add(f"{name}.scale", s.reshape(-1)))
        bq, bs = self.cache[key]
        return self.int8_matmul(a, bq, bs, out, tag)

    # -- one graph --

    def rewrite_graph(self, graph: onnx.GraphProto) -> None:
        nodes = []
        for n in graph.node:
            for g in subgraphs(n):
                self.rewrite_graph(g)
            nodes += self.rewrite_node(n) or [n]
        del graph.node[:]
        graph.node.extend(nodes)

    def rewrite_node(self, n: onnx.NodeProto) -> list[onnx.NodeProto] | None:
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        if n.op_type == "MatMul" and n.domain in ("", "ai.onnx"):
            w = self.weight(n.input[1])
            if w is not None:
                self.counts["matrices"] += (n.input[1], False) not in self.cache
                return self.matmul(n.input[0], n.input[1], w, (n.input[1], False), n.output[0])
        if n.op_type == "Gemm" and n.domain in ("", "ai.onnx") and not attrs.get("transA", 0) \
                and attrs.get("alpha", 1.0) == 1.0 and attrs.get("beta", 1.0) == 1.0:
            w = self.weight(n.input[1])
            if w is not None:
                flip = bool(attrs.get("transB", 0))
                self.counts["matrices"] += (n.input[1], flip) not in self.cache
                if len(n.input) < 3 or not n.input[2]:
                    return self.matmul(n.input[0], n.input[1], w.T if flip else w, (n.input[1], flip), n.output[0])
                y = self.name("gemm")
                return self.matmul(n.input[0], n.input[1], w.T if flip else w, (n.input[1], flip), y) + [
                    helper.make_node("Add", [y, n.input[2]], [n.output[0]], name=f"{y}.bias")]
        if n.op_type == "Gather" and n.domain in ("", "ai.onnx") and attrs.get("axis", 0) == 0:
            w = self.weight(n.input[0])
            if w is not None:
                key = (n.input[0], "rows")
                if key not in self.cache:
                    q, s = int8_columns(w, axis=-1)  # one scale per row: a token's embedding
                    self.cache[key] = (self.add(f"{n.input[0]}.int8", q), self.add(f"{n.input[0]}.scale", s))
                    self.counts["embeddings"] += 1
                q, s = self.cache[key]
                tag = self.name("gather")
                return [helper.make_node("Gather", [q, n.input[1]], [f"{tag}.q"], axis=0, name=f"{tag}.rows"),
                        helper.make_node("Gather", [s, n.input[1]], [f"{tag}.s"], axis=0, name=f"{tag}.scales"),
                        helper.make_node("Cast", [f"{tag}.q"], [f"{tag}.f"], to=TensorProto.FLOAT, name=f"{tag}.cast"),
                        helper.make_node("Mul", [f"{tag}.f", f"{tag}.s"], [n.output[0]], name=f"{tag}.dequantize")]
        if n.domain == "adaptex":
            return self.bodies.call(n)
        return None


def quantize(proto: onnx.ModelProto, scheme: Scheme) -> dict:
    """Quantize `proto` in place by `scheme`; returns what the artifact's metadata records of it."""
    from adaptex.exporter.targets.onnx.quantize_bodies import Bodies

    folded = _unfold_branches(proto)
    p = _Pass(proto, scheme)
    p.bodies = Bodies(p)
    p.rewrite_graph(proto.graph)
    p.bodies.finish()
    _fold_branches(folded, list(p.new_inits.values()))
    used = _reads(proto)
    kept = []
    for g in _graphs(proto.graph):
        here = [i for i in g.initializer if i.name in used]
        del g.initializer[:]
        g.initializer.extend(here)
        kept += here
    proto.graph.initializer.extend(p.new_inits.values())
    if not any(o.domain == MS_DOMAIN for o in proto.opset_import) and scheme.bits == 4:
        proto.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    quantized = sum(p.counts.values())
    if not quantized:
        raise ExportError(f"--quantize {scheme.name}: this model has no weight matrix outside its routers to quantize")
    left = [i for i in kept if i.data_type == TensorProto.FLOAT and len(i.dims) >= 2]
    routers = sorted(i.name for i in left if i.name in p.routers)
    return {
        "scheme": scheme.name, "bits": scheme.bits,
        "weights": ("4-bit symmetric, one scale per block of "
                    f"{INT4_BLOCK} rows of a column (MatMulNBits); embeddings and the op bodies' gathered "
                    "heads int8, one scale per row / per head and column" if scheme.bits == 4 else
                    "int8 symmetric, one scale per output column (per row for embeddings, per head and column "
                    "in the op bodies)"),
        "activations": "uint8, one scale per call, computed at run time (DynamicQuantizeLinear)",
        "kernels": "MatMulNBits" if scheme.bits == 4 else "MatMulInteger",
        "routers": "quantized" if scheme.routers else "fp32",
        "quantized": dict(p.counts),
        "fp32_routers": routers,
        "fp32_other_matrices": len(left) - len(routers),
    }


def _rewritable(n: onnx.NodeProto, i: int) -> bool:
    """Whether _Pass rewrites this read (input `i` of `n`) of a weight."""
    if n.domain == "adaptex":
        return True
    if n.domain not in ("", "ai.onnx"):
        return False
    attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
    if n.op_type == "MatMul":
        return i == 1
    if n.op_type == "Gemm":
        return i == 1 and not attrs.get("transA", 0) and attrs.get("alpha", 1.0) == 1.0 and attrs.get("beta", 1.0) == 1.0
    return n.op_type == "Gather" and i == 0 and attrs.get("axis", 0) == 0


def _read_otherwise(proto: onnx.ModelProto, names: set[str]) -> set[str]:
    """The initializers among `names` that some node reads in a way the pass does not rewrite: they
    stay fp32 (quantizing the other reads would store the weight twice)."""
    out = set()
    for g in _graphs(proto.graph):
        for n in g.node:
            out |= {x for i, x in enumerate(n.input) if x in names and not _rewritable(n, i)}
        for o in g.output:
            out.add(o.name)
    return out & names


def _unfold_branches(proto: onnx.ModelProto) -> list[tuple[onnx.GraphProto, str]]:
    """Point a merged artifact's branches (dispatch.py) at the main graph's weights themselves, their
    fold Reshape pairs gone, so the pass sees which MatMul reads which weight; returns the branches
    that had pairs, with their tags, for _fold_branches."""
    from adaptex.exporter.targets.onnx import dispatch, programs

    out = []
    for g in list(_graphs(proto.graph))[1:]:
        tags = {n.name[len(dispatch.RESERVED):].split(".fold.")[0] for n in g.node
                if n.op_type == "Reshape" and n.name.startswith(dispatch.RESERVED) and ".fold." in n.name}
        if len(tags) == 1:
            kept = programs._unfolded(list(g.node))
            del g.node[:]
            g.node.extend(kept)
            out.append((g, tags.pop()))
    return out


def _fold_branches(folded: list[tuple[onnx.GraphProto, str]], weights: list[onnx.TensorProto]) -> None:
    """Give each branch that had fold pairs its pairs again, for the quantized weights it reads (ONNX
    Runtime folds them into the branch at load: an If branch reading main-graph initializers pays for
    them on every call, dispatch.py)."""
    from adaptex.exporter.targets.onnx import dispatch
    from adaptex.graphs.ops.policy import OrtPolicy

    for g, tag in folded:
        nodes = list(g.node)
        fold, inits = dispatch._local_weights(nodes, weights, tag, OrtPolicy().copied_up_to)
        del g.node[:]
        g.node.extend(fold + nodes)
        g.initializer.extend(inits)


def _reads(proto: onnx.ModelProto) -> set[str]:
    """Every value name a node of the model reads (main graph, subgraphs, function bodies)."""
    out = {o.name for o in proto.graph.output}
    for g, n in _all_nodes(proto):
        out.update(i for i in n.input if i)
        for sub in subgraphs(n):
            out.update(o.name for o in sub.output)
    return out
