// doel's Web Worker: the bundle's graph on doel's kernel (WebAssembly) or onnxruntime-web
// (WebGPU, or WebAssembly where the kernel cannot run), its tokenizer.json in tokenizers.js, a
// prefill and one run a token through the KV cache, sampling, and text streamed to the page in
// whole characters and whole Bengali clusters. Written by doel-export --web (export/web.py says
// why the page works as it does); no server beyond static files.
"use strict";

// tokenizers.js ships as CommonJS only: give it a `module` to fill, then read its export.
self.module = { exports: {} };
self.exports = self.module.exports;
importScripts("tokenizers.min.js"); // the .cjs file renamed: static hosts serve .js as script
const { Tokenizer } = self.module.exports;

const PREFILL_CHUNK = 128; // prompt tokens a run, as doel-serve (serve/engine.py)
const CACHE = "doel-web-v1";
let spec, session, kernel, tokenizer, vocabSize, stopping = false;

const post = (msg) => self.postMessage(msg);

async function sha256(buf) {
  const d = new Uint8Array(await crypto.subtle.digest("SHA-256", buf));
  return Array.from(d, (b) => b.toString(16).padStart(2, "0")).join("");
}

// Which backend: WebGPU where the browser gives an adapter (ONNX Runtime's WebGPU EP, the int4
// graph's MatMulNBits kernels there), else WebAssembly; `want` ("webgpu"/"wasm") forces one.
// Returns {backend, why, adapter}.
async function pickBackend(want) {
  if (want === "wasm") return { backend: "wasm", why: "asked for (?backend=wasm)" };
  if (!self.navigator || !navigator.gpu)
    return { backend: "wasm", why: "this browser has no WebGPU (navigator.gpu is missing)" };
  let adapter = null;
  try {
    adapter = await navigator.gpu.requestAdapter();
  } catch (err) {
    return { backend: "wasm", why: `navigator.gpu.requestAdapter() failed: ${err.message || err}` };
  }
  if (!adapter) return { backend: "wasm", why: "navigator.gpu.requestAdapter() gave no adapter" };
  const info = adapter.info || {};
  const name = [info.vendor, info.architecture, info.description].filter(Boolean).join(" ");
  return { backend: "webgpu", why: want === "webgpu" ? "asked for (?backend=webgpu)" :
    "the browser gives a WebGPU adapter", adapter: name || "unnamed",
    software: info.architecture === "swiftshader" || !!adapter.isFallbackAdapter };
}

// One piece streamed into `view` (its place in the weights' buffer: the kernel's memory, or
// onnxruntime-web's external data), never whole in a buffer of its own: the tab's peak is then
// the weights, not those plus pieces waiting for the garbage collector. Offline, from Cache
// Storage. A fresh piece goes there first (the browser streams it) and is read back; it is
// checked against its sha256 where it landed, and dropped from the cache if damaged. Without a
// secure context (no cache, no crypto.subtle): fetched only. (A tee of the fetch into both held
// whole pieces in the tab while the cache lagged: 0.4B's cold load peaked 260 MB higher.)
async function pieceInto(p, cache, view) {
  let resp = cache && (await cache.match(p.file));
  const fresh = !resp;
  if (fresh) {
    resp = await fetch(p.file);
    if (!resp.ok) throw new Error(`${p.file}: HTTP ${resp.status}`);
    if (cache) {
      const put = await cache.put(p.file, resp).then(() => true, () => false); // quota: fetch again
      resp = put ? await cache.match(p.file) : await fetch(p.file);
    }
  }
  const reader = resp.body.getReader();
  let at = 0;
  for (let r = await reader.read(); !r.done; r = await reader.read()) {
    if (at + r.value.length > p.bytes) throw new Error(`${p.file} is longer than web.json says`);
    view.set(r.value, at);
    at += r.value.length;
  }
  if (at !== p.bytes) throw new Error(`${p.file} is ${at} bytes, not ${p.bytes}: reload the page`);
  if (fresh && self.crypto && crypto.subtle && (await sha256(view)) !== p.sha256) {
    if (cache) await cache.delete(p.file);
    throw new Error(`${p.file} is damaged (sha256 differs): reload the page`);
  }
}

// The graph's weights, from its pieces, into `data` (graph.data_bytes long; a new array unless
// given: the kernel gives its memory).
async function weights(graph, data = new Uint8Array(graph.data_bytes)) {
  const cache = self.caches ? await caches.open(CACHE).catch(() => null) : null;
  let at = 0;
  for (const p of graph.data) {
    await pieceInto(p, cache, data.subarray(at, at + p.bytes));
    at += p.bytes;
    post({ type: "progress", loaded: at, total: graph.data_bytes });
  }
  return data;
}

