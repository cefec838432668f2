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
static float eps, attn_scale;
static u8 *base;          // the graph's weights file, as copied in by the worker
static const u8 *W[G_N];  // global tensors
static const u8 **LW;     // per layer: LW[layer * L_N + k]
static float *x, *h, *qkv, *att, *gate, *up, *scores, *logits;
static i8 *aq;            // quantized activations [rows][K], each 32 split even/odd
static float *asc;        // their scales [rows][K / block]
static int *asum;         // the sum of each block's int8s [rows][K / block]
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
  aq = dk_alloc((usize)rows * widest);
  asc = dk_alloc(4 * (usize)rows * (widest / cfg[C_BLOCK] + 1));
  asum = dk_alloc(4 * (usize)rows * (widest / cfg[C_BLOCK] + 1));
  scores = dk_alloc(4 * (usize)cfg[C_ROPE_ROWS]);
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

static void rmsnorm(float *out, const float *in, const float *w, int n) {
  float ss = 0.f;
  for (int i = 0; i < n; i++) ss += in[i] * in[i];
  float k = 1.f / __builtin_sqrtf(ss / n + eps);
  for (int i = 0; i < n; i++) out[i] = in[i] * k * w[i];
}

// ------------------------------------------------------------------------------ matmuls

// Row r's K activations as int8, one scale a block of K (amax / 127), and each 32 stored as
// its 16 even then its 16 odd elements: the low and high nibbles of 16 bytes of 4-bit weights.
static void quantize(const float *a, int rows, int K, int split) {
  int bs = cfg[C_BLOCK], nb = K / bs;
  for (int r = 0; r < rows; r++) {
    const float *ar = a + (usize)r * K;
    i8 *qr = aq + (usize)r * K;
    for (int b = 0; b < nb; b++) {
      float amax = 0.f;
      for (int i = 0; i < bs; i++) {
        float v = __builtin_fabsf(ar[b * bs + i]);
        amax = v > amax ? v : amax;
      }
      float s = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
      int sum = 0;
      for (int i = 0; i < bs; i++) {
        int v = (int)__builtin_rintf(ar[b * bs + i] * inv);
        int k = b * bs + i, at = split ? (k & ~31) + ((k & 1) ? 16 : 0) + ((k & 31) >> 1) : k;
        qr[at] = (i8)v;
        sum += v;
      }
      asc[r * nb + b] = s;
      asum[r * nb + b] = sum;
    }
  }
}

static inline int hsum(v128_t v) {
  return wasm_i32x4_extract_lane(v, 0) + wasm_i32x4_extract_lane(v, 1) +
         wasm_i32x4_extract_lane(v, 2) + wasm_i32x4_extract_lane(v, 3);
}

#ifdef RELAXED
#define DOT8x7(a, w, acc) wasm_i32x4_relaxed_dot_i8x16_i7x16_add((a), (w), (acc))
#else
static inline v128_t DOT8x7(v128_t a, v128_t w, v128_t acc) {
  acc = wasm_i32x4_add(acc, wasm_i32x4_dot_i16x8(wasm_i16x8_extend_low_i8x16(a),
                                                 wasm_i16x8_extend_low_i8x16(w)));
  return wasm_i32x4_add(acc, wasm_i32x4_dot_i16x8(wasm_i16x8_extend_high_i8x16(a),
                                                  wasm_i16x8_extend_high_i8x16(w)));
}
#endif

// y[rows][N] = a[rows][K] W: MatMulNBits 4-bit weights [N][K/bs][bs/2] (zero point 8) and
// scales [N][K/bs]; a already quantized (split).
static void matmul4(float *y, int rows, int K, int N, const u8 *w, const float *s) {
  int bs = cfg[C_BLOCK], nb = K / bs;
  const v128_t lo = wasm_i8x16_splat(15);
  for (int n = 0; n < N; n++) {
    const u8 *wn = w + (usize)n * (K / 2);
    for (int r = 0; r < rows; r++) {
      const i8 *qr = aq + (usize)r * K;
      float total = 0.f;
      for (int b = 0; b < nb; b++) {
        v128_t acc = wasm_i32x4_splat(0);
        for (int i = 0; i < bs; i += 32) {
          v128_t wb = wasm_v128_load(wn + (b * bs + i) / 2);
          v128_t a0 = wasm_v128_load(qr + b * bs + i), a1 = wasm_v128_load(qr + b * bs + i + 16);
          acc = DOT8x7(a0, wasm_v128_and(wb, lo), acc);
          acc = DOT8x7(a1, wasm_u8x16_shr(wb, 4), acc);
        }
        int dot = hsum(acc) - 8 * asum[r * nb + b];
        total += s[n * nb + b] * asc[r * nb + b] * (float)dot;
      }
      y[(usize)r * N + n] = total;
    }
  }
}

// The same for 8-bit weights [N][K/bs][bs] (zero point 128): the lm_head's.
static void matmul8(float *y, int rows, int K, int N, const u8 *w, const float *s) {
  int bs = cfg[C_BLOCK], nb = K / bs;
  const v128_t zp = wasm_i8x16_splat((i8)0x80);
  for (int n = 0; n < N; n++) {
    const u8 *wn = w + (usize)n * K;
    for (int r = 0; r < rows; r++) {
      const i8 *qr = aq + (usize)r * K;
      float total = 0.f;
      for (int b = 0; b < nb; b++) {
        v128_t acc = wasm_i32x4_splat(0);
        for (int i = 0; i < bs; i += 16) {
          v128_t wb = wasm_v128_xor(wasm_v128_load(wn + b * bs + i), zp); // u8 - 128 as i8
          v128_t a = wasm_v128_load(qr + b * bs + i);
          acc = wasm_i32x4_add(acc, wasm_i32x4_dot_i16x8(wasm_i16x8_extend_low_i8x16(a),
                                                         wasm_i16x8_extend_low_i8x16(wb)));
          acc = wasm_i32x4_add(acc, wasm_i32x4_dot_i16x8(wasm_i16x8_extend_high_i8x16(a),
                                                         wasm_i16x8_extend_high_i8x16(wb)));
        }
        total += s[n * nb + b] * asc[r * nb + b] * (float)hsum(acc);
      }
      y[(usize)r * N + n] = total;
    }
  }
}

