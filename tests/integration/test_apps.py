"""The apps: the web page (headless Chromium, onnxruntime-web) and the Node script (onnxruntime-node)
run the three shipped artifacts, and what they compute equals Python ONNX Runtime's on the same inputs:
generated text token for token, values within 1e-4, decisions exactly. Their tokenizers, written in
JavaScript from each artifact's metadata, equal the Python ones.

ADAPTEX_SCREENSHOTS=DIR also copies the page's screenshots to DIR (docs/images/apps-*.png come from there).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from adaptex.exporter.metadata import read_onnx_metadata
from adaptex.runtimes.onnxruntime import OnnxRuntimeRunner

ROOT = Path(__file__).resolve().parents[2]
WEB, NODE = ROOT / "examples" / "web", ROOT / "examples" / "node"
MODELS = {"generate": "tsa-charlm", "classify": "budgetformer-graded", "embed": "elastic-minilm"}
ATOL = 1e-4  # fp32 artifacts (docs: parity tolerances); wasm differs from native CPU kernels by ~2e-5

# inputs the page and the Node script run besides their defaults: unknown characters, a word that is a
# property of every JavaScript object, accents, punctuation, CJK and a special token
MORE = {
    "generate": {"prompt": "x = 'é'\n    for k in ", "new": 12},
    "classify": ["constructor toString A 3 __proto__ B 1", "A 1 and then A 2 again 0"],
    "embed": [("Café déjà vu: naïve résumés, 3.14!", "[MASK] is the new 北京 ΣΑΣ, isn't it?")],
}


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    """The three shipped models exported to ONNX: {task: path}."""
    import adaptex

    d = tmp_path_factory.mktemp("models")
    out = {}
    for task, name in MODELS.items():
        out[task] = d / f"{name}.onnx"
        adaptex.export(adaptex.load(name), None, out[task])
    return out


@pytest.fixture(scope="module")
def runners(artifacts):
    return {task: OnnxRuntimeRunner(path, threads=1) for task, path in artifacts.items()}


# --- Python references ---------------------------------------------------------------------------------

def py_tokenize(meta: dict, text: str) -> list[int]:
    """The Python tokenizers: the char table, graphs.tokenizers' words, and Hugging Face tokenizers
    on MiniLM's own tokenizer.json (an implementation independent of the JavaScript one)."""
    spec = meta["tokenizer"]
    if spec["kind"] == "chars":
        stoi = {c: i for i, c in enumerate(spec["itos"]) if i >= 2}
        return [stoi.get(c, spec["unk"]) for c in text]
    if spec["kind"] == "words":
        from adaptex.graphs.tokenizers import encode_words

        return encode_words(spec, text)
    from adaptex.graphs.minilm import MiniLMTokenizer, default_model_dir

    ids, _ = MiniLMTokenizer(default_model_dir() / "tokenizer.json").encode([text])
    return ids[0].tolist()


def py_generate(runner, prompt: list[int], new: int):
    """Greedy decoding through the cache, feeding the last new token too (so it has decisions)."""
    cfg = runner.meta["config"]
    L, H, dh = cfg["num_layers"], cfg["num_heads"], cfg["d_model"] // cfg["num_heads"]
    keeps = [f"decisions.layer{b}.keep" for b in range(1, L)]
    past = {f"past_key_values.{i}.{kv}": np.zeros((1, H, 0, dh), np.float32) for i in range(L) for kv in ("key", "value")}

    def step(ids, n_past):
        return runner.infer({"input_ids": np.array([ids], np.int64),
                             "attention_mask": np.ones((1, n_past + len(ids)), np.int64), **past})

    out = step(prompt, 0)
    kept = [[int(out[k][0, t]) for k in keeps] for t in range(len(prompt))]
    ids, logits = [], []
    for n in range(len(prompt), len(prompt) + new):
        logits.append(out["logits"][0, -1])
        ids.append(int(logits[-1].argmax()))
        past = {f"past_key_values.{i}.{kv}": out[f"present.{i}.{kv}"] for i in range(L) for kv in ("key", "value")}
        out = step([ids[-1]], n)
        kept.append([int(out[k][0, 0]) for k in keeps])
    return ids, np.stack(logits), kept


