"""The serving worker (runtimes/triton/worker.py) restarts Triton when PyTriton's instance handshake is
refused, and only then. PyTriton stands in as a recording fake: the worker's retry is its own logic."""
from __future__ import annotations

import json
import sys
import types

import pytest

from adaptex.runtimes.triton import worker

REFUSED = ("[400] load failed for model 'm': TritonModelException: Model initialize error: Traceback:\n"
           "  inference_handler_config = get_config_from_handshake_server(handshake_socket)\n"
           "ConnectionRefusedError: [Errno 111] Connection refused")


def _fake_pytriton(monkeypatch, failures: list[str]):
    """Modules pytriton.{triton,model_config,decorators} whose bind raises each of `failures` in turn."""
    events = []

    class Triton:
        def __init__(self, config):
            events.append("start")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            events.append("stop")

        def bind(self, **kw):
            if failures:
                raise RuntimeError(failures.pop(0))
            events.append("bound")

        def serve(self):
            events.append("served")

    def record(*a, **kw):
        return kw

    mods = {"pytriton": types.ModuleType("pytriton"), "pytriton.triton": types.ModuleType("pytriton.triton"),
            "pytriton.model_config": types.ModuleType("pytriton.model_config"),
            "pytriton.decorators": types.ModuleType("pytriton.decorators")}
    mods["pytriton.triton"].Triton, mods["pytriton.triton"].TritonConfig = Triton, record
    for name in ("DynamicBatcher", "ModelConfig", "Tensor"):
        setattr(mods["pytriton.model_config"], name, record)
    mods["pytriton.decorators"].batch = lambda f: f
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(worker, "_session", lambda path, threads: object())
    return events


def _model_dir(tmp_path):
    spec = {"shape": ["batch", "seq"], "dtype": "int64"}
    (tmp_path / "adaptex.json").write_text(json.dumps({"inputs": {"input_ids": spec}, "outputs": {"logits": {
        "shape": ["batch", 2], "dtype": "float32"}}}))
    return ["--name", "m", "--http-port", "1", "--grpc-port", "2", "--metrics-port", "3"]


def test_a_refused_handshake_restarts_triton_and_then_serves(monkeypatch, tmp_path, capsys):
    events = _fake_pytriton(monkeypatch, [REFUSED])
    assert worker.main([str(tmp_path), *_model_dir(tmp_path)]) == 0
    assert events == ["start", "stop", "start", "bound", "served", "stop"]
    assert "handshake refused (attempt 1 of 3)" in capsys.readouterr().out


def test_a_handshake_refused_every_time_gives_up_after_the_last_attempt(monkeypatch, tmp_path):
    events = _fake_pytriton(monkeypatch, [REFUSED] * worker.LOAD_ATTEMPTS)
    with pytest.raises(RuntimeError, match="handshake"):
        worker.main([str(tmp_path), *_model_dir(tmp_path)])
    assert events.count("start") == worker.LOAD_ATTEMPTS and "served" not in events


def test_any_other_load_failure_is_not_retried(monkeypatch, tmp_path):
    events = _fake_pytriton(monkeypatch, ["[400] load failed for model 'm': out of memory"])
    with pytest.raises(RuntimeError, match="out of memory"):
        worker.main([str(tmp_path), *_model_dir(tmp_path)])
    assert events == ["start", "stop"]
