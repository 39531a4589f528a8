#!/usr/bin/env node
// The three app tasks in Node with onnxruntime-node, for a server or a command-line app:
//
//   make demo                        # exports the artifacts into examples/web/models, installs npm packages
//   node examples/node/run.mjs       # all three tasks on their default inputs
//   node examples/node/run.mjs --task generate --prompt "def main(" --new 40
//   node examples/node/run.mjs --task classify --text "the cat sat A 2 on the 3 mat"
//   node examples/node/run.mjs --task embed --a "A man plays a guitar." --b "Someone plays music."
//   node examples/node/run.mjs --json      # the results as JSON (tokens, logits, decisions)
//
// It shares examples/web/adaptex.mjs with the web page: tokenizers and pipelines come from there.
import { readFileSync, existsSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { parseArgs } from "node:util";
import ort from "onnxruntime-node";
import { classify, embed, generate, openModel } from "../web/adaptex.mjs";

const here = dirname(fileURLToPath(import.meta.url));
const DEFAULTS = {
  prompt: "for i in range(", new: "40", text: "the cat sat A 2 on the 3 mat",
  a: "A man is playing a guitar on stage.", b: "Someone performs music with an instrument.",
};

function options(argv) {
  const { values } = parseArgs({
    args: argv,
    options: {
      task: { type: "string", default: "all" },
      models: { type: "string", default: join(here, "..", "web", "models") },
      tsa: { type: "string" }, classifier: { type: "string" }, encoder: { type: "string" },
      prompt: { type: "string", default: DEFAULTS.prompt }, new: { type: "string", default: DEFAULTS.new },
      text: { type: "string", default: DEFAULTS.text },
      a: { type: "string", default: DEFAULTS.a }, b: { type: "string", default: DEFAULTS.b },
      threads: { type: "string", default: "1" },
      json: { type: "boolean", default: false },
      help: { type: "boolean", short: "h", default: false },
    },
  });
  if (!["all", "generate", "classify", "embed"].includes(values.task)) {
    throw new Error(`unknown --task ${values.task}; choose all, generate, classify or embed`);
  }
  for (const key of ["new", "threads"]) {
    if (!/^[1-9][0-9]*$/.test(values[key])) throw new Error(`--${key} must be a whole number >= 1, got ${values[key]}`);
  }
  return values;
}

async function load(path, threads) {
  if (!existsSync(path)) {
    throw new Error(`${path}: no such artifact; run 'make demo' (it exports the three into examples/web/models) or pass its path`);
  }
  return openModel(ort, readFileSync(path), path, { executionProviders: ["cpu"], intraOpNumThreads: threads });
}

// 256-colour ANSI backgrounds, cool to warm: a character that ran fewer blocks shows cooler.
const shade = (blocks, total) => `\x1b[48;5;${[17, 19, 25, 31, 37, 136, 166, 160][Math.round((7 * (blocks - 1)) / Math.max(1, total - 1))]}m`;

function printGenerate(r, tty) {
  const gen = r.tokens.filter((t) => !t.prompt);
  const body = tty ? gen.map((t) => shade(t.blocks, r.numBlocks) + t.text + "\x1b[0m").join("") : r.text;
  console.log(`\n[generate] ${r.tokens.filter((t) => t.prompt).map((t) => t.text).join("")}${body}`);
  if (!tty) console.log(`  blocks per generated character: ${gen.map((t) => t.blocks).join("")}`);
  console.log(`  ${gen.length} characters; each token ran ${r.meanBlocks.toFixed(2)} of ${r.numBlocks} blocks on average; keep rate ${(100 * r.keepRate).toFixed(1)}% of gated blocks`);
}

function printClassify(r) {
  console.log(`\n[classify] class ${r.label} (p = ${r.probabilities[r.label].toFixed(3)})`);
  r.layers.forEach((l, i) => console.log(`  layer ${i}: ${l.k} of ${l.of} heads  ${l.heads.map((h) => (h ? "#" : ".")).join("")}`));
}

function printEmbed(r) {
  console.log(`\n[embed] cosine ${r.cosine.toFixed(4)}   (S = streaming attention head, F = full attention head)`);
  for (const s of r.sentences) {
    console.log(`  "${s.text}" (${s.ids.length} tokens)`);
    s.layers.forEach((l, i) => console.log(`    layer ${i}: ${l.sa.map((m) => (m ? "S" : "F")).join("")}`));
  }
}

async function main() {
  const o = options(process.argv.slice(2));
  if (o.help) {
    console.log(readFileSync(fileURLToPath(import.meta.url), "utf8").split("\n").filter((l) => l.startsWith("//")).join("\n"));
    return;
  }
  const threads = Number(o.threads), want = (t) => o.task === "all" || o.task === t;
  const results = {};
  if (want("generate")) {
    const model = await load(o.tsa ?? join(o.models, "tsa-charlm.onnx"), threads);
    results.generate = await generate(model, o.prompt, Number(o.new));
  }
  if (want("classify")) {
    results.classify = await classify(await load(o.classifier ?? join(o.models, "budgetformer-graded.onnx"), threads), o.text);
  }
  if (want("embed")) {
    results.embed = await embed(await load(o.encoder ?? join(o.models, "elastic-minilm.onnx"), threads), o.a, o.b);
  }
  if (o.json) {
    process.stdout.write(JSON.stringify(results) + "\n");
    return;
  }
  if (results.generate) printGenerate(results.generate, process.stdout.isTTY);
  if (results.classify) printClassify(results.classify);
  if (results.embed) printEmbed(results.embed);
}

main().catch((e) => {
  console.error(`run.mjs: error: ${e.message}`);
  process.exit(2);
});
