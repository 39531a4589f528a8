"""What an elastic encoder's short calls would cost on ONNX Runtime's fused attention kernel, the
design measured and not built (docs/benchmarking.md#short-calls). The yardstick of an encoder from a
pretrained checkpoint (`original-legacy+ortopt+rows`) runs each layer's Q, K and V projections and
its attention in one kernel, com.microsoft.Attention, which takes a per-head additive bias
(`attention_bias`, (B, H, T, S)). So the streaming heads could run in it too: a head's bias hides
the keys outside its sinks and window. Timed in interleaved rounds against that yardstick (1.000),
1 thread, with the bench's inputs:

- `+bias`: the yardstick with every layer's Attention given such a bias (half the heads streaming,
  made once per call from the mask), no router: what the kernel itself pays for the bias;
- `+routers`: the same, each layer first running a router of the artifact's HeadRouter's size
  (random weights: timing only) on the layer's input pooled over the tokens (the pooled keys are
  the pooled input through the key projection, so the kernel need not hand its keys out), its
  ArgMax picking each head's bias plane (one Gather); the planes, the pooling weights and the
  samples' plane offsets made once per call from the mask, in the graph;
- `artifact`: the program adaptex's runner runs for that call (the artifact's general graph).

    python lab/attention_bias_cost.py em.onnx --points 1x32,1x128,8x32
    python lab/attention_bias_cost.py em.onnx --points 1x512 --rounds 60

A point is BATCHxTOKENS. The artifact is an elastic encoder's ONNX export (adaptex export
elastic-minilm --target onnx -o em.onnx); the yardstick is read from bench's cache, or exported
there first (a minute or two).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
from if_branch_cost import interleaved_medians, parse_shapes, timings  # beside this script
from onnx import TensorProto, helper, numpy_helper

from adaptex.graphs.ops.elastic_attention import NEG  # a hidden key's bias, as the op's bodies write it
YARDSTICK = "original-legacy+ortopt+rows"


def elastic_attrs(model: onnx.ModelProto) -> dict:
    """The attributes (sink, window, causal) of the artifact's first ElasticAttention call, in the main
    graph or a branch."""
    def walk(nodes):
        for n in nodes:
            if n.op_type == "ElasticAttention":
                return {a.name: helper.get_attribute_value(a) for a in n.attribute}
            for a in n.attribute:
                if a.type == onnx.AttributeProto.GRAPH and (found := walk(a.g.node)):
                    return found
        return None
    return walk(model.graph.node) or {}


def num_heads(model: onnx.ModelProto) -> int:
    node = next(n for n in model.graph.node if n.op_type == "Attention" and n.domain == "com.microsoft")
    return next(helper.get_attribute_value(a) for a in node.attribute if a.name == "num_heads")


def with_bias(src: onnx.ModelProto, sink: int, window: int, streaming: np.ndarray | None = None,
              routers: int | None = None, seed: int = 0) -> onnx.ModelProto:
    """`src` (a graph with com.microsoft.Attention nodes and an attention_mask input) with a per-head
    bias on every Attention: the heads `streaming` marks (H,) streaming in every layer, or the heads a
    router of `routers` hidden units picks, layer by layer."""
    m = onnx.ModelProto()
    m.CopyFrom(src)
    g = m.graph
    rng = np.random.default_rng(seed)
    nodes: list[onnx.NodeProto] = []

    def const(name: str, value) -> str:
        g.initializer.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def ints(name: str, *values: int) -> str:
        return const(name, np.array(values, np.int64))

    def node(op: str, inputs: list[str], out: str, **attrs) -> str:
        domain = "com.microsoft" if op == "BiasGelu" else ""
        nodes.append(helper.make_node(op, inputs, [out], domain=domain, **attrs))
        return out

    att = {i for i, n in enumerate(g.node) if n.op_type == "Attention" and n.domain == "com.microsoft"}
    H = num_heads(src)
    weights = {t.name: t for t in g.initializer}
    d = int(weights[g.node[min(att)].input[1]].dims[0])
    dh = d // H
    # once a call, from the mask: the padding bias, the (T, S) bias of the keys a streaming query
    # does not see, and the planes (2 B, T, S): sample b's FA plane at 2 b, its SA plane at 2 b + 1
    mask = node("Cast", ["attention_mask"], "ab_mask", to=TensorProto.FLOAT)  # (B, S)
    pad = node("Mul", [node("Sub", [mask, const("ab_one", np.float32(1))], "ab_m1"), const("ab_big", np.float32(-NEG))],
               "ab_pad2")
    pad = node("Unsqueeze", [pad, ints("ab_ax1", 1)], "ab_pad")  # (B, 1, S)
    B, S = (node("Shape", ["attention_mask"], f"ab_{a}", start=i, end=i + 1) for i, a in enumerate("BS"))
    pos = node("Range", [const("ab_zero", np.int64(0)), node("Squeeze", [S, ints("ab_ax0", 0)], "ab_Ss"),
                         const("ab_step", np.int64(1))], "ab_pos")
    i, j = node("Unsqueeze", [pos, "ab_ax1"], "ab_i"), node("Unsqueeze", [pos, "ab_ax0"], "ab_j")
    dist = node("Abs", [node("Sub", [i, j], "ab_d")], "ab_dist")
    near = node("LessOrEqual", [dist, const("ab_half", np.int64(window // 2))], "ab_near")
    seen = node("Or", [near, node("Less", [j, const("ab_sink", np.int64(sink))], "ab_sinks")], "ab_seen")
    hide = node("Where", [seen, const("ab_0f", np.float32(0)), const("ab_negf", np.float32(NEG))], "ab_hide")
    fa = node("Expand", [pad, node("Concat", [B, S, S], "ab_BSS", axis=0)], "ab_fa")  # (B, T, S)
    sa = node("Add", [fa, hide], "ab_sa")
    both = node("Concat", [node("Unsqueeze", [fa, "ab_ax1"], "ab_fa4"), node("Unsqueeze", [sa, "ab_ax1"], "ab_sa4")],
                "ab_both", axis=1)  # (B, 2, T, S)
    planes = node("Reshape", [both, node("Concat", [ints("ab_m1i", -1), S, S], "ab_pshape", axis=0)], "ab_planes")
    first = node("Range", [const("ab_z2", np.int64(0)), node("Squeeze", [B, "ab_ax0"], "ab_Bs"), "ab_step"], "ab_b")
    first = node("Unsqueeze", [node("Mul", [first, const("ab_two", np.int64(2))], "ab_2b"), "ab_ax1"], "ab_first")
    if routers is None:  # the given heads streaming in every layer
        pick = node("Add", [first, const("ab_modes", streaming.astype(np.int64)[None])], "ab_pick")  # (B, H)
        bias = node("Gather", [planes, pick], "ab_bias", axis=0)  # (B, H, T, S)
    else:  # a router's (B, 2, S) pooling weights, both rows the mean over the real tokens (the same cost)
        mean = node("Div", [mask, node("ReduceSum", [mask, "ab_ax1"], "ab_n", keepdims=1)], "ab_w")
        plan = node("Unsqueeze", [mean, "ab_ax1"], "ab_plan1")  # (B, 1, S)
        plan = node("Concat", [plan, plan], "ab_plan", axis=1)

    def router(li: int, n: onnx.NodeProto) -> str:
        """Layer li's bias: its input pooled, projected to keys, a HeadRouter's MLPs, the planes picked."""
        p = f"ab{li}_"
        wqkv = numpy_helper.to_array(weights[n.input[1]])
        wk, bk = wqkv[:, d:2 * d], numpy_helper.to_array(weights[n.input[2]])[d:2 * d]
        x = node("Reshape", [n.input[0], node("Concat", [B, ints(p + "m1", -1), ints(p + "d", d)], p + "x3s", axis=0)],
                 p + "x3")  # (B, T, d)
        keys = node("MatMul", [node("MatMul", [plan, x], p + "px"), const(p + "wk", wk)], p + "pk0")
        keys = node("Add", [keys, const(p + "bk", bk)], p + "pk")  # (B, 2, d): the pooled keys
        heads = node("Transpose", [node("Reshape", [keys, ints(p + "s1", 0, 2, H, dh)], p + "r1")], p + "t1",
                     perm=[0, 2, 1, 3])
        h = node("Reshape", [heads, ints(p + "s2", 0, H, 2 * dh)], p + "pool")  # (B, H, 2 dh)
        for k, (fan_in, fan_out) in enumerate(((2 * dh, routers), (routers, routers))):
            w = const(f"{p}w{k}", rng.standard_normal((fan_in, fan_out), np.float32) * .1)
            h = node("BiasGelu", [node("MatMul", [h, w], f"{p}h{k}"), const(f"{p}b{k}", np.zeros(fan_out, np.float32))],
                     f"{p}g{k}")
            if k == 0:  # the per-head bias of the task MLP
                h = node("Add", [h, const(p + "hb", np.zeros((H, routers), np.float32))], p + "g0b")
        logits = node("MatMul", [h, const(p + "w2", rng.standard_normal((routers, 2), np.float32))], p + "h2")
        logits = node("Add", [logits, const(p + "b2", np.zeros(2, np.float32))], p + "logits")
        modes = node("ArgMax", [logits], p + "sa", axis=-1, keepdims=0)  # (B, H): 1 streaming
        return node("Gather", [planes, node("Add", [first, modes], p + "pick")], p + "bias", axis=0)

    out = list(nodes)
    for li, n in enumerate(g.node):
        if li in att:
            if routers is not None:
                nodes.clear()
                bias = router(li, n)
                out += nodes
            while len(n.input) < 5:
                n.input.append("")
            n.input.append(bias)  # attention_bias (B, H, T, S)
        out.append(n)
    del g.node[:]
    g.node.extend(out)
    return m


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact")
    ap.add_argument("--points", default="1x32,1x128,8x32")
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--router-hidden", type=int, default=64)
    args = ap.parse_args()
    points = parse_shapes(args.points, 2)
    if points is None or args.rounds < 1 or args.router_hidden < 1:
        print(f"attention_bias_cost: --points {args.points!r}: write BATCHxTOKENS, e.g. 1x32,8x32 (and --rounds, "
              "--router-hidden >= 1)", file=sys.stderr)
        return 2
    if not Path(args.artifact).is_file():
        print(f"attention_bias_cost: {args.artifact}: no such file; export one first (adaptex export elastic-minilm "
              "--target onnx -o em.onnx)", file=sys.stderr)
        return 2
    import onnxruntime as ort

    from adaptex.exporter.counterparts import cached_onnx_candidates
    from adaptex.runtimes.bench import Bench
    from adaptex.runtimes.onnxruntime import OnnxRuntimeRunner, session_options
    from adaptex.runtimes.open import read_metadata
    from adaptex.runtimes.source import load_source_model

    art = onnx.load(args.artifact)
    attrs = elastic_attrs(art)
    if "sink" not in attrs or attrs.get("causal"):
        print(f"attention_bias_cost: {args.artifact} is not an elastic encoder's artifact (no non-causal "
              "ElasticAttention); pass one (adaptex export elastic-minilm --target onnx -o em.onnx)", file=sys.stderr)
        return 2
    model, info = load_source_model(read_metadata(args.artifact), None)
    runner = OnnxRuntimeRunner(args.artifact, threads=1)
    runner.activate()
    tmp = Path(tempfile.mkdtemp())
    with Bench(args.artifact, model, info, progress=lambda m: print(m, file=sys.stderr)) as bench:
        cands = {c.name: c for c in cached_onnx_candidates(bench.model, bench.contract, tmp, bench.say,
                                                           floor=bench.floor_probe()["pays"])}
        if YARDSTICK not in cands or cands[YARDSTICK].path is None:
            print(f"attention_bias_cost: this model has no {YARDSTICK} graph (the original checkpoint's fused "
                  "export); pass an encoder from a pretrained checkpoint", file=sys.stderr)
            return 2
        yard = onnx.load(cands[YARDSTICK].path)
        if not any(n.op_type == "Attention" and n.domain == "com.microsoft" for n in yard.graph.node):
            print(f"attention_bias_cost: {YARDSTICK} holds no com.microsoft.Attention (ONNX Runtime's optimizer "
                  "fused none); nothing to measure", file=sys.stderr)
            return 2
        H = num_heads(yard)
        half = np.arange(H) % 2 == 0
        paths = {"yardstick": cands[YARDSTICK].path}
        for name, kw in (("+bias", dict(streaming=half)), ("+routers", dict(routers=args.router_hidden)),
                         ("no streaming head", dict(streaming=np.zeros(H, bool)))):
            paths[name] = str(tmp / f"{len(paths)}.onnx")
            onnx.save(with_bias(yard, attrs["sink"], attrs["window"], **kw), paths[name])
        check = paths.pop("no streaming head")  # not timed: its output must be the yardstick's
        rng = np.random.default_rng(0)
        for batch, tokens in points:
            feeds = bench.inputs(lambda f: dict(zip(runner.output_names(), runner.run_raw(f))), batch=batch, seq=tokens)
            program = runner.programs.model(feeds).SerializeToString() if runner.programs else args.artifact
            want, zero, half_sa = (ort.InferenceSession(p, session_options(1)).run(None, feeds)[0]
                                   for p in (paths["yardstick"], check, paths["+bias"]))
            med = interleaved_medians(dict(paths, artifact=program), session_options(1), feeds, args.rounds, rng)
            base = med["yardstick"]
            print(f"B{batch}, T = {tokens}, {args.rounds} rounds: {timings(med)}; against the yardstick: "
                  + ", ".join(f"{k} {v / base:.3f}" for k, v in med.items() if k != "yardstick")
                  + f". Outputs against the yardstick's: a zero bias {float(np.abs(zero - want).max()):.1e}, "
                  f"half the heads streaming {float(np.abs(half_sa - want).max()):.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