def check_generate(js: dict, runner, prompt_text: str, new: int) -> None:
    prompt = py_tokenize(runner.meta, prompt_text)
    assert js["promptIds"] == prompt, "the JavaScript char tokenizer differs from the artifact's table"
    ids, logits, kept = py_generate(runner, prompt, new)
    assert js["ids"] == ids, f"generated {js['text']!r}, Python ONNX Runtime generated other tokens"
    err = np.abs(np.array([s["logits"] for s in js["steps"]]) - logits).max()
    assert err <= ATOL, f"next-token logits differ by {err:.2e} (tolerance {ATOL})"
    L = runner.meta["config"]["num_layers"]
    assert [t["id"] for t in js["tokens"]] == prompt + ids
    assert [t["keep"] for t in js["tokens"]] == kept, "keep decisions differ from Python ONNX Runtime's"
    assert [t["blocks"] for t in js["tokens"]] == [L - k.count(0) for k in kept]
    assert js["keepRate"] == pytest.approx(np.mean(kept)), "the keep rate is not the mean of the decisions"


def check_classify(js: dict, runner, text: str) -> None:
    ids = py_tokenize(runner.meta, text)
    assert js["ids"] == ids
    out = runner.infer({"input_ids": np.array([ids], np.int64), "attention_mask": np.ones((1, len(ids)), np.int64)})
    err = np.abs(np.array(js["logits"]) - out["logits"][0]).max()
    assert err <= ATOL, f"{text!r}: logits differ by {err:.2e} (tolerance {ATOL})"
    assert js["label"] == int(out["logits"][0].argmax())
    H = runner.meta["config"]["num_heads"]
    assert [(l["k"], l["of"], l["heads"]) for l in js["layers"]] == [
        (int(out[f"decisions.layer{i}.k"][0]), H, out[f"decisions.layer{i}.head_mask"][0].astype(int).tolist())
        for i in range(runner.meta["config"]["num_layers"])], f"{text!r}: head decisions differ"


def check_embed(js: dict, runner, a: str, b: str) -> None:
    embs = []
    for s, text in zip(js["sentences"], (a, b)):
        ids = py_tokenize(runner.meta, text)
        assert s["ids"] == ids, f"{text!r}: the JavaScript WordPiece ids differ from tokenizers'"
        out = runner.infer({"input_ids": np.array([ids], np.int64), "attention_mask": np.ones((1, len(ids)), np.int64)})
        embs.append(out["sentence_embedding"][0])
        err = np.abs(np.array(s["embedding"]) - embs[-1]).max()
        assert err <= ATOL, f"{text!r}: embedding differs by {err:.2e} (tolerance {ATOL})"
        assert [l["sa"] for l in s["layers"]] == [out[f"decisions.layer{i}.sa"][0].astype(int).tolist()
                                                  for i in range(runner.meta["config"]["num_layers"])]
    cos = float(embs[0] @ embs[1] / np.linalg.norm(embs[0]) / np.linalg.norm(embs[1]))
    assert abs(js["cosine"] - cos) <= ATOL, f"cosine {js['cosine']} vs Python {cos}"


# --- what the artifacts carry for apps -------------------------------------------------------------------

def test_artifacts_carry_what_apps_need(artifacts):
    metas = {task: read_onnx_metadata(p) for task, p in artifacts.items()}
    assert {t: m["tokenizer"]["kind"] for t, m in metas.items()} == {"generate": "chars", "classify": "words",
                                                                    "embed": "wordpiece"}
    assert metas["generate"]["kv_cache_bound"] == metas["generate"]["config"]["max_len"]
    for task, meta in metas.items():
        assert meta["decisions"], task
        for side in ("inputs", "outputs"):
            empty = [n for n, spec in meta[side].items() if not spec.get("description")]
            assert not empty, f"{task}: {side} without a description: {empty}"
        assert set(meta["decisions"]) <= set(meta["outputs"])
    assert len(metas["embed"]["tokenizer"]["vocab"]) == metas["embed"]["config"]["vocab_size"]


