// doel's WebAssembly decoder: the bundle's own int4 graph (the Llama shape ONNX Runtime's model
// builder writes: fused QKV, GroupQueryAttention with rotary, SwiGLU, RMSNorm) run from its own
// weights, which stay 4 bits in memory. onnxruntime-web's WebAssembly MatMulNBits is 10-130x an
// fp32 MatMul (benchmarks/results/web_probe_cpu-*.md); here a 4-bit block is a few SIMD
// instructions: activations are quantized to int8 per block of K (as MatMulNBits' accuracy
// level 4 does natively) and each 16 bytes of weights meet them in two integer dot products.
// RELAXED builds use relaxed SIMD's i8 x i7 dot (one instruction on VNNI CPUs); without it the
// int8s are widened to int16 (plain SIMD, every WebAssembly browser).
//
// Built by export/web_kernel.py (zig cc, wasm32, freestanding): no libc, one bump allocator.
// The worker (export/web/worker.js) copies the graph's weights in, gives dk_init their offsets
// and calls dk_forward a chunk of tokens at a time; the KV cache grows at the end of memory.
#include <wasm_simd128.h>

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned long usize;

// Activations are stored as the dot product wants them: int8 for relaxed SIMD's i8 x i7 dot,
// already widened to int16 for plain SIMD (widened once here, not once per weight row).
#ifdef RELAXED
typedef i8 act_t;
#else
typedef short act_t;
#endif
#define TR 8 // activation rows whose scales lie side by side (AT)
#ifdef RELAXED // prefill's tile (rows_tile): activation rows by weight rows
#define RT 4
#define CT 2
#else
#define RT 8
#define CT 1
#endif
// Decode streams its weights from memory once a token: it also reads a byte of each row's cache
// line this far ahead (4-bit rows; the lm_head's 8-bit): 15-25% faster decode in Chromium (tried
// 512-4096 bytes).
#define AHEAD 768
#define AHEAD8 4096
static volatile int sink;
static inline const u8 *near(const u8 *p, const u8 *end) { return p < end ? p : end; }

extern u8 __heap_base;
static usize top; // the bump allocator's end

__attribute__((export_name("dk_alloc"))) void *dk_alloc(usize n) {
  if (!top) top = (usize)&__heap_base;
  usize at = (top + 63) & ~(usize)63, end = at + n;
  usize have = __builtin_wasm_memory_size(0) * 65536;
  if (end > have && __builtin_wasm_memory_grow(0, (end - have + 65535) / 65536) == (usize)-1)
    return 0;
  top = end;
  return (void *)at;
}

// ------------------------------------------------------------------------------ the model

enum { L_LN1, L_QKV_W, L_QKV_S, L_O_W, L_O_S, L_LN2, L_G_W, L_G_S, L_U_W, L_U_S, L_D_W, L_D_S,
       L_N };
enum { G_EMB_Q, G_EMB_S, G_NORM, G_LM_W, G_LM_S, G_COS, G_SIN, G_N };
enum { C_LAYERS, C_D, C_HEADS, C_KV_HEADS, C_HEAD_DIM, C_FFN, C_VOCAB, C_BLOCK, C_ROPE_ROWS,
       C_MAX_ROWS, C_LM_BITS, C_N };

static int cfg[C_N];
static int *eight;        // per layer: which of its matrices are 8-bit (E_QKV | E_O | E_DOWN)
enum { E_QKV = 1, E_O = 2, E_DOWN = 4 };
static float eps, attn_scale;
static u8 *base;          // the graph's weights file, as copied in by the worker
static const u8 *W[G_N];  // global tensors
static const u8 **LW;     // per layer: LW[layer * L_N + k]
static float *x, *h, *qkv, *att, *gate, *up, *scores, *logits;
static act_t *aq;         // quantized activations [rows][K], each 32 split even/odd
static float *asc;        // their scales, at AT(row, block): TR rows' side by side
static int *asum;         // 8 x the sum of each block's integers, at AT(row, block)
#define AT(r, b) (((r) / TR * nb + (b)) * TR + (r) % TR)
static float *kv;         // [position][layer][k|v][kv_dim], grown at the end of memory
static int kv_cap;

#define KVD (cfg[C_KV_HEADS] * cfg[C_HEAD_DIM])
#define KV_AT(pos, layer, which) (kv + ((usize)(pos) * cfg[C_LAYERS] * 2 + (layer) * 2 + (which)) * KVD)