// ------------------------------------------ doel's kernel (export/web/kernel.c, web_kernel.py)

// The relaxed-SIMD build where this engine computes its dot product right (dk_selftest), else
// the plain-SIMD one (`simd` "plain" forces it: tests); null where the browser has no
// WebAssembly SIMD.
const KERNELS = [["relaxed", "doel-kernel-relaxed.wasm"], ["plain", "doel-kernel.wasm"]];
async function kernelModule(simd) {
  for (const [kind, file] of KERNELS.filter(([kind]) => !simd || kind === simd)) {
    const bytes = await (await fetch(file)).arrayBuffer();
    if (!WebAssembly.validate(bytes)) continue;
    const { instance } = await WebAssembly.instantiate(bytes, {});
    if (instance.exports.dk_selftest() === 1) return { kind, k: instance.exports };
  }
  return null;
}

// The bundle graph's weights streamed into the kernel's memory, as they are in the file (4
// bits), and its layout (web.json's graphs.bundle.kernel) given to dk_init.
async function openKernel(graph, mod) {
  const { k } = mod;
  const layout = graph.kernel;
  const base = k.dk_alloc(graph.data_bytes);
  if (!base) throw new Error(`no memory for the ${(graph.data_bytes / 1e6).toFixed(0)} MB of weights`);
  await weights(graph, new Uint8Array(k.memory.buffer, base, graph.data_bytes));
  const put = (Kind, xs) => {
    const at = k.dk_alloc(4 * xs.length);
    new Kind(k.memory.buffer, at, xs.length).set(xs);
    return at;
  };
  const cfg = put(Int32Array, layout.config);
  const floats = put(Float32Array, layout.floats);
  const offsets = put(Uint32Array, layout.offsets);
  const ids = k.dk_alloc(4 * PREFILL_CHUNK); // before dk_init: the cache must stay the last
  if (k.dk_init(base, cfg, floats, offsets) !== 0) throw new Error("the kernel found no memory");
  return { ...mod, ids, vocab: layout.config[6] };
}

// Feed `ids` after the state's cached tokens through the kernel; the last one's logits.
function kernelForward(state, ids) {
  const { k } = kernel;
  let at = 0;
  for (let lo = 0; lo < ids.length; lo += PREFILL_CHUNK) {
    const chunk = ids.slice(lo, lo + PREFILL_CHUNK);
    new Int32Array(k.memory.buffer, kernel.ids, chunk.length).set(chunk);
    at = k.dk_forward(kernel.ids, chunk.length, state.n);
    if (!at) throw new Error("the kernel's memory could not grow for the cache (out of memory)");
    state.n += chunk.length;
  }
  return new Float32Array(k.memory.buffer, at, kernel.vocab).slice(); // the next call may grow memory
}

// weightsIn (WebAssembly only): "auto" (the default) or "kernel": doel's kernel on the bundle's
// own weights (int4 in an int4 bundle: the smallest and, in onnxruntime-web's absence of a fast
// 4-bit kernel, the fastest: benchmarks/results/web_*.md); where it cannot run, onnxruntime-web
// with "int8" (DynamicQuantizeMatMul: 8 bits in memory, about fp32's speed), or with "bundle"
// (its MatMulNBits: several times slower) on a low-memory device. "int8", "bundle" and "fp32"
// (where the folder has that graph) force onnxruntime-web's. export/web_graph.py says why.
async function load(threads, want, weightsIn, lowMemory, simd) {
  const t0 = performance.now();
  spec = await (await fetch("web.json")).json();
  const graphs = spec.graphs || { bundle: spec };
  let pick = await pickBackend(want);
  const [tokJson, tokConfig] = await Promise.all([
    fetch("tokenizer.json").then((r) => r.json()),
    fetch("tokenizer_config.json").then((r) => (r.ok ? r.json() : {})),
  ]);
  tokenizer = new Tokenizer(tokJson, tokConfig);
  // A model's embedding may be larger than its tokenizer (padding); such ids decode to nothing,
  // as in tokenizers.
  const ids = [...Object.values(tokJson.model.vocab), ...tokJson.added_tokens.map((t) => t.id)];
  vocabSize = Math.max(...ids) + 1;
  let opened;
  if (pick.backend === "webgpu") {
    try {
      runtime("webgpu", threads);
      opened = await open(graphs, "webgpu", "bundle");
    } catch (err) {
      // A GPU that refuses the graph (memory, a missing feature): the page still runs, on
      // WebAssembly, and says why.
      const why = `WebGPU failed (${err && err.message ? err.message : err}): WebAssembly instead`;
      pick = { backend: "wasm", why };
    }
  }
  if (!opened) opened = await openWasm(graphs, threads, weightsIn || "auto", lowMemory, simd);
  const { mode, graph } = opened;
  post({
    type: "ready",
    backend: pick.backend,
    why: opened.why ? `${pick.why}; ${opened.why}` : pick.why,
    adapter: pick.adapter || null,
    software_adapter: !!pick.software,
    threads: kernel ? 1 : ort.env.wasm.numThreads,
    kernel: kernel ? kernel.kind : null,
    kernel_memory_bytes: kernel ? kernel.k.memory.buffer.byteLength : null,
    weights_in_memory: mode === "bundle" || mode === "kernel" ? spec.quant : mode,
    graph: mode,
    isolated: !!self.crossOriginIsolated,
    load_ms: performance.now() - t0,
    bundle: spec.bundle,
    quantization: spec.quantization,
    data_bytes: graph.data_bytes,
    runtime: spec.runtime,
  });
}