@pytest.fixture(scope="module")
def plain_tsa(tmp_path_factory):
    """A Python runner on tsa-charlm exported with --dense-rows off: the sparse graph alone. The
    shipped export (the apps' artifact) records --dense-rows 64: one graph holding the sparse and the
    dense lowering behind an If."""
    import adaptex

    path = tmp_path_factory.mktemp("plain") / "tsa-charlm.onnx"
    adaptex.export(adaptex.load(MODELS["generate"]), None, path, dense_rows="off")
    assert "dispatch" not in read_onnx_metadata(path)
    return OnnxRuntimeRunner(path, threads=1)


# --- the web page ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def page(artifacts, tmp_path_factory):
    """The page served from a copy of examples/web whose models/ holds the fresh exports, open in Chromium."""
    from tests.support.cdp import Browser, serve

    site = tmp_path_factory.mktemp("site")
    for entry in WEB.iterdir():
        if entry.name != "models":
            (site / entry.name).symlink_to(entry)
    (site / "models").mkdir()
    for path in artifacts.values():
        (site / "models" / path.name).symlink_to(path)
    with serve(site) as url, Browser(tmp_path_factory.mktemp("chromium")) as browser:
        browser.goto(url + "index.html")
        yield browser


def _save_screenshots(page, tmp_path) -> dict:
    shots = {task: page.screenshot(f"#{task}", tmp_path / f"apps-{task}.png") for task in MODELS}
    for task, path in shots.items():
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, f"{path}: not a real screenshot"
    if os.environ.get("ADAPTEX_SCREENSHOTS"):
        dest = Path(os.environ["ADAPTEX_SCREENSHOTS"])
        dest.mkdir(parents=True, exist_ok=True)
        for path in shots.values():
            shutil.copyfile(path, dest / path.name)
    return shots


@pytest.mark.browser
def test_page_runs_the_three_tasks_on_load(page, runners, tmp_path):
    state = page.evaluate("adaptexApp.ready")
    assert state["errors"] == {} and sorted(state["results"]) == sorted(MODELS), (state["errors"], page.console)
    results, inputs = state["results"], state["inputs"]
    check_generate(results["generate"], runners["generate"], inputs["generate"]["prompt"], int(inputs["generate"]["new"]))
    check_classify(results["classify"], runners["classify"], inputs["classify"]["text"])
    check_embed(results["embed"], runners["embed"], inputs["embed"]["a"], inputs["embed"]["b"])
    # the page shows what it computed (last): every character coloured, the keep rate, k of H, the head map
    results = page.evaluate("adaptexApp.results")
    spans = page.evaluate("[...document.querySelectorAll('#generate pre.text span')].map(s => s.style.background)")
    assert len(spans) == len(results["generate"]["tokens"]) and all(spans)
    assert len(set(spans)) == len({t["blocks"] for t in results["generate"]["tokens"]}), "colour is not by blocks run"
    summary = page.evaluate("document.querySelector('#generate .summary').textContent")
    assert f"{100 * results['generate']['keepRate']:.1f}%" in summary
    heads = page.evaluate("document.querySelector('#classify .heads').textContent")
    assert all(f"{l['k']} of {l['of']} heads" in heads for l in results["classify"]["layers"])
    cells = page.evaluate("document.querySelectorAll('#embed .cell.sa, #embed .cell.fa').length")
    assert cells == 2 + sum(len(l["sa"]) for s in results["embed"]["sentences"] for l in s["layers"])
    _save_screenshots(page, tmp_path)


@pytest.mark.browser
def test_page_forms_on_other_inputs(page, runners):
    page.evaluate("adaptexApp.ready")
    g = MORE["generate"]
    check_generate(page.evaluate(f"adaptexApp.run('generate', {json.dumps(g)})"), runners["generate"], g["prompt"], g["new"])
    for text in MORE["classify"]:
        check_classify(page.evaluate(f"adaptexApp.run('classify', {json.dumps({'text': text})})"), runners["classify"], text)
    for a, b in MORE["embed"]:
        check_embed(page.evaluate(f"adaptexApp.run('embed', {json.dumps({'a': a, 'b': b})})"), runners["embed"], a, b)