// offsets: G_N global then L_N per layer, bytes into the weights file; fcfg: eps, attn scale
__attribute__((export_name("dk_init"))) int dk_init(u8 *weights, const int *c, const float *fcfg,
                                                    const unsigned *offsets) {
  for (int i = 0; i < C_N; i++) cfg[i] = c[i];
  eps = fcfg[0];
  attn_scale = fcfg[1];
  base = weights;
  for (int i = 0; i < G_N; i++) W[i] = base + offsets[i];
  eight = dk_alloc(sizeof(int) * cfg[C_LAYERS]); // after the C_N numbers: one a layer
  for (int l = 0; l < cfg[C_LAYERS]; l++) eight[l] = c[C_N + l];
  LW = dk_alloc(sizeof(u8 *) * cfg[C_LAYERS] * L_N);
  for (int i = 0; i < cfg[C_LAYERS] * L_N; i++) LW[i] = base + offsets[G_N + i];
  int rows = cfg[C_MAX_ROWS], d = cfg[C_D], f = cfg[C_FFN];
  int q = (cfg[C_HEADS] + 2 * cfg[C_KV_HEADS]) * cfg[C_HEAD_DIM];
  int widest = f > d ? f : d;
  x = dk_alloc(4 * (usize)rows * d);
  h = dk_alloc(4 * (usize)rows * d);
  qkv = dk_alloc(4 * (usize)rows * q);
  att = dk_alloc(4 * (usize)rows * d);
  gate = dk_alloc(4 * (usize)rows * f);
  up = dk_alloc(4 * (usize)rows * f);
  aq = dk_alloc(sizeof(act_t) * rows * widest);
  asc = dk_alloc(4 * (usize)rows * (widest / cfg[C_BLOCK] + 1));
  asum = dk_alloc(4 * (usize)rows * (widest / cfg[C_BLOCK] + 1));
  scores = dk_alloc(4 * 4 * (usize)cfg[C_ROPE_ROWS]); // four heads' at once
  logits = dk_alloc(4 * (usize)cfg[C_VOCAB]);
  kv = dk_alloc(0); // nothing is allocated after it (the worker allocates first)
  kv_cap = 0;
  return logits && kv ? 0 : -1;
}

// ------------------------------------------------------------------------------ scalar math

static float expf_(float v) { // e^v to ~1 ulp: 2^n * e^r, |r| <= ln2/2, a degree-6 polynomial
  if (v < -87.f) return 0.f;
  if (v > 88.f) v = 88.f;
  float n = __builtin_floorf(v * 1.44269504f + 0.5f);
  float r = v - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.f + r * (1.f + r * (0.5f + r * (0.166666672f + r * (4.16666791e-2f +
            r * (8.33333358e-3f + r * 1.38888892e-3f)))));
  union { float f; int i; } u = {p};
  u.i += (int)n << 23;
  return u.f;
}

// expf_ on four lanes, the same operations unfused (as scalar WebAssembly computes expf_): the
// same bits as four calls.
static v128_t expf4(v128_t v) {
  v128_t low = wasm_f32x4_lt(v, wasm_f32x4_splat(-87.f));
  v = wasm_f32x4_min(v, wasm_f32x4_splat(88.f));
#define MA(a, b, c) wasm_f32x4_add(wasm_f32x4_mul((a), (b)), (c))
  v128_t n = wasm_f32x4_floor(MA(v, wasm_f32x4_splat(1.44269504f), wasm_f32x4_splat(0.5f)));
  v128_t r = wasm_f32x4_sub(v, wasm_f32x4_mul(n, wasm_f32x4_splat(0.693359375f)));
  r = MA(n, wasm_f32x4_splat(2.12194440e-4f), r);
  v128_t p = MA(r, wasm_f32x4_splat(1.38888892e-3f), wasm_f32x4_splat(8.33333358e-3f));
  p = MA(r, p, wasm_f32x4_splat(4.16666791e-2f));
  p = MA(r, p, wasm_f32x4_splat(0.166666672f));
  p = MA(r, p, wasm_f32x4_splat(0.5f));
  p = MA(r, p, wasm_f32x4_splat(1.f));
  p = MA(r, p, wasm_f32x4_splat(1.f));
#undef MA
  p = wasm_i32x4_add(p, wasm_i32x4_shl(wasm_i32x4_trunc_sat_f32x4(n), 23));
  return wasm_v128_andnot(p, low);
}

static void rmsnorm(float *out, const float *in, const float *w, int n) {
  float ss = 0.f;
  for (int i = 0; i < n; i++) ss += in[i] * in[i];
  float k = 1.f / __builtin_sqrtf(ss / n + eps);
  for (int i = 0; i < n; i++) out[i] = in[i] * k * w[i];
}

