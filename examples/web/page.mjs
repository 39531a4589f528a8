// The page: three forms, each running one artifact through adaptex.mjs and drawing its decisions.
// On load it runs all three on their default inputs; window.adaptexApp lets a script (the browser
// test) drive the same forms and read what they computed.
import * as ort from "./node_modules/onnxruntime-web/dist/ort.wasm.min.mjs";
import { classify, embed, generate, openModel } from "./adaptex.mjs";

// Which artifact each task loads: the only model-specific lines of the page.
const ARTIFACTS = {
  generate: "models/tsa-charlm.onnx",
  classify: "models/budgetformer-graded.onnx",
  embed: "models/elastic-minilm.onnx",
};

// python -m http.server sends no cross-origin isolation headers, so wasm threads are unavailable.
ort.env.wasm.numThreads = 1;

const $ = (task, sel) => document.querySelector(`#${task} ${sel}`);
const el = (tag, props = {}, ...children) => {
  const node = Object.assign(document.createElement(tag), props);
  node.append(...children);
  return node;
};

const loading = {};
function model(task) {
  loading[task] ??= (async () => {
    const url = ARTIFACTS[task];
    const res = await fetch(url);
    if (!res.ok) throw new Error(`${url}: HTTP ${res.status}; run 'make demo' to export the artifacts into examples/web/models`);
    const bytes = new Uint8Array(await res.arrayBuffer());
    const m = await openModel(ort, bytes, url, { executionProviders: ["wasm"] });
    describeArtifact(url, m.meta, bytes.length);
    return m;
  })();
  return loading[task];
}

function describeArtifact(url, meta, size) {
  const src = meta.source?.checkpoint ?? meta.source?.model ?? "?";
  document.getElementById("artifacts").append(el("li", {},
    el("code", { textContent: url }),
    ` ${(size / 1e6).toFixed(1)} MB: ${meta.family} (${src}), ${meta.variant} ${meta.precision}, tokenizer ${meta.tokenizer?.kind ?? "none"}, adaptex ${meta.adaptex}`));
}

// Few blocks cool (blue), all blocks warm (orange): the eye finds the cheap characters.
function blockColour(blocks, total) {
  const t = total > 1 ? (blocks - 1) / (total - 1) : 1;
  return `hsl(${Math.round(215 - 185 * t)}, 75%, ${Math.round(82 - 12 * t)}%)`;
}

async function runGenerate(form) {
  const m = await model("generate");
  const text = $("generate", "pre.text"), summary = $("generate", ".summary"), legend = $("generate", ".legend");
  text.replaceChildren();
  summary.textContent = "";
  const L = m.meta.config?.num_layers;
  legend.replaceChildren("blocks run:", ...Array.from({ length: L }, (_, i) => el("span", {
    className: "swatch", textContent: `${i + 1}`, style: `background:${blockColour(i + 1, L)}`,
  })), `of ${L}`);
  const span = (t) => el("span", {
    textContent: t.text, className: t.prompt ? "prompt" : "",
    title: `${JSON.stringify(t.text)}: ran ${t.blocks} of ${L} blocks`, style: `background:${blockColour(t.blocks, L)}`,
  });
  const t0 = performance.now();
  const show = (s, n) => {
    summary.textContent = `keep rate so far: ${(100 * s.keepRate).toFixed(1)}% of gated blocks ran; ` +
      `${s.meanBlocks.toFixed(2)} of ${L} blocks per character on average; ${n} new characters, ` +
      `${((performance.now() - t0) / Math.max(1, n)).toFixed(1)} ms each`;
  };
  let n = 0;
  return generate(m, form.prompt.value, Number(form.new.value), async (token, s) => {
    text.append(span(token));
    if (token.prompt) return;
    show(s, ++n);
    await new Promise((r) => setTimeout(r, 0));  // let the browser paint each character as it comes
  });
}

async function runClassify(form) {
  const m = await model("classify");
  const r = await classify(m, form.text.value);
  const answer = $("classify", ".answer"), heads = $("classify", ".heads");
  answer.replaceChildren(el("b", { textContent: `class ${r.label}` }), ` (p = ${r.probabilities[r.label].toFixed(3)})`,
    el("span", { className: "probs" }, ...r.probabilities.map((p, c) => el("span", { className: "prob" },
      `${c}`, el("span", { className: "bar", style: `width:${Math.max(1, Math.round(60 * p))}px` })))));
  heads.replaceChildren(...r.layers.map((l, i) => el("div", { className: "row", title: m.meta.outputs[l.decision]?.description ?? "" },
    el("span", { className: "name", textContent: `layer ${i}: ${l.k} of ${l.of} heads` }),
    ...l.heads.map((h) => el("span", { className: h ? "cell on" : "cell" })))));
  return r;
}

async function runEmbed(form) {
  const m = await model("embed");
  const r = await embed(m, form.a.value, form.b.value);
  $("embed", ".answer").replaceChildren(el("b", { textContent: `cosine ${r.cosine.toFixed(4)}` }),
    "   per head: ", el("span", { className: "cell fa" }), " full attention (FA) ",
    el("span", { className: "cell sa" }), ` streaming attention (SA: sink ${m.meta.sink}, window ${m.meta.window})`);
  $("embed", ".maps").replaceChildren(...r.sentences.map((s) => {
    const sa = s.layers.reduce((a, l) => a + l.sa.reduce((x, y) => x + y, 0), 0);
    const all = s.layers.reduce((a, l) => a + l.sa.length, 0);
    return el("div", { className: "map" },
      el("h3", { textContent: `"${s.text}": ${s.ids.length} tokens, ${sa} of ${all} heads SA` }),
      ...s.layers.map((l, i) => el("div", { className: "row", title: m.meta.outputs[l.decision]?.description ?? "" },
        el("span", { className: "name", textContent: `layer ${i}` }),
        ...l.sa.map((x) => el("span", { className: x ? "cell sa" : "cell fa" })))));
  }));
  return r;
}

const RUNNERS = { generate: runGenerate, classify: runClassify, embed: runEmbed };
const app = { results: {}, inputs: {}, errors: {} };

async function submit(task) {
  const form = $(task, "form"), status = $(task, ".status"), button = form.querySelector("button");
  status.className = "status";
  status.textContent = "running…";
  button.disabled = true;
  app.inputs[task] = Object.fromEntries(new FormData(form));
  try {
    const t0 = performance.now();
    const result = await RUNNERS[task](form);
    status.textContent = `done in ${((performance.now() - t0) / 1000).toFixed(2)} s`;
    app.results[task] = result;
    delete app.errors[task];
    return result;
  } catch (e) {
    status.className = "status error";
    status.textContent = e.message;
    app.errors[task] = e.message;
    throw e;
  } finally {
    button.disabled = false;
  }
}

for (const task of Object.keys(RUNNERS)) {
  $(task, "form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    submit(task).catch(() => {});  // the status line shows the error
  });
}

// Fill a task's form fields, submit it, and resolve with what it computed.
app.run = (task, fields = {}) => {
  const form = $(task, "form");
  for (const [name, value] of Object.entries(fields)) form.elements[name].value = value;
  return submit(task);
};

// All three on their default inputs; one failing does not stop the others. Resolves with what they
// computed from which inputs (later runs replace app.results and app.inputs, not this snapshot).
app.ready = (async () => {
  for (const task of Object.keys(RUNNERS)) await submit(task).catch(() => {});
  return { results: { ...app.results }, inputs: { ...app.inputs }, errors: { ...app.errors } };
})();
window.adaptexApp = app;