// WebAssembly: doel's kernel where weightsIn allows it and it runs here, else onnxruntime-web
// with weightsIn's graph; `why` says why not the kernel when it was wanted and is not used.
async function openWasm(graphs, threads, weightsIn, lowMemory, simd) {
  let why = null;
  if (weightsIn === "auto" || weightsIn === "kernel") {
    const mod = graphs.bundle.kernel ? await kernelModule(simd) : null;
    if (mod) {
      kernel = await openKernel(graphs.bundle, mod);
      return { mode: "kernel", graph: graphs.bundle, why: `doel's kernel (${mod.kind} SIMD)` };
    }
    why = graphs.bundle.kernel
      ? "this browser's WebAssembly has no SIMD for doel's kernel: onnxruntime-web instead"
      : `doel's kernel does not run this graph (${graphs.bundle.kernel_why}): onnxruntime-web`;
    weightsIn = lowMemory ? "bundle" : "int8";
  }
  runtime("wasm", threads);
  return { ...(await open(graphs, "wasm", weightsIn)), why };
}

// onnxruntime-web's build for `backend` as the global `ort` (a later call replaces it).
function runtime(backend, threads) {
  importScripts(backend === "webgpu" ? "ort.webgpu.min.js" : "ort.wasm.min.js");
  // Threads need SharedArrayBuffer, which a browser gives only a cross-origin isolated page.
  const most = self.crossOriginIsolated ? navigator.hardwareConcurrency || 1 : 1;
  ort.env.wasm.numThreads = Math.max(1, Math.min(threads || Math.min(most, 4), most));
  ort.env.wasm.wasmPaths = new URL("./", self.location.href).href;
}

// The session of the graph `backend` runs (WebGPU: the bundle's own; WebAssembly: weightsIn's);
// returns which graph.
async function open(graphs, backend, weightsIn) {
  let mode = backend === "webgpu" ? "bundle" : weightsIn;
  if (!(mode in graphs)) mode = "int8" in graphs && mode !== "bundle" ? "int8" : "bundle";
  const graph = graphs[mode];
  const data = await weights(graph);
  const model = await (await fetch(graph.model)).arrayBuffer();
  const external = graph.data_path ? [{ path: graph.data_path, data }] : [];
  session = await ort.InferenceSession.create(new Uint8Array(model), {
    executionProviders: [backend],
    graphOptimizationLevel: "all",
    externalData: external,
    // Without its QDQ rules ONNX Runtime folds each DequantizeLinear of constant weights into an
    // fp32 matrix at load, instead of fusing it with its MatMul back into MatMulNBits.
    extra: mode === "fp32" ? { session: { disable_quant_qdq: "1" } } : {},
    // On WebGPU the cache stays in GPU memory from one step to the next: read back, it would
    // cross to the CPU and back every token, the whole context's worth.
    ...(backend === "webgpu" ? { preferredOutputLocation: presentsOnGpu() } : {}),
  });
  return { mode, graph };
}

function presentsOnGpu() {
  const where = {};
  for (const name of spec.past_names)
    where[name.replace("past_key_values.", "present.")] = "gpu-buffer";
  return where;
}

// A cache tensor's GPU buffer is freed once the next step has read it (WebAssembly's are
// JavaScript arrays: the garbage collector's).
function release(past) {
  for (const t of Object.values(past)) if (t.location === "gpu-buffer") t.dispose();
}

const int64 = (xs, dims) => new ort.Tensor("int64", BigInt64Array.from(xs, BigInt), dims);