#include "kernel_matmul.h" // quantize, matmul4, matmul8, linear4, dk_selftest, dk_linear

// ------------------------------------------------------------------------------ attention

// Rotate-half rotary (GroupQueryAttention's do_rotary, not interleaved) of one head at `pos`.
static void rope(float *v, int pos) {
  int half = cfg[C_HEAD_DIM] / 2;
  const float *c = (const float *)W[G_COS] + (usize)pos * half;
  const float *s = (const float *)W[G_SIN] + (usize)pos * half;
  for (int i = 0; i < half; i++) {
    float a = v[i], b = v[i + half];
    v[i] = a * c[i] - b * s[i];
    v[i + half] = b * c[i] + a * s[i];
  }
}

// Heads j..j+3 of one kv head g (a head index past the group repeats the last: its lanes are
// computed and dropped): their causal softmax attention over positions 0..p into out. The four
// share each cached key's and value's loads, four dot products in flight; each head's numbers
// come out as one head at a time gives them (the same sums in the same order).
static void attend4(int layer, const float *q, const int *j, int m, int g, int p, float *out) {
  int hd = cfg[C_HEAD_DIM], rows = cfg[C_ROPE_ROWS];
  float top[4] = {-3.4e38f, -3.4e38f, -3.4e38f, -3.4e38f}, sum[4] = {0.f, 0.f, 0.f, 0.f};
  for (int t = 0; t <= p; t++) {
    const float *kt = KV_AT(t, layer, 0) + g * hd;
    v128_t acc[4] = {wasm_f32x4_splat(0.f), wasm_f32x4_splat(0.f), wasm_f32x4_splat(0.f),
                     wasm_f32x4_splat(0.f)};
    for (int i = 0; i < hd; i += 4) {
      v128_t k4 = wasm_v128_load(kt + i);
      for (int c = 0; c < 4; c++)
        acc[c] = wasm_f32x4_add(acc[c], wasm_f32x4_mul(wasm_v128_load(q + j[c] * hd + i), k4));
    }
    for (int c = 0; c < m; c++) {
      float s = (wasm_f32x4_extract_lane(acc[c], 0) + wasm_f32x4_extract_lane(acc[c], 1) +
                 wasm_f32x4_extract_lane(acc[c], 2) + wasm_f32x4_extract_lane(acc[c], 3)) *
                attn_scale;
      scores[c * rows + t] = s;
      top[c] = s > top[c] ? s : top[c];
    }
  }
  for (int c = 0; c < m; c++) {
    float *sc = scores + c * rows;
    int t = 0;
    for (; t + 4 <= p + 1; t += 4)
      wasm_v128_store(sc + t, expf4(wasm_f32x4_sub(wasm_v128_load(sc + t), wasm_f32x4_splat(top[c]))));
    for (; t <= p; t++) sc[t] = expf_(sc[t] - top[c]);
    for (t = 0; t <= p; t++) sum[c] += sc[t];
    for (int t = 0; t <= p; t++) sc[t] = sc[t] / sum[c];
  }
  for (int c = m; c < 4; c++) // the repeated head's weights: any numbers, its output is dropped
    for (int t = 0; t <= p; t++) scores[c * rows + t] = 0.f;
  for (int i = 0; i < hd; i += 8) { // 8 of head_dim at a time: 4 heads x 2 vectors in registers
    v128_t o[8];
    for (int c = 0; c < 8; c++) o[c] = wasm_f32x4_splat(0.f);
    for (int t = 0; t <= p; t++) {
      const float *vt = KV_AT(t, layer, 1) + g * hd + i;
      v128_t v0 = wasm_v128_load(vt), v1 = wasm_v128_load(vt + 4);
      for (int c = 0; c < 4; c++) {
        v128_t w = wasm_f32x4_splat(scores[c * rows + t]);
        o[2 * c] = MADD(w, v0, o[2 * c]), o[2 * c + 1] = MADD(w, v1, o[2 * c + 1]);
      }
    }
    for (int c = 0; c < m; c++) {
      wasm_v128_store(out + j[c] * hd + i, o[2 * c]);
      wasm_v128_store(out + j[c] * hd + i + 4, o[2 * c + 1]);
    }
  }
}

