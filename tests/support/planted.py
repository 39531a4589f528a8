"""Surgery on a copy of an exported ONNX artifact, for tests that must fail when the product is wrong:
bugs planted as a reviewer would plant them (a wrong function body, a wrong routing node), weights
and op inputs poisoned, intermediates of a function body exposed as outputs so that the runtime
itself says how many rows or heads it computed. Bodies are found by structure (the op that feeds a
Softmax, the Gather indexed by TopK's order), never by the exporter's numbering, so a changed body
breaks these helpers loudly rather than silently planting nothing."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def load(path) -> onnx.ModelProto:
    return onnx.load(str(path))


def general(path) -> onnx.ModelProto:
    """The artifact at `path`, or where it holds other programs too (metadata `programs`: a
    decoder's large-call, short-call or decode-step program) its general program as an artifact of
    its own, with the file's metadata less the other programs' guards."""
    from adaptex.exporter.metadata import read_onnx_metadata
    from adaptex.exporter.targets.onnx import programs, stamp

    proto, meta = load(path), read_onnx_metadata(path)
    names = [p["name"] for p in meta.get("programs") or []]
    if len(names) < 2:
        return proto
    program = programs.program(proto, programs.path_of(names.index("general"), len(names)))
    stamp(program, {k: v for k, v in meta.items() if k != "programs"}, proto.doc_string)
    return program


def save(proto: onnx.ModelProto, path) -> Path:
    onnx.save_model(proto, str(path))
    return Path(path)


def function(proto: onnx.ModelProto, name: str) -> onnx.FunctionProto:
    found = [f for f in proto.functions if f.name == name]
    assert found, f"no function {name} in the model (it has {[f.name for f in proto.functions]})"
    return found[0]


def calls(proto: onnx.ModelProto, name: str) -> list[onnx.NodeProto]:
    return [n for n in proto.graph.node if n.op_type == name and n.domain == "adaptex"]


def walk(nodes):
    """(container, node) for every node of a body, the If branches' nodes included (the ONNX Runtime
    lowerings of TSA's ops dispatch on the kept count: none, all, or some tokens kept)."""
    for n in nodes:
        yield nodes, n
        for a in n.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                yield from walk(a.g.node)


def producer(nodes, value: str) -> onnx.NodeProto:
    found = [n for _, n in walk(nodes) if value in n.output]
    assert found, f"nothing produces {value}"
    return found[0]


def only(nodes, op_type: str) -> onnx.NodeProto:
    found = [n for _, n in walk(nodes) if n.op_type == op_type]
    assert len(found) == 1, f"expected one {op_type}, found {len(found)}"
    return found[0]


def _insert_after(nodes, anchor: onnx.NodeProto, new: list[onnx.NodeProto]) -> list[onnx.NodeProto]:
    """Insert `new` right after `anchor`, in the body or branch that holds it (node lists are
    topologically ordered); returns the inserted nodes as they now live in the list (the messages
    passed in are copied)."""
    nodes = next(c for c, n in walk(nodes) if n == anchor)
    at = next(i for i, n in enumerate(nodes) if n == anchor) + 1
    for j, n in enumerate(new):
        nodes.insert(at + j, n)
    return [nodes[at + j] for j in range(len(new))]


def _rewire(nodes, old: str, new: str) -> int:
    n = 0
    for _, node in walk(nodes):
        for i, v in enumerate(node.input):
            if v == old:
                node.input[i] = new
                n += 1
    assert n, f"nothing reads {old}"
    return n


def const_value(proto: onnx.ModelProto, name: str) -> np.ndarray:
    for init in proto.graph.initializer:
        if init.name == name:
            return numpy_helper.to_array(init)
    node = producer(proto.graph.node, name)
    assert node.op_type == "Constant", f"{name} is made by a {node.op_type}, not a constant"
    return numpy_helper.to_array(node.attribute[0].t)


def initializer(proto: onnx.ModelProto, name: str) -> onnx.TensorProto:
    return next(i for i in proto.graph.initializer if i.name == name)


# --- value bugs: the decisions reported right, the computation wrong ----------------------------------

def lowest_heads(proto: onnx.ModelProto, fname: str = "BudgetedAttention") -> onnx.ModelProto:
    """BudgetedAttention (sparse): the *lowest*-scored heads computed, while the head mask (scattered
    from the top-k order) still reports the right ones. Both of ONNX Runtime's bodies get it: the
    per-sample one gathers those heads' weights, the one by head (a mixed-k batch) runs each head on
    the samples whose lowest heads include it, the one on every active head takes the heads some
    sample's lowest include."""
    f = function(proto, fname)
    topk = only(f.node, "TopK")
    order = topk.output[1]
    low = helper.make_node("TopK", list(topk.input), ["planted.low_v", "planted.low_order"], axis=-1, largest=0,
                           sorted=1)
    _insert_after(f.node, topk, [low])
    gathers = [n for _, n in walk(f.node) if n.op_type == "Gather" and n.input[1] == order]
    # three a per-sample body (its Q/K/V weights, biases and output columns), which two branches hold
    assert len(gathers) == 6, "the sparse body gathers Q/K/V weights, biases and output columns by the order"
    for n in gathers:
        n.input[1] = "planted.low_order"
    scatter = next((n for n in f.node if n.op_type == "ScatterElements" and n.input[1] == order), None)
    if scatter is not None:  # the mask the other bodies select by, and the If that picks the body reads
        mask = scatter.output[0]
        _insert_after(f.node, scatter, [helper.make_node(
            "ScatterElements", [scatter.input[0], "planted.low_order", scatter.input[2]], ["planted.low_mask"], axis=1)])
        for _, n in walk(f.node):  # all but the reported head mask (the Cast to bool)
            if n.op_type != "Cast":
                n.input[:] = ["planted.low_mask" if x == mask else x for x in n.input]
    return proto


def ffn_on_skipped_tokens(proto: onnx.ModelProto, fname: str = "ConditionalFFN") -> onnx.ModelProto:
    """ConditionalFFN (sparse): the FFN gathers and updates the skipped tokens instead of the kept ones
    (their gate is zero, so the kept tokens simply miss their update)."""
    f = function(proto, fname)
    nz = only(f.node, "NonZero")
    flipped = helper.make_node("Not", [nz.input[0]], ["planted.skipped"])
    _insert_after(f.node, producer(f.node, nz.input[0]), [flipped])
    nz.input[0] = "planted.skipped"
    return proto


def queries_of_skipped_tokens(proto: onnx.ModelProto, fname: str = "ConditionalAttention") -> onnx.ModelProto:
    """ConditionalAttention (sparse): the skipped tokens' query rows ordered first and attended
    instead of the kept ones' (TopK of the keep mask taken smallest-first; in the TensorRT body's
    CumSum partition, the kept and skipped slots swapped)."""
    f = function(proto, fname)
    topk = [n for _, n in walk(f.node) if n.op_type == "TopK"]
    if topk:
        attr = next(a for a in topk[0].attribute if a.name == "largest")
        attr.i = 0
        return proto
    keep, gate = f.input[2], f.input[3]
    slot = [n for _, n in walk(f.node) if n.op_type == "Where" and n.input[0] == keep and n.input[1] != gate]
    assert len(slot) == 1, "the CumSum partition picks a slot per token by keep once"
    slot[0].input[1], slot[0].input[2] = slot[0].input[2], slot[0].input[1]
    return proto


def sa_heads_as_fa(proto: onnx.ModelProto, fname: str = "ElasticAttention") -> onnx.ModelProto:
    """ElasticAttention (sparse): every (batch, head) pair attends fully, whatever its reported mode
    (every read of the body's sa input reads False instead)."""
    f = function(proto, fname)
    sa = f.input[3]
    _rewire(f.node, sa, "planted.no_sa")
    f.node.insert(0, helper.make_node("Not", [sa], ["planted.not_sa"]))
    f.node.insert(1, helper.make_node("And", [sa, "planted.not_sa"], ["planted.no_sa"]))
    return proto


def in_last_call(proto: onnx.ModelProto, fname: str, bug) -> onnx.ModelProto:
    """Apply `bug` to a copy of function `fname` that only its last call uses, so that no later
    routing sees the wrong values: the artifact's every decision stays right."""
    f = function(proto, fname)
    copy = onnx.FunctionProto()
    copy.CopyFrom(f)
    copy.name = fname + "Planted"
    proto.functions.append(copy)
    calls(proto, fname)[-1].op_type = copy.name
    return bug(proto, copy.name)


# --- decision bugs: the artifact decides differently from the model ----------------------------------

def k_off_by_one(proto: onnx.ModelProto) -> onnx.ModelProto:
    """BudgetedAttention: k = clamp(ceil(s*H), 1, H), the bug a naive clamp makes."""
    only(function(proto, "BudgetedAttention").node, "Floor").op_type = "Ceil"
    return proto


def shifted_keep_threshold(proto: onnx.ModelProto, output: str = "decisions.layer1.keep",
                           delta: float = 0.1) -> onnx.ModelProto:
    """A TSA router keeping a token where p <= threshold - delta."""
    node = producer(proto.graph.node, output)
    assert node.op_type == "LessOrEqual", node.op_type
    thr = const_value(proto, node.input[1])
    proto.graph.initializer.append(numpy_helper.from_array((thr - np.float32(delta)).astype(thr.dtype),
                                                           "planted.threshold"))
    node.input[1] = "planted.threshold"
    return proto


def inverted_head_modes(proto: onnx.ModelProto, layer: int = 0) -> onnx.ModelProto:
    """An elastic layer choosing SA where its FA logit is the larger: its decision output is
    ArgMax(logits) == 1 (the routed logits, or a decoder's given modes one-hot at decode steps), and
    the planted one compares with 0 instead."""
    node = producer(proto.graph.node, f"decisions.layer{layer}.sa")
    assert node.op_type == "Equal" and producer(proto.graph.node, node.input[0]).op_type == "ArgMax", node.op_type
    proto.graph.initializer.append(numpy_helper.from_array(np.array(0, dtype=np.int64), "planted.zero"))
    node.input[1] = "planted.zero"
    return proto


def _reads_head_modes(nodes, value: str, depth: int = 3) -> bool:
    """Whether `value` is made from a head_modes.* input within `depth` nodes (the given modes' one-hot logits)."""
    if value.startswith("head_modes.") or depth == 0:
        return value.startswith("head_modes.")
    made = [n for n in nodes if value in n.output]
    return bool(made) and any(_reads_head_modes(nodes, v, depth - 1) for v in made[0].input)


def decode_ignores_head_modes(proto: onnx.ModelProto) -> onnx.ModelProto:
    """An elastic decoder whose decode steps route afresh instead of taking head_modes.{i} (the
    prefill's modes): where the router sits in an If that skips it at decode steps (ONNX Runtime
    artifacts), that If always takes the routing branch; where both are computed and selected
    (TensorRT-bound graphs), the select always takes the routed logits."""
    never = "planted.never"
    proto.graph.initializer.append(numpy_helper.from_array(np.array(False), never))
    planted = 0
    for node in proto.graph.node:
        then = next((a.g for a in node.attribute if a.name == "then_branch"), None)
        if node.op_type == "If" and then is not None and any(
                v.startswith("head_modes.") for n in then.node for v in n.input):
            node.input[0] = never
            planted += 1
        elif node.op_type == "Where" and _reads_head_modes(proto.graph.node, node.input[1]):
            node.input[0] = never
            planted += 1
    assert planted, "no choice between the given and the routed modes"
    return proto


# --- probes -------------------------------------------------------------------------------------------

RANK = {"Gemm": 2, "Softmax": 4, "MatMul": 3}


def _lift(nodes, op_type: str, elem_type: int, rank: int, tag: str, port: int | None = None) -> list[str]:
    """The outputs of every `op_type` node of a body (with `port`, its input of that index), made
    values of the body's own scope: a node in an If branch has the value added to the branch's
    outputs, with an empty tensor of the same rank in the other branch (so after a run, an empty
    probe is a branch that did not run)."""
    names = []
    for n in list(nodes):
        if n.op_type == op_type:
            names.append(n.output[0] if port is None else n.input[port])
        if n.op_type != "If":
            continue
        branches = {a.name: a.g for a in n.attribute if a.type == onnx.AttributeProto.GRAPH}
        inner = {k: _lift(g.node, op_type, elem_type, rank, f"{tag}.{k}", port) for k, g in branches.items()}
        slots = [(k, v) for k in sorted(inner) for v in inner[k]]
        for j, (owner, value) in enumerate(slots):
            for k, g in branches.items():
                out = f"{tag}.{n.output[0]}.{k}.slot{j}"
                if k == owner:
                    g.node.append(helper.make_node("Identity", [value], [out]))
                else:
                    g.node.append(helper.make_node("Constant", [], [out], value=helper.make_tensor(
                        out + ".empty", elem_type, [0] * rank, [])))
                g.output.append(helper.make_tensor_value_info(out, elem_type, None))
            lifted = f"{tag}.{n.output[0]}.slot{j}"
            n.output.append(lifted)
            names.append(lifted)
    return names


def expose_branches(proto: onnx.ModelProto, op_type: str, elem_type: int = TensorProto.FLOAT,
                    rank: int | None = None) -> list[str]:
    """Make the outputs of every `op_type` node inside the main graph's If branches outputs of the
    graph; returns their names (a probe of a branch that did not run comes back empty)."""
    names = [v for v in _lift(proto.graph.node, op_type, elem_type, rank or RANK.get(op_type, 1), "main.lift")
             if v.startswith("main.lift.")]
    assert names, f"no If branch of the main graph has a {op_type}"
    proto.graph.output.extend(helper.make_tensor_value_info(v, elem_type, None) for v in names)
    return names


def expose(proto: onnx.ModelProto, fname: str, op_type: str, elem_type: int = TensorProto.FLOAT,
           rank: int | None = None, port: int | None = None) -> list[list[str]]:
    """Make the outputs of every `op_type` node of function `fname` (in its If branches too; with
    `port`, the nodes' input of that index) outputs of the function and of the graph; returns, per
    call of the function (in graph order), the names they are given. A probe of a branch that did
    not run comes back empty (size 0); `rank` is the rank of those values (default: the op type's
    usual one in the bodies, RANK). One proto can be exposed once per (op_type, port)."""
    f = function(proto, fname)
    tag = f"{fname}.{op_type}" + ("" if port is None else f".in{port}")
    inner = _lift(f.node, op_type, elem_type, rank or RANK.get(op_type, 1), f"{tag}.lift", port)
    assert inner, f"{fname} has no {op_type}"
    for j, v in enumerate(inner):
        f.node.append(helper.make_node("Identity", [v], [f"{tag}.probe{j}"]))
        f.output.append(f"{tag}.probe{j}")
    names = []
    for c, node in enumerate(calls(proto, fname)):
        # a call names outputs up to its last used one: pad with empty names to the function's arity
        node.output.extend([""] * (len(f.output) - len(inner) - len(node.output)))
        mine = [f"probe.{tag}.{c}.{j}" for j in range(len(inner))]
        node.output.extend(mine)
        proto.graph.output.extend(helper.make_tensor_value_info(m, elem_type, None) for m in mine)
        names.append(mine)
    return names


def ran(out: dict, probes: list[str]) -> list[np.ndarray]:
    """The probes of one call whose node ran (a branch not taken leaves its probes empty)."""
    return [out[p] for p in probes if out[p].size]


def profile(model, feeds: dict, workdir, outputs=None) -> tuple[list, list[dict]]:
    """Run `model` (serialized bytes or a ModelProto) once under ONNX Runtime's profiler: (the
    outputs, the args of every kernel it ran: op_name, output_type_shape, ...), so a test asks the
    runtime which kernels ran, and on what shapes."""
    import json

    import onnxruntime as ort

    so = ort.SessionOptions()
    so.enable_profiling, so.profile_file_prefix = True, str(Path(workdir) / "profile")
    data = model.SerializeToString() if isinstance(model, onnx.ModelProto) else model
    sess = ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])
    out = sess.run(outputs, feeds)
    events = json.loads(Path(sess.end_profiling()).read_text())
    return out, [e["args"] for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]