@pytest.mark.browser
def test_page_runs_the_dense_dispatch_artifact_as_the_sparse_graph(page, artifacts, plain_tsa):
    """onnxruntime-web (wasm) runs the shipped tsa-charlm export (its top-level If on the rows, each
    branch's weights folded at load): a prompt under 64 characters and the decode steps take the
    dense branch, and the text, logits and decisions equal Python ONNX Runtime on the sparse graph
    alone."""
    assert read_onnx_metadata(artifacts["generate"])["dispatch"]["dense_rows"] == 64
    page.evaluate("adaptexApp.ready")
    g = {"prompt": "import os\n", "new": 8}
    check_generate(page.evaluate(f"adaptexApp.run('generate', {json.dumps(g)})"), plain_tsa, g["prompt"], g["new"])


@pytest.mark.browser
def test_page_reports_bad_input_on_one_line(page):
    page.evaluate("adaptexApp.ready")
    for task, fields, expected in [("generate", {"prompt": "x" * 500, "new": 20}, "exceed the KV cache bound 512"),
                                   ("classify", {"text": "  "}, "the text is empty"),
                                   ("embed", {"a": "fine", "b": "word " * 600}, "above this model's limit of 512")]:
        message = page.evaluate(f"adaptexApp.run({json.dumps(task)}, {json.dumps(fields)}).then(() => null, e => e.message)")
        assert message and expected in message and "\n" not in message, (task, message)
        shown = page.evaluate(f"(s => [s.className, s.textContent])(document.querySelector('#{task} .status'))")
        assert shown == ["status error", message]


# --- the Node script -----------------------------------------------------------------------------------------

def node(*args, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["node", *args], cwd=ROOT, input=stdin, capture_output=True, text=True, timeout=300)


@pytest.mark.node
def test_node_script_matches_python(artifacts, runners):
    g, text, (a, b) = MORE["generate"], MORE["classify"][0], MORE["embed"][0]
    r = node("examples/node/run.mjs", "--json", "--models", str(artifacts["generate"].parent),
             "--prompt", g["prompt"], "--new", str(g["new"]), "--text", text, "--a", a, "--b", b)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    check_generate(out["generate"], runners["generate"], g["prompt"], g["new"])
    check_classify(out["classify"], runners["classify"], text)
    check_embed(out["embed"], runners["embed"], a, b)


@pytest.mark.node
def test_node_script_runs_the_dense_dispatch_artifact_as_the_sparse_graph(artifacts, plain_tsa):
    """onnxruntime-node runs the shipped tsa-charlm export (dense branch for <= 64 rows) with the
    same text, logits and decisions as Python ONNX Runtime on the sparse graph alone."""
    g = {"prompt": "for i in range(10):\n", "new": 10}
    r = node("examples/node/run.mjs", "--json", "--task", "generate", "--tsa", str(artifacts["generate"]),
             "--prompt", g["prompt"], "--new", str(g["new"]))
    assert r.returncode == 0, r.stderr
    check_generate(json.loads(r.stdout)["generate"], plain_tsa, g["prompt"], g["new"])


@pytest.mark.node
def test_node_script_prints_the_decisions(artifacts):
    r = node("examples/node/run.mjs", "--models", str(artifacts["generate"].parent), "--new", "8")
    assert r.returncode == 0, r.stderr
    assert "blocks per generated character: " in r.stdout and "keep rate" in r.stdout
    assert "layer 1:" in r.stdout and " of 8 heads" in r.stdout and "cosine " in r.stdout


@pytest.mark.node
def test_node_script_bad_input_is_one_line(tmp_path):
    for args, expected in [(["--models", str(tmp_path)], "no such artifact; run 'make demo'"),
                           (["--task", "translate"], "unknown --task translate"),
                           (["--new", "0"], "--new must be a whole number")]:
        r = node("examples/node/run.mjs", *args)
        assert r.returncode == 2 and expected in r.stderr and len(r.stderr.strip().splitlines()) == 1, (args, r.stderr)


