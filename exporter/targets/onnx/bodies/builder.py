"""The builder every op body is written with: a node accumulator with If and Loop, and the domain's
constants."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from adaptex.graphs.ops.policy import DEFAULT, OrtPolicy


DOMAIN = "adaptex"
MS_DOMAIN = "com.microsoft"  # ONNX Runtime's contrib ops: ONNX Runtime bodies only (never TensorRT-bound)
OPSET_VERSION = 1  # version of the adaptex op set
ONNX_OPSET = 20


def _private(f: onnx.FunctionProto) -> onnx.FunctionProto:
    """Prefix the body's formal inputs and outputs with its name ("BudgetedAttention.x"): before 10.8
    TensorRT's parser bound a function input whose name matched an outer tensor to that tensor, and a
    model's own input may well be called x. Internal values already carry a per-body prefix."""
    rename = {n: f"{f.name}.{n}" for n in list(f.input) + list(f.output)}
    for seq in (f.input, f.output):
        seq[:] = [rename[n] for n in seq]

    def walk(nodes) -> None:  # If branches read the formal inputs too
        for node in nodes:
            node.input[:] = [rename.get(n, n) for n in node.input]
            node.output[:] = [rename.get(n, n) for n in node.output]
            for a in node.attribute:
                for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                    walk(g.node)
    walk(f.node)
    return f


class _Body:
    """Accumulates the nodes of one function body; each call adds a node and returns its output(s).
    policy: the thresholds by which the body chooses its paths (graphs/ops/policy.py)."""

    def __init__(self, prefix: str, policy: OrtPolicy = DEFAULT):
        self.prefix, self.nodes, self.n, self.policy = prefix, [], 0, policy

    def __call__(self, op_type: str, *inputs: str, outputs: int = 1, **attrs):
        self.n += 1
        names = [f"{self.prefix}{op_type}_{self.n}" + (f"_{i}" if outputs > 1 else "") for i in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), names, **attrs))
        return names[0] if outputs == 1 else names

    def const(self, value, dtype=np.int64) -> str:
        arr = np.array(value, dtype=dtype)
        return self("Constant", value=numpy_helper.from_array(arr))

    def if_(self, cond: str, then_fn, else_fn, elem_type: int = TensorProto.FLOAT) -> str:
        """An If node on the scalar bool `cond`: each branch's nodes are what its function adds (it
        returns the branch's result, which may be an outer value). Branches read outer values by
        name, so only the taken one runs: this is how a lowering skips work at run time."""
        branches = []
        for tag, fn in (("then", then_fn), ("else", else_fn)):
            saved, self.nodes = self.nodes, []
            result = fn()
            if not any(result in n.output for n in self.nodes):  # an outer value: a branch output must be
                result = self("Identity", result)  # produced inside the branch (an Identity copies, so only then)
            branches.append(helper.make_graph(self.nodes, f"{self.prefix}{tag}_{self.n}", [],
                                              [helper.make_tensor_value_info(result, elem_type, None)]))
            self.nodes = saved
        return self("If", cond, then_branch=branches[0], else_branch=branches[1])

    def loop_(self, trips: str, body_fn, elem_type: int = TensorProto.FLOAT) -> str:
        """A Loop node run `trips` (int64 scalar) times, with no carried value: body_fn(i) adds the
        nodes of one iteration (i: the iteration's int64 scalar) and returns the value it contributes,
        all of one shape; the Loop stacks them along a new first axis."""
        self.n += 1
        i, c = f"{self.prefix}iter_{self.n}", f"{self.prefix}cond_{self.n}"
        saved, self.nodes = self.nodes, []
        result = body_fn(i)
        c_out = self("Identity", c)
        body = helper.make_graph(self.nodes, f"{self.prefix}loop_{self.n}",
                                 [helper.make_tensor_value_info(i, TensorProto.INT64, []),
                                  helper.make_tensor_value_info(c, TensorProto.BOOL, [])],
                                 [helper.make_tensor_value_info(c_out, TensorProto.BOOL, []),
                                  helper.make_tensor_value_info(result, elem_type, None)])
        self.nodes = saved
        # an explicit true condition, not an empty input: rewriting tools drop a trailing empty input,
        # and a Loop needs two
        return self("Loop", trips, self.const(True, np.bool_), body=body)

    def attr_int(self, attr: str) -> str:
        """A scalar int64 tensor holding the function's attribute `attr` (resolved at the call site)."""
        self.n += 1
        name = f"{self.prefix}{attr}_{self.n}"
        node = helper.make_node("Constant", [], [name])
        a = onnx.AttributeProto(name="value_int", ref_attr_name=attr, type=onnx.AttributeProto.INT)
        node.attribute.append(a)
        self.nodes.append(node)
        return name


def _name_output(b: _Body, value: str, name: str) -> None:
    """Make the body's last node, which computes `value`, write the function output `name`."""
    last = b.nodes[-1]
    assert value in last.output, (value, last.output)
    last.output[list(last.output).index(value)] = name
