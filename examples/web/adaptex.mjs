// Running adaptex artifacts from JavaScript: the artifact's metadata, its tokenizer, and three tasks
// (generate text through the KV cache, classify, embed two sentences), each returning the model's
// routing decisions next to its answer.
//
// One module serves the browser page (onnxruntime-web) and the Node script (onnxruntime-node). It never
// imports onnxruntime itself: the caller passes the `ort` it loaded, since both packages share one API.
// Everything model-specific (tokenizer, cache bound, decision names, shapes) comes from the metadata that
// `adaptex export` writes into the artifact; nothing here names a model.

const META_KEY = "adaptex";

// --- metadata --------------------------------------------------------------------------------------

// ONNX ModelProto: field 14 holds metadata_props, each a message {1: key, 2: value}. Reading only the
// top-level fields is enough, and lets an app read the metadata without a protobuf library.
function protoFields(buf, start, end, where) {
  const fields = [];
  let pos = start;
  const varint = () => {
    let value = 0, scale = 1;
    for (;;) {
      if (pos >= end) throw new Error(`${where}: truncated ONNX file; re-export it with adaptex export`);
      const b = buf[pos++];
      value += (b & 0x7f) * scale;
      if (b < 0x80) return value;
      scale *= 128;
    }
  };
  while (pos < end) {
    const tag = varint(), field = Math.floor(tag / 8), wire = tag % 8;
    if (wire === 0) varint();
    else if (wire === 1) pos += 8;
    else if (wire === 5) pos += 4;
    else if (wire === 2) {
      const len = varint();
      fields.push({ field, start: pos, end: pos + len });
      pos += len;
    } else throw new Error(`${where}: not an ONNX model (protobuf wire type ${wire}); pass a .onnx file from adaptex export`);
  }
  if (pos !== end) throw new Error(`${where}: truncated ONNX file; re-export it with adaptex export`);
  return fields;
}

/** The adaptex metadata object of an ONNX artifact's bytes (JSON data, parsed, never evaluated). */
export function readMetadata(bytes, where = "artifact") {
  const buf = bytes instanceof Uint8Array ? bytes : new Uint8Array(bytes);
  const text = new TextDecoder();
  let json = null;
  for (const f of protoFields(buf, 0, buf.length, where)) {
    if (f.field !== 14) continue;
    const entry = {};
    for (const g of protoFields(buf, f.start, f.end, where)) entry[g.field] = text.decode(buf.subarray(g.start, g.end));
    if (entry[1] === META_KEY) json = entry[2];
  }
  if (json === null) throw new Error(`${where}: no adaptex metadata; export the model with 'adaptex export MODEL --target onnx'`);
  let meta;
  try {
    meta = JSON.parse(json);
  } catch (e) {
    throw new Error(`${where}: its adaptex metadata is not valid JSON (${e.message}); re-export it with adaptex export`);
  }
  for (const key of ["family", "inputs", "outputs"]) {
    if (!meta || typeof meta[key] !== (key === "family" ? "string" : "object")) {
      throw new Error(`${where}: its adaptex metadata has no ${key}; re-export it with adaptex export`);
    }
  }
  return meta;
}

/** Load an artifact: {ort, session, meta, tokenizer, where}. `options` go to InferenceSession.create. */
export async function openModel(ort, bytes, where = "artifact", options = {}) {
  const data = bytes instanceof Uint8Array ? bytes : new Uint8Array(bytes);
  const meta = readMetadata(data, where);
  const session = await ort.InferenceSession.create(data, options);
  return { ort, session, meta, tokenizer: makeTokenizer(meta.tokenizer, where), where };
}

// --- tokenizers (the kinds of graphs/tokenizers.py) ------------------------------------------------

/** A tokenizer from a metadata spec: {kind, encode(text) -> ids, decode(ids) -> text, piece(id)}. */
export function makeTokenizer(spec, where = "artifact") {
  const kind = spec ? spec.kind : "ids";
  if (kind === "chars") return charsTokenizer(spec);
  if (kind === "words") return wordsTokenizer(spec);
  if (kind === "wordpiece") return wordpieceTokenizer(spec);
  if (kind === "ids") {
    const none = () => { throw new Error(`${where}: this model has no text tokenizer (its inputs are token ids); feed ids`); };
    return { kind, encode: none, decode: (ids) => ids.join(" "), piece: String };
  }
  throw new Error(`${where}: unknown tokenizer kind ${JSON.stringify(kind)}; update adaptex.mjs or re-export the model`);
}