TRICKY = ["Hello, world!", "Café déjà vu naïve RÉSUMÉ", "我爱北京天安门", "ΣΑΣ ΟΔΟΣ", "İstanbul ǅemal ß",
          "a\u0000b\u200bc\ufffdd\u0085e\u00a0f\u3000g", "x\u0301y\u0327", "🙂 emoji 🚀x", "[MASK] and [CLS][SEP]x[PAD]",
          "don't stop-believing... (really?) $100 #1 @me ~/.rc {a:b} <tag> `q` |p| ^_^", "unaffable " + "z" * 101,
          "tabs\tand\nnewlines\r\nhere", "", "   ", "A 2 B 1 constructor hasOwnProperty __proto__ 7 A"]


@pytest.mark.node
def test_javascript_tokenizers_equal_the_python_ones(artifacts):
    metas = {task: read_onnx_metadata(p) for task, p in artifacts.items()}
    script = ("import { makeTokenizer } from './examples/web/adaptex.mjs';"
              "import { readFileSync } from 'node:fs';"
              "const { specs, texts } = JSON.parse(readFileSync(0, 'utf8'));"
              "const out = {};"
              "for (const [task, spec] of Object.entries(specs)) out[task] = texts.map(t => makeTokenizer(spec).encode(t));"
              "process.stdout.write(JSON.stringify(out));")
    payload = json.dumps({"specs": {t: m["tokenizer"] for t, m in metas.items()}, "texts": TRICKY})
    r = node("--input-type=module", "-e", script, stdin=payload)
    assert r.returncode == 0, r.stderr
    js = json.loads(r.stdout)
    for task, meta in metas.items():
        for text, ids in zip(TRICKY, js[task]):
            assert ids == py_tokenize(meta, text), f"{meta['tokenizer']['kind']} tokenizer on {text!r}"


# --- tokenizer specs (graphs.tokenizers) -------------------------------------------------------------------

def test_graded_words_tokenizer_follows_the_task_vocabulary():
    from adaptex.graphs.tasks import GradedCues
    from adaptex.graphs.tokenizers import encode_words

    task = GradedCues(num_classes=4, vocab_size=64)
    spec = task.tokenizer()
    ids = encode_words(spec, "  the A 2\tsat B 0 on 3\nx ")
    assert ids[1:3] == [task.MARK_A, task.VALUE0 + 2] and ids[4:6] == [task.MARK_B, task.VALUE0]
    assert ids[7] == task.VALUE0 + 3 and len(ids) == 9
    fillers = [i for k, i in enumerate(ids) if k in (0, 3, 6, 8)]
    assert all(task.filler0 <= i < task.vocab_size for i in fillers)
    assert encode_words(spec, "the") == encode_words(spec, "the the")[:1], "a word maps to one filler id"
    assert len(set(encode_words(spec, " ".join(f"w{i}" for i in range(50))))) > 20, "fillers should vary by word"


@pytest.mark.parametrize("edit, problem", [
    (lambda tj: tj["model"].update(type="BPE"), "its model is 'BPE', not WordPiece"),
    (lambda tj: tj["normalizer"].update(type="NFC"), "its normalizer is 'NFC'"),
    (lambda tj: tj["post_processor"].update(single=tj["post_processor"]["single"][1:]), "not the template"),
    (lambda tj: tj["added_tokens"][0].update(lstrip=True), "added token '[PAD]' is normalised, stripped"),
])
def test_wordpiece_spec_names_what_it_cannot_describe(tmp_path, edit, problem):
    from adaptex.graphs.minilm import default_model_dir
    from adaptex.graphs.tokenizers import UnsupportedTokenizer, wordpiece_spec

    tj = json.loads((default_model_dir() / "tokenizer.json").read_text())
    edit(tj)
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(tj))
    with pytest.raises(UnsupportedTokenizer) as e:
        wordpiece_spec(path)
    assert problem in str(e.value) and "\n" not in str(e.value)
