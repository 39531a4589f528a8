"""Triton: repositories written from artifacts parse under Triton's own schema, and `adaptex serve`
answers concurrent clients exactly as the artifact does when run directly."""
from __future__ import annotations

import os
import socket
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import onnxruntime as ort
import pytest

from adaptex.cli import main
from adaptex.graphs.errors import AdaptexError
from adaptex.runtimes.open import read_metadata
from adaptex.runtimes.triton import repository

FAMILIES = ("bf", "tsa", "el", "eldec")


def _config(model_dir):
    return repository.parse_config((model_dir / "config.pbtxt").read_text())


@pytest.mark.parametrize("family", FAMILIES)
def test_repository_parses_under_tritons_schema_with_every_output(artifacts, tmp_path, family):
    art = artifacts(family)
    meta = read_metadata(art)
    assert main(["triton", str(art), "-o", str(tmp_path / "repo"), "--name", "m", "--instances", "2"]) == 0
    d = tmp_path / "repo" / "m"
    cfg = _config(d)
    assert cfg.name == "m" and cfg.backend == "onnxruntime" and cfg.instance_group[0].count == 2
    assert [i.name for i in cfg.input] == list(meta["inputs"])
    assert [o.name for o in cfg.output] == list(meta["outputs"])  # decisions (and a decoder's cache) included
    assert set(meta["decisions"]) <= {o.name for o in cfg.output}
    assert cfg.max_batch_size == 64 and cfg.HasField("dynamic_batching")  # every tensor leads with the batch
    for o in cfg.output:
        shape = meta["outputs"][o.name]["shape"][1:]
        want = [d if isinstance(d, int) else -1 for d in shape] or [1]
        assert list(o.dims) == want, o.name
        assert list(o.reshape.shape) == [] and o.HasField("reshape") == (not shape)
    assert (d / "1" / "model.onnx").read_bytes() == art.read_bytes()


def test_repository_never_replaces_a_model_directory_it_did_not_write(artifacts, tmp_path):
    mine = tmp_path / "repo" / "theirs"
    mine.mkdir(parents=True)
    (mine / "config.pbtxt").write_text("precious")
    with pytest.raises(AdaptexError, match="not written by adaptex"):
        repository.write(artifacts("bf"), tmp_path / "repo", name="theirs")
    assert (mine / "config.pbtxt").read_text() == "precious"
    repository.write(artifacts("bf"), tmp_path / "repo", name="ours")
    repository.write(artifacts("bf"), tmp_path / "repo", name="ours", max_batch=8)  # its own: replaced
    assert _config(tmp_path / "repo" / "ours").max_batch_size == 8
    assert sorted(p.name for p in (tmp_path / "repo").iterdir()) == ["ours", "theirs"]


@pytest.mark.parametrize("argv, says", [(["--max-batch", "0"], "--max-batch 0"), (["--instances", "0"], "--instances 0"),
                                        (["--name", "a/b"], "--name 'a/b'")])
def test_repository_refuses_bad_options_in_one_line(artifacts, tmp_path, capsys, argv, says):
    assert main(["triton", str(artifacts("bf")), "-o", str(tmp_path / "r"), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and "\n" not in err
    assert not (tmp_path / "r").exists() or not any((tmp_path / "r").iterdir())


@pytest.mark.slow
def test_repositories_of_every_shipped_model_parse(tmp_path):
    from adaptex.graphs.checkpoint import shipped_models

    for name in shipped_models():
        art = tmp_path / f"{name}.onnx"
        assert main(["export", name, "--target", "onnx", "-o", str(art)]) == 0
        d = repository.write(art, tmp_path / "repo")
        assert _config(d).name == name


def _free_port() -> int:
    """An HTTP port whose next two (gRPC, metrics) are free too, below Linux's ephemeral range (32768
    and up), where another process's outgoing connection could take one of them meanwhile."""
    import random

    rng = random.Random()
    for _ in range(100):
        port = rng.randrange(20000, 32000)
        try:
            for p in (port, port + 1, port + 2):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return port
        except OSError:
            continue
    raise AssertionError("no three consecutive free ports between 20000 and 32000")


@pytest.mark.triton
def test_serve_answers_concurrent_clients_as_the_artifact_does(artifacts):
    import tritonclient.http as th

    from adaptex.runtimes.triton.server import Server, http_inputs

    art = artifacts("bf")
    meta = read_metadata(art)
    direct = ort.InferenceSession(str(art), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    vocab = 20
    requests = []
    for i in range(32):  # mixed lengths and batches, padded rows among them
        batch, seq = int(rng.integers(1, 4)), int(rng.integers(2, 12))
        ids = rng.integers(1, vocab, (batch, seq)).astype(np.int64)
        mask = np.ones_like(ids)
        if batch > 1:
            mask[0, seq // 2:] = 0
        requests.append({"input_ids": ids, "attention_mask": mask})
    names = list(meta["outputs"])

    with Server(art, port=_free_port(), max_batch=8, instances=2) as server:
        def ask(feeds):
            client = th.InferenceServerClient(f"127.0.0.1:{server.port}")
            r = client.infer(server.name, http_inputs(feeds))
            return {n: r.as_numpy(n) for n in names}

        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(ask, requests))
    assert len(answers) == len(requests)
    for feeds, got in zip(requests, answers):
        want = dict(zip(names, direct.run(names, feeds)))
        for n in names:
            w = want[n].reshape(got[n].shape)  # a per-sample value comes back as [batch, 1]
            if n in meta["decisions"]:
                np.testing.assert_array_equal(got[n], w, err_msg=n)
            else:
                np.testing.assert_allclose(got[n], w, rtol=1e-4, atol=1e-5, err_msg=n)


@pytest.mark.triton
def test_a_server_that_cannot_start_says_why_and_keeps_its_log(artifacts, tmp_path):
    from adaptex.runtimes.triton.server import Server

    art = artifacts("bf")
    import onnx
    from onnx import TensorProto, helper

    broken = tmp_path / "broken.onnx"  # the metadata of a real artifact, a graph ONNX Runtime cannot load
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    graph = helper.make_graph([helper.make_node("NoSuchOp", ["x"], ["y"], domain="nowhere")], "g", [x],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), broken)
    with pytest.raises(AdaptexError) as e:
        Server(broken, port=_free_port(), meta=read_metadata(art)).start()
    said = str(e.value)
    assert "\n" not in said and "the Triton server exited" in said
    log = said.split("see its log ")[1].split(",")[0]
    try:
        assert "Traceback" in open(log).read()
    finally:
        os.remove(log)