function emptyPast() {
  const past = {};
  const dims = [1, spec.kv_heads, 0, spec.head_dim];
  for (const name of spec.past_names)
    past[name] =
      spec.kv_dtype === "float16"
        ? new ort.Tensor("float16", new Uint16Array(0), dims)
        : new ort.Tensor("float32", new Float32Array(0), dims);
  return past;
}

// Feed `ids` after the state's cached tokens; returns the logits of the last one. The cache
// grows by the run's present outputs (present = past + new).
async function forward(state, ids) {
  let logits;
  for (let lo = 0; lo < ids.length; lo += PREFILL_CHUNK) {
    const chunk = ids.slice(lo, lo + PREFILL_CHUNK);
    const total = state.n + chunk.length;
    const feeds = {
      input_ids: int64(chunk, [1, chunk.length]),
      attention_mask: int64(new Array(total).fill(1), [1, total]),
      ...state.past,
    };
    if (spec.position_ids)
      feeds.position_ids = int64(
        chunk.map((_, i) => state.n + i),
        [1, chunk.length],
      );
    if (spec.logits_to_keep) feeds.logits_to_keep = int64([1], [1]);
    const out = await session.run(feeds);
    release(state.past);
    for (const name of spec.past_names)
      state.past[name] = out[name.replace("past_key_values.", "present.")];
    state.n = total;
    const [, rows, vocab] = out.logits.dims;
    logits = out.logits.data.slice((rows - 1) * vocab, rows * vocab);
  }
  return logits;
}

// ---------------------------------------------------------------- sampling (serve/sampling.py)