// Row r (at position p) of the layer: q, k, v from qkv; k and v into the cache; causal softmax
// attention of each head over positions 0..p into att.
static void attend(int layer, int r, int p) {
  int hd = cfg[C_HEAD_DIM], nh = cfg[C_HEADS], nkv = cfg[C_KV_HEADS], group = nh / nkv;
  float *q = qkv + (usize)r * (nh + 2 * nkv) * hd, *k = q + nh * hd, *v = k + nkv * hd;
  for (int j = 0; j < nh; j++) rope(q + j * hd, p);
  for (int j = 0; j < nkv; j++) rope(k + j * hd, p);
  float *kc = KV_AT(p, layer, 0), *vc = KV_AT(p, layer, 1);
  for (int i = 0; i < nkv * hd; i++) kc[i] = k[i], vc[i] = v[i];
  for (int g = 0; g < nkv; g++)
    for (int j0 = g * group; j0 < (g + 1) * group; j0 += 4) {
      int m = (g + 1) * group - j0 < 4 ? (g + 1) * group - j0 : 4, j[4];
      for (int c = 0; c < 4; c++) j[c] = j0 + (c < m ? c : m - 1);
      attend4(layer, q, j, m, g, p, att + (usize)r * nh * hd);
    }
}

// ------------------------------------------------------------------------------ a forward

// `rows` tokens at positions pos..pos+rows-1 (rows <= max rows); returns the last one's logits
// (vocab floats), or 0 when the cache cannot grow (out of memory) or pos is past the rotary table.
__attribute__((export_name("dk_forward"))) float *dk_forward(const int *ids, int rows, int pos) {
  int d = cfg[C_D], f = cfg[C_FFN], L = cfg[C_LAYERS], bs = cfg[C_BLOCK];
  int nq = (cfg[C_HEADS] + 2 * cfg[C_KV_HEADS]) * cfg[C_HEAD_DIM];
  if (rows < 1 || rows > cfg[C_MAX_ROWS] || pos + rows > cfg[C_ROPE_ROWS]) return 0;
  if (pos + rows > kv_cap) { // the cache is the last allocation: it grows in place
    int cap = pos + rows + 255;
    usize end = (usize)kv + (usize)cap * L * 2 * KVD * 4;
    if (end > top && !dk_alloc(end - top)) return 0;
    kv_cap = cap;
  }
  for (int r = 0; r < rows; r++) { // GatherBlockQuantized: 8 bits, zero point 128
    const u8 *e = W[G_EMB_Q] + (usize)ids[r] * d;
    const float *es = (const float *)W[G_EMB_S] + (usize)ids[r] * (d / bs);
    for (int i = 0; i < d; i++) x[r * d + i] = (float)((int)e[i] - 128) * es[i / bs];
  }
  for (int l = 0; l < L; l++) {
    const u8 **lw = LW + l * L_N;
    for (int r = 0; r < rows; r++) rmsnorm(h + r * d, x + r * d, (const float *)lw[L_LN1], d);
    linear(qkv, h, rows, d, nq, lw[L_QKV_W], lw[L_QKV_S], eight[l] & E_QKV);
    for (int r = 0; r < rows; r++) attend(l, r, pos + r);
    linear(h, att, rows, d, d, lw[L_O_W], lw[L_O_S], eight[l] & E_O);
    for (int i = 0; i < rows * d; i++) x[i] += h[i];
    for (int r = 0; r < rows; r++) rmsnorm(h + r * d, x + r * d, (const float *)lw[L_LN2], d);
    quantize(h, rows, d, 1); // gate and up read the same activations
    matmul4(gate, rows, d, f, lw[L_G_W], (const float *)lw[L_G_S]);
    matmul4(up, rows, d, f, lw[L_U_W], (const float *)lw[L_U_S]);
    for (int i = 0; i < rows * f; i++) gate[i] = gate[i] / (1.f + expf_(-gate[i])) * up[i];
    linear(h, gate, rows, f, d, lw[L_D_W], lw[L_D_S], eight[l] & E_DOWN);
    for (int i = 0; i < rows * d; i++) x[i] += h[i];
  }
  rmsnorm(h, x + (usize)(rows - 1) * d, (const float *)W[G_NORM], d);
  quantize(h, 1, d, cfg[C_LM_BITS] == 4 || SPLIT8); // the order matmul8 reads
  if (cfg[C_LM_BITS] == 4)
    matmul4(logits, 1, d, cfg[C_VOCAB], W[G_LM_W], (const float *)W[G_LM_S]);
  else
    matmul8(logits, 1, d, cfg[C_VOCAB], W[G_LM_W], (const float *)W[G_LM_S]);
  return logits;
}