def run(proto: onnx.ModelProto, feeds: dict) -> dict[str, np.ndarray]:
    """Run a (modified) model in ONNX Runtime, CPU, with every graph optimisation on."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])
    takes = {i.name for i in sess.get_inputs()}
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, {k: v for k, v in feeds.items() if k in takes})))


def bf_batches(proto: onnx.ModelProto) -> list[dict]:
    """Batches of 20 tokens for the tiny BudgetFormer (tests/support/zoo.py) that take each of ONNX Runtime's
    three sparse bodies (budgeted_attention.onnx_body): one sample and small batches (every active
    head: little to waste), 48 samples whose k differ (by head), and up to 48 whose layer-0 k agree
    while their heads do not (per sample), picked by `proto`'s decisions."""
    rng = np.random.default_rng(7)

    def batch(ids: np.ndarray) -> dict:
        return {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    pool = rng.integers(1, 64, size=(128, 20))
    k0 = run(proto, batch(pool))["decisions.layer0.k"]
    same = np.flatnonzero(k0 == np.bincount(k0).argmax())[:48]
    return [batch(rng.integers(1, 64, size=(B, 20))) for B in (1, 1, 4, 6)] + [batch(pool[:48]), batch(pool[same])]


def poison_heads(proto: onnx.ModelProto, call: onnx.NodeProto, heads: np.ndarray, value=np.nan) -> None:
    """Set the Q, K and V rows and the output-projection columns of `heads` of one BudgetedAttention
    call to `value`, in copies of its weight initializers (another call may share a tensor)."""
    for pos, axis in ((4, 0), (6, 1)):  # w_qkv (3d, d): rows; w_o (d, d): columns
        w = numpy_helper.to_array(initializer(proto, call.input[pos])).copy()
        H = int(next(a.i for a in call.attribute if a.name == "num_heads"))
        d = w.shape[1] if axis == 0 else w.shape[0]
        dh = d // H
        for h in heads:
            for block in range(3 if axis == 0 else 1):
                sl = slice(block * d + h * dh, block * d + (h + 1) * dh)
                if axis == 0:
                    w[sl] = value
                else:
                    w[:, sl] = value
        name = f"planted.{call.name}.{pos}"
        proto.graph.initializer.append(numpy_helper.from_array(w, name))
        call.input[pos] = name


INPUTS = {"ConditionalAttention": {"hn": 1, "keep": 2, "gate": 3}, "ConditionalFFN": {"keep": 1, "gate": 2}}


def poison_skipped(proto: onnx.ModelProto, fname: str, inputs: tuple[str, ...]) -> None:
    """NaN in the named inputs (hn, gate) of every `fname` call, for the tokens its own keep input says
    are skipped: what a sparse lowering never reads and a dense one multiplies by zero (NaN * 0 is
    NaN)."""
    nan = "planted.nan"
    if not any(i.name == nan for i in proto.graph.initializer):
        proto.graph.initializer.append(numpy_helper.from_array(np.array(np.nan, np.float32), nan))
        proto.graph.initializer.append(numpy_helper.from_array(np.array([-1], np.int64), "planted.last_axis"))
    for c, node in enumerate(calls(proto, fname)):
        keep = node.input[INPUTS[fname]["keep"]]
        for what in inputs:
            pos = INPUTS[fname][what]
            out = f"planted.{fname}.{c}.{what}"
            cond = keep
            if what == "hn":  # (B, T, d): the (B, T) mask broadcast over the features
                cond = out + ".keep"
                proto.graph.node.append(helper.make_node("Unsqueeze", [keep, "planted.last_axis"], [cond]))
            proto.graph.node.append(helper.make_node("Where", [cond, node.input[pos], nan], [out]))
            node.input[pos] = out
    onnx_sort(proto)


def onnx_sort(proto: onnx.ModelProto) -> None:
    """Topologically sort the main graph after nodes were appended out of order."""
    nodes = list(proto.graph.node)
    known = {i.name for i in proto.graph.input} | {i.name for i in proto.graph.initializer} | {""}
    done, order = set(), []
    while len(order) < len(nodes):
        progress = False
        for i, n in enumerate(nodes):
            if i not in done and all(v in known for v in n.input):
                order.append(n)
                done.add(i)
                known.update(n.output)
                progress = True
        assert progress, "the planted graph has a cycle or a dangling input"
    del proto.graph.node[:]
    proto.graph.node.extend(order)