function mulberry32(seed) {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = Math.imul(a ^ (a >>> 15), 1 | a);
    t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

// Penalty on the raw logits, then temperature, top-k, top-p, one draw; temperature 0: argmax.
function sample(logits, p, rand, seen) {
  const z = Float64Array.from(logits);
  if (p.repetition_penalty !== 1)
    for (const id of seen)
      z[id] = z[id] > 0 ? z[id] / p.repetition_penalty : z[id] * p.repetition_penalty;
  if (!(p.temperature >= 1e-5)) {
    let best = 0;
    for (let i = 1; i < z.length; i++) if (z[i] > z[best]) best = i;
    return best;
  }
  let order = Array.from(z.keys()).sort((a, b) => z[b] - z[a] || a - b);
  if (p.top_k > 0 && p.top_k < order.length) {
    const kth = z[order[p.top_k - 1]];
    order = order.filter((i) => z[i] >= kth);
  }
  const top = z[order[0]] / p.temperature;
  let probs = order.map((i) => Math.exp(z[i] / p.temperature - top));
  const sum = probs.reduce((a, b) => a + b, 0);
  probs = probs.map((x) => x / sum);
  let keep = probs.length;
  if (p.top_p < 1) {
    let mass = 0;
    keep = 0;
    while (keep < probs.length && mass < p.top_p) mass += probs[keep++];
  }
  const kept = probs.slice(0, keep);
  let r = rand() * kept.reduce((a, b) => a + b, 0);
  for (let i = 0; i < kept.length; i++) if ((r -= kept[i]) < 0) return order[i];
  return order[kept.length - 1];
}

// ------------------------------------------------- streamed text (serve/textstream.py's rule)

const REPLACEMENT = "\ufffd";
const VIRAMA = "\u09cd";
const isBengaliLetter = (ch) => ch >= "\u0980" && ch <= "\u09ff" && /\p{Lo}/u.test(ch);
const extendsCluster = (ch) => /\p{M}/u.test(ch) || ch === "\u200c" || ch === "\u200d";

// Where the last grapheme cluster starts if a later character may still join it, else length.
function openClusterStart(text) {
  const i = text.length;
  if (i === 0) return 0;
  const last = text[i - 1];
  if (!(isBengaliLetter(last) || extendsCluster(last))) return i;
  let j = i - 1;
  while (j > 0) {
    if (extendsCluster(text[j])) j -= 1;
    else if (isBengaliLetter(text[j]) && [VIRAMA, "\u200c", "\u200d"].includes(text[j - 1])) j -= 1;
    else break;
  }
  return isBengaliLetter(text[j]) || extendsCluster(text[j]) ? j : i;
}

class TextStream {
  // context: the prompt's last ids (spec.context_ids of them), decoded in front of the
  // completion and cut off, so its first token keeps a leading space as doel-serve's does.
  constructor(decode, context = []) {
    this.decode = decode;
    this.context = context;
    this.prefix = context.length ? decode(context) : "";
    this.ids = [];
    this.text = ""; // decoded so far
    this.sent = 0; // characters of `text` sent
  }
  whole() {
    const text = this.decode([...this.context, ...this.ids]);
    if (text.startsWith(this.prefix)) return text.slice(this.prefix.length);
    return text.slice(this.prefix.replace(/\uFFFD+$/, "").length); // the prompt ended mid-character
  }
  push(id) {
    this.ids.push(id);
    const text = this.whole();
    // Half a UTF-8 character (byte tokens) decodes to U+FFFD until its other bytes arrive.
    if (text.endsWith(REPLACEMENT)) return "";
    this.text = text;
    const tail = text.slice(-32); // a Bengali cluster has under 10 characters
    const open = text.length - tail.length + openClusterStart(tail);
    const safe = open === text.length - tail.length && text.length > 32 ? text.length : open;
    return this.emit(Math.max(safe, this.sent));
  }
  finish() {
    this.text = this.whole();
    return this.emit(this.text.length);
  }
  emit(upto) {
    const out = this.text.slice(this.sent, upto);
    this.sent = upto;
    return out;
  }
}

// ---------------------------------------------------------------- a request

// req: prompt (text) or prompt_ids, max_tokens, temperature, top_k, top_p, repetition_penalty,
// seed; stop_ids replaces the bundle's (a benchmark passes [] to time a fixed length);
// return_logits: the prompt's last logits come back too.
async function generate(req) {
  const prompt = req.prompt_ids ?? tokenizer.encode(req.prompt).ids;
  const stops = req.stop_ids ?? spec.stop_ids;
  if (!prompt.length) throw new Error("the prompt has no tokens");
  if (prompt.length >= spec.context_length)
    throw new Error(`the prompt is ${prompt.length} tokens; the context holds ${spec.context_length}`);
  const p = {
    temperature: req.temperature ?? 0,
    top_k: req.top_k ?? 0,
    top_p: req.top_p ?? 1,
    repetition_penalty: req.repetition_penalty ?? 1,
  };
  const rand = mulberry32(req.seed ?? (Math.random() * 2 ** 32) >>> 0);
  const max = Math.min(req.max_tokens ?? 64, spec.context_length - prompt.length);
  const decode = (ids) => {
    const known = ids.filter((i) => i < vocabSize);
    return known.length ? tokenizer.decode(known, { skip_special_tokens: true }) : "";
  };
  const stream = new TextStream(decode, prompt.slice(-(spec.context_ids ?? 0)));
  const state = kernel ? { n: 0 } : { past: emptyPast(), n: 0 };
  const step = kernel ? kernelForward : forward;
  const seen = new Set(prompt);
  const ids = [];
  stopping = false;
  const t0 = performance.now();
  let logits = await step(state, prompt);
  const t1 = performance.now();
  const promptLogits = req.return_logits ? Array.from(logits) : undefined; // tests compare them
  let reason = "length";
  while (ids.length < max) {
    const id = sample(logits, p, rand, seen);
    if (stops.includes(id)) {
      reason = "stop";
      break;
    }
    ids.push(id);
    seen.add(id);
    const text = stream.push(id);
    if (text) post({ type: "text", text });
    if (stopping) {
      reason = "cancelled";
      break;
    }
    if (ids.length < max) logits = await step(state, [id]);
  }
  // "gpu-buffer" on WebGPU; the kernel keeps it in its own memory
  const cacheAt = kernel ? "kernel" : (Object.values(state.past)[0]?.location ?? null);
  if (!kernel) release(state.past);
  const rest = stream.finish();
  if (rest) post({ type: "text", text: rest });
  const t2 = performance.now();
  const steps = Math.max(ids.length - 1, 0); // runs after the prefill
  post({
    type: "done",
    prompt_ids: prompt,
    ids,
    text: stream.text,
    reason,
    prefill_ms: t1 - t0,
    decode_ms: t2 - t1,
    decode_tok_s: steps > 0 ? (1000 * steps) / (t2 - t1) : null,
    kv_cache_location: cacheAt,
    kernel_memory_bytes: kernel ? kernel.k.memory.buffer.byteLength : null,
    prompt_logits: promptLogits,
  });
}

self.onmessage = async (e) => {
  const msg = e.data;
  try {
    if (msg.type === "load")
      await load(msg.threads, msg.backend, msg.weights, msg.lowMemory, msg.simd);
    else if (msg.type === "encode")
      post({ type: "ids", ids: msg.texts.map((t) => tokenizer.encode(t).ids) });
    else if (msg.type === "generate") await generate(msg);
    else if (msg.type === "stop") stopping = true;
  } catch (err) {
    post({ type: "error", message: String(err && err.message ? err.message : err) });
  }
};