function charsTokenizer(spec) {
  const stoi = new Map();
  spec.itos.forEach((c, i) => { if (i >= 2) stoi.set(c, i); });  // 0 and 1 are pad and unknown, never text
  const piece = (i) => (i === spec.pad ? "" : i === spec.unk ? "\ufffd" : spec.itos[i]);
  return {
    kind: "chars",
    encode: (text) => Array.from(text, (c) => stoi.get(c) ?? spec.unk),
    decode: (ids) => ids.map(piece).join(""),
    piece,
  };
}

function wordsTokenizer(spec) {
  const vocab = new Map(Object.entries(spec.vocab));  // a Map: a word such as "constructor" is no key of it
  const itos = new Map([...vocab].map(([w, i]) => [i, w]));
  const sep = new RegExp(`[${spec.separators.replace(/[\\\]\[^-]/g, "\\$&")}]+`);
  const [first, last] = spec.filler;
  const encodeWord = (word) => {
    if (vocab.has(word)) return vocab.get(word);
    let h = 0;
    for (const c of word) h = (Math.imul(h, 31) + c.codePointAt(0)) >>> 0;
    return first + (h % (last - first + 1));
  };
  const piece = (i) => itos.get(i) ?? `<${i}>`;
  return {
    kind: "words",
    encode: (text) => text.split(sep).filter((w) => w.length > 0).map(encodeWord),
    decode: (ids) => ids.map(piece).join(" "),
    piece,
  };
}

// BERT's normaliser and pre-tokeniser, as the Hugging Face tokenizers library runs them.
const CJK = [[0x4e00, 0x9fff], [0x3400, 0x4dbf], [0x20000, 0x2a6df], [0x2a700, 0x2b73f], [0x2b740, 0x2b81f],
  [0x2b820, 0x2ceaf], [0xf900, 0xfaff], [0x2f800, 0x2fa1f]];
