"""torch.export keeps each adaptive op as one node, with dynamic batch and sequence axes."""
import torch

from adaptex.exporter.trace import adaptex_nodes, trace
from adaptex.graphs.family import family_contract
from tests.support import zoo


def test_each_budgeted_attention_is_one_node():
    model = zoo.tiny_model()
    ep = trace(model)
    nodes = adaptex_nodes(ep)
    assert len(nodes) == model.cfg.num_layers
    assert all(n.target.name() == "adaptex::budgeted_attention" for n in nodes)
    # the op's internals (selection, gathers, attention) must not leak into the graph
    leaked = [n for n in ep.graph.nodes if n.op == "call_function"
              and any(t in str(n.target) for t in ("topk", "sort", "scaled_dot_product", "index_select"))]
    assert leaked == []


def test_trace_is_dynamic_in_batch_and_sequence():
    model = zoo.tiny_model()
    ep = trace(model)
    shape = ep.graph_signature.user_inputs[0]
    ph = next(n for n in ep.graph.nodes if n.op == "placeholder" and n.name == shape)
    dims = ph.meta["val"].shape
    assert all(isinstance(d, torch.SymInt) for d in dims)
    mod = ep.module()
    for B, T in [(1, 3), (5, 40)]:
        ids = torch.randint(1, 64, (B, T))
        mask = torch.ones(B, T, dtype=torch.int64)
        outs = mod(ids, mask)
        ref, dec = model(ids, mask)
        torch.testing.assert_close(outs[0], ref)
        assert torch.equal(outs[1], dec[0]["k"])
    assert len(outs) == len(family_contract(model).output_names())