static void linear4(float *y, const float *a, int rows, int K, int N, const u8 *w, const u8 *s) {
  quantize(a, rows, K, 1);
  matmul4(y, rows, K, N, w, (const float *)s);
}

// 1 when matmul4 gives the integers' exact dot product on this engine: the worker loads the relaxed build only where this holds (an i8 x i7 dot whose
// operands an engine swapped would give other numbers).
__attribute__((export_name("dk_selftest"))) int dk_selftest(void) {
  static float a[256], s[1] = {1.f}, y[1], sc[1];
  static u8 w[128];
  static i8 q8[256];
  static int sm[1];
  i8 *keep_q = aq;
  float *keep_sc = asc;
  int *keep_sm = asum, bs = cfg[C_BLOCK];
  aq = q8, asc = sc, asum = sm, cfg[C_BLOCK] = 256; // callable before dk_init
  int want = 0;
  for (int k = 0; k < 256; k++) {
    int q = (k * 37) % 255 - 127, nib = (k * 11) % 16;
    a[k] = (float)q;
    w[k / 2] |= (u8)(nib << (4 * (k & 1)));
    want += q * (nib - 8);
  }
  quantize(a, 1, 256, 1); // amax 127: the scale is 1 and the integers are a's
  matmul4(y, 1, 256, 1, w, s);
  aq = keep_q, asc = keep_sc, asum = keep_sm, cfg[C_BLOCK] = bs;
  for (int i = 0; i < 128; i++) w[i] = 0;
  return y[0] == (float)want;
}

// One 4-bit linear layer alone, y[rows][N] = a[rows][K] W (benchmarks/probe_web_matmul.py
// times it beside onnxruntime-web's kernels); the activations' buffers must hold rows x K.
__attribute__((export_name("dk_linear"))) void dk_linear(float *y, const float *a, int rows,
                                                         int K, int N, const u8 *w,
                                                         const float *s, int block) {
  cfg[C_BLOCK] = block;
  if (!aq) {
    aq = dk_alloc((usize)rows * K);
    asc = dk_alloc(4 * (usize)rows * (K / block + 1));
    asum = dk_alloc(4 * (usize)rows * (K / block + 1));
  }
  quantize(a, rows, K, 1);
  matmul4(y, rows, K, N, w, s);
}

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

static float dot(const float *a, const float *b, int n) {
  v128_t acc = wasm_f32x4_splat(0.f);
  for (int i = 0; i < n; i += 4)
    acc = wasm_f32x4_add(acc, wasm_f32x4_mul(wasm_v128_load(a + i), wasm_v128_load(b + i)));
  return wasm_f32x4_extract_lane(acc, 0) + wasm_f32x4_extract_lane(acc, 1) +
         wasm_f32x4_extract_lane(acc, 2) + wasm_f32x4_extract_lane(acc, 3);
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
  for (int j = 0; j < nh; j++) {
    int g = j / group;
    float top = -3.4e38f, sum = 0.f;
    for (int t = 0; t <= p; t++) {
      scores[t] = dot(q + j * hd, KV_AT(t, layer, 0) + g * hd, hd) * attn_scale;
      top = scores[t] > top ? scores[t] : top;
    }
    for (int t = 0; t <= p; t++) sum += (scores[t] = expf_(scores[t] - top));
    float *o = att + (usize)r * nh * hd + j * hd;
    for (int i = 0; i < hd; i++) o[i] = 0.f;
    for (int t = 0; t <= p; t++) {
      const float *vt = KV_AT(t, layer, 1) + g * hd;
      float w = scores[t] / sum;
      for (int i = 0; i < hd; i++) o[i] += w * vt[i];
    }
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
    linear4(qkv, h, rows, d, nq, lw[L_QKV_W], lw[L_QKV_S]);
    for (int r = 0; r < rows; r++) attend(l, r, pos + r);
    linear4(h, att, rows, d, d, lw[L_O_W], lw[L_O_S]);
    for (int i = 0; i < rows * d; i++) x[i] += h[i];
    for (int r = 0; r < rows; r++) rmsnorm(h + r * d, x + r * d, (const float *)lw[L_LN2], d);
    quantize(h, rows, d, 1); // gate and up read the same activations
    matmul4(gate, rows, d, f, lw[L_G_W], (const float *)lw[L_G_S]);
    matmul4(up, rows, d, f, lw[L_U_W], (const float *)lw[L_U_S]);
    for (int i = 0; i < rows * f; i++) gate[i] = gate[i] / (1.f + expf_(-gate[i])) * up[i];
    linear4(h, gate, rows, f, d, lw[L_D_W], lw[L_D_S]);
    for (int i = 0; i < rows * d; i++) x[i] += h[i];
  }
  rmsnorm(h, x + (usize)(rows - 1) * d, (const float *)W[G_NORM], d);
  quantize(h, 1, d, cfg[C_LM_BITS] == 4);
  if (cfg[C_LM_BITS] == 4)
    matmul4(logits, 1, d, cfg[C_VOCAB], W[G_LM_W], (const float *)W[G_LM_S]);
  else
    matmul8(logits, 1, d, cfg[C_VOCAB], W[G_LM_W], (const float *)W[G_LM_S]);
  return logits;
}