const OTHER = /\p{C}/u, SPACE = /\p{White_Space}/u, NONSPACING = /\p{Mn}/u, PUNCT = /\p{P}/u;
const ASCII_PUNCT = /[!-/:-@[-`{-~]/;

function bertNormalize(spec, text) {
  let out = "";
  for (const c of text) {
    const cp = c.codePointAt(0);
    if (spec.clean_text) {
      if (cp === 0 || cp === 0xfffd || (OTHER.test(c) && c !== "\t" && c !== "\n" && c !== "\r")) continue;
      if (SPACE.test(c)) { out += " "; continue; }
    }
    out += spec.handle_chinese_chars && CJK.some(([a, b]) => cp >= a && cp <= b) ? ` ${c} ` : c;
  }
  if (spec.strip_accents) out = Array.from(out.normalize("NFD")).filter((c) => !NONSPACING.test(c)).join("");
  // per character, as the Rust library does: a whole-string toLowerCase would turn a final sigma into ς
  if (spec.lowercase) out = Array.from(out, (c) => c.toLowerCase()).join("");
  return out;
}

function bertWords(text) {
  const words = [];
  let cur = "";
  for (const c of text) {
    if (SPACE.test(c)) {
      if (cur) words.push(cur);
      cur = "";
    } else if (PUNCT.test(c) || ASCII_PUNCT.test(c)) {
      if (cur) words.push(cur);
      words.push(c);
      cur = "";
    } else cur += c;
  }
  if (cur) words.push(cur);
  return words;
}

function wordpieceTokenizer(spec) {
  const stoi = new Map(spec.vocab.map((t, i) => [t, i]));
  const specials = Object.keys(spec.special).sort((a, b) => b.length - a.length);
  const pieces = (word) => {
    const chars = Array.from(word);
    if (chars.length > spec.max_input_chars_per_word) return [spec.unk];
    const ids = [];
    for (let start = 0; start < chars.length;) {
      let end = chars.length, id;
      for (; start < end; end--) {  // the longest piece in the vocabulary first
        id = stoi.get((start > 0 ? spec.prefix : "") + chars.slice(start, end).join(""));
        if (id !== undefined) break;
      }
      if (id === undefined) return [spec.unk];  // one unknown piece makes the whole word unknown
      ids.push(id);
      start = end;
    }
    return ids;
  };
  const encodeText = (text) => bertWords(bertNormalize(spec, text)).flatMap(pieces);
  const encode = (text) => {
    // special tokens such as [MASK] are matched in the raw text, before normalisation
    const ids = [spec.cls];
    let last = 0;
    for (let i = 0; i < text.length;) {
      const hit = specials.find((s) => text.startsWith(s, i));
      if (!hit) { i++; continue; }
      ids.push(...encodeText(text.slice(last, i)), spec.special[hit]);
      i += hit.length;
      last = i;
    }
    ids.push(...encodeText(text.slice(last)), spec.sep);
    return ids;
  };
  const piece = (i) => spec.vocab[i];
  return { kind: "wordpiece", encode, decode: (ids) => ids.map(piece).join(" "), piece };
}

// --- running -----------------------------------------------------------------------------------------

const TYPED = { float32: Float32Array, float16: Uint16Array };
const int64 = (ort, values, dims) => new ort.Tensor("int64", BigInt64Array.from(values, (v) => BigInt(v)), dims);

function argmax(row) {
  let best = 0;
  for (let i = 1; i < row.length; i++) if (row[i] > row[best]) best = i;  // the first of equal maxima, as numpy
  return best;
}

const decisionsOf = (meta, kind) => Object.keys(meta.decisions || {}).filter((n) => meta.decisions[n].kind === kind);

// The answer output: the one output that is neither a decision nor a cache entry.
function answerOutput(model) {
  const names = Object.keys(model.meta.outputs).filter((n) => !n.startsWith("decisions.") && !n.startsWith("present."));
  if (names.length !== 1) throw new Error(`${model.where}: expected one answer output besides the decisions, found ${names.join(", ") || "none"}; is this an adaptex artifact?`);
  return names[0];
}

function checkLength(model, ids, what) {
  const limit = model.meta.max_sequence;
  if (ids.length === 0) throw new Error(`${what} is empty: type some text`);
  if (limit && ids.length > limit) throw new Error(`${what} is ${ids.length} tokens long, above this model's limit of ${limit}; shorten it`);
}

/** Greedy generation through the KV cache of a decoder artifact.
 * Each token (prompt and generated) records the blocks it ran: a gated block runs for a token only
 * where its `keep` decision says so. The last generated token is fed once more so that it has its own
 * decisions. onToken(token, summary) is called for each prompt token after the prefill, then after
 * each new token (the page draws as it goes).
 * Returns {promptIds, ids, text, tokens, steps: [{logits}], keepRate, meanBlocks, numBlocks}. */
export async function generate(model, prompt, maxNewTokens, onToken = null) {
  const { ort, session, meta, tokenizer, where } = model;
  if (!meta.decoder) throw new Error(`${where}: a ${meta.family} artifact is not a decoder; load a TSA decoder for generation`);
  const fed = ["input_ids", "attention_mask"];
  const pastNames = Object.keys(meta.inputs).filter((n) => n.startsWith("past_key_values."));
  const other = Object.keys(meta.inputs).filter((n) => !fed.includes(n) && !pastNames.includes(n));
  if (other.length) throw new Error(`${where}: input ${other[0]} is not one this generator feeds (input_ids, attention_mask, past_key_values.*); use examples/tsa_generate.py`);
  const promptIds = typeof prompt === "string" ? tokenizer.encode(prompt) : Array.from(prompt);
  if (promptIds.length === 0) throw new Error("empty prompt: type at least one character");
  if (!Number.isInteger(maxNewTokens) || maxNewTokens < 1) throw new Error(`new tokens must be a whole number >= 1, got ${maxNewTokens}`);
  const bound = meta.kv_cache_bound ?? meta.max_sequence;
  if (bound && promptIds.length + maxNewTokens > bound) {
    throw new Error(`prompt (${promptIds.length} tokens) + ${maxNewTokens} new tokens exceed the KV cache bound ${bound}; shorten the prompt or ask for fewer tokens`);
  }
  const keepNames = decisionsOf(meta, "keep");
  const numBlocks = meta.config?.num_layers ?? keepNames.length + 1;
  // the cache starts empty: every named axis but the batch is a past length, 0 at prefill
  let past = {};
  for (const name of pastNames) {
    const dims = meta.inputs[name].shape.map((d) => (typeof d === "number" ? d : d === "batch" ? 1 : 0));
    const Typed = TYPED[meta.inputs[name].dtype];
    if (!Typed) throw new Error(`${where}: ${name} is ${meta.inputs[name].dtype}; this generator feeds float32 or float16 caches`);
    past[name] = new ort.Tensor(meta.inputs[name].dtype, new Typed(0), dims);
  }
  const run = async (ids, pastLength) => session.run({
    input_ids: int64(ort, ids, [1, ids.length]),
    attention_mask: int64(ort, new Array(pastLength + ids.length).fill(1), [1, pastLength + ids.length]),
    ...past,
  });
  const tokens = [];
  let kept = 0;
  const record = (out, id, position, prompted) => {
    const keep = keepNames.map((n) => Number(out[n].data[position]));
    kept += keep.reduce((a, b) => a + b, 0);
    const token = { id, text: tokenizer.piece(id), prompt: prompted, keep, blocks: numBlocks - keep.filter((k) => !k).length };
    tokens.push(token);
    return token;
  };
  const summary = () => ({
    keepRate: keepNames.length ? kept / (tokens.length * keepNames.length) : 1,
    meanBlocks: tokens.reduce((a, t) => a + t.blocks, 0) / tokens.length,
  });
  const answer = answerOutput(model);
  let out = await run(promptIds, 0);
  for (const [t, id] of promptIds.entries()) {
    const token = record(out, id, t, true);
    if (onToken) await onToken(token, summary());
  }
  const ids = [], steps = [];
  for (let n = promptIds.length; ids.length < maxNewTokens; n++) {
    const [, T, V] = out[answer].dims;
    const logits = out[answer].data.slice((T - 1) * V, T * V);
    const next = argmax(logits);
    ids.push(next);
    steps.push({ logits: Array.from(logits) });
    past = {};
    for (const name of pastNames) past[name] = out[name.replace("past_key_values.", "present.")];
    out = await run([next], n);
    const token = record(out, next, 0, false);
    if (onToken) await onToken(token, summary());
  }
  return { promptIds, ids, text: tokenizer.decode(ids), tokens, steps, numBlocks, ...summary() };
}

/** Classify one text: {ids, output, logits, probabilities, label, layers: [{layer, k, of, heads}]}. */
export async function classify(model, text) {
  const { ort, session, meta, tokenizer } = model;
  const ids = typeof text === "string" ? tokenizer.encode(text) : Array.from(text);
  checkLength(model, ids, "the text");
  const out = await session.run({ input_ids: int64(ort, ids, [1, ids.length]), attention_mask: int64(ort, ids.map(() => 1), [1, ids.length]) });
  const name = answerOutput(model);
  const logits = Array.from(out[name].data);
  const top = Math.max(...logits);
  const exp = logits.map((v) => Math.exp(v - top));
  const total = exp.reduce((a, b) => a + b, 0);
  const sets = Object.fromEntries(decisionsOf(meta, "head_set").map((n) => [meta.decisions[n].layer, n]));
  const layers = decisionsOf(meta, "budget").map((n) => {
    const layer = meta.decisions[n].layer, mask = sets[layer];
    const heads = mask ? Array.from(out[mask].data, Number) : [];
    return { layer, decision: n, k: Number(out[n].data[0]), of: heads.length || meta.config?.num_heads, heads };
  });
  return { ids, output: name, logits, probabilities: exp.map((v) => v / total), label: argmax(logits), layers };
}

/** Embed two texts, one run each: {cosine, sentences: [{text, ids, embedding, layers: [{layer, sa}]}]}.
 * sa[h] is 1 where head h ran streaming (sparse) attention, 0 full attention. */
export async function embed(model, textA, textB) {
  const { ort, session, meta, tokenizer } = model;
  const name = answerOutput(model);
  const modes = decisionsOf(meta, "head_mode");
  const sentences = [];
  for (const [i, text] of [textA, textB].entries()) {
    const ids = tokenizer.encode(text);
    checkLength(model, ids, `sentence ${i + 1}`);
    const out = await session.run({ input_ids: int64(ort, ids, [1, ids.length]), attention_mask: int64(ort, ids.map(() => 1), [1, ids.length]) });
    sentences.push({
      text, ids, embedding: Array.from(out[name].data),
      layers: modes.map((n) => ({ layer: meta.decisions[n].layer, decision: n, sa: Array.from(out[n].data, Number) })),
    });
  }
  const [a, b] = sentences.map((s) => s.embedding);
  const dot = (x, y) => x.reduce((acc, v, i) => acc + v * y[i], 0);
  return { output: name, cosine: dot(a, b) / Math.sqrt(dot(a, a) * dot(b, b)), sentences };
}
