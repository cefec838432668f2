// kernel.c's matrix products (included once by kernel.c, after its model state: one
// translation unit, so the compiler inlines across both files as before the split): the
// activations' int8 quantization, the 4-bit and 8-bit matmuls in tiles (prefill: several
// activation rows a weight row; decode: several weight rows an activation row), dk_selftest and
// dk_linear. Read kernel.c first.

// ------------------------------------------------------------------------------ matmuls

static inline int hsum(v128_t v) {
  return wasm_i32x4_extract_lane(v, 0) + wasm_i32x4_extract_lane(v, 1) +
         wasm_i32x4_extract_lane(v, 2) + wasm_i32x4_extract_lane(v, 3);
}

// Row r's K activations as integers, one scale a block of K (amax / 127), and each 32 stored as
// its 16 even then its 16 odd elements (split): the low and high nibbles of 16 bytes of 4-bit
// weights. rint and f32x4.nearest both round half to even: the integers are the scalar ones.
static void quantize(const float *a, int rows, int K, int split) {
  int bs = cfg[C_BLOCK], nb = K / bs;
  for (int r = 0; r < rows; r++) {
    const float *ar = a + (usize)r * K;
    act_t *qr = aq + (usize)r * K;
    for (int b = 0; b < nb; b++) {
      const float *ab = ar + b * bs;
      v128_t m = wasm_f32x4_splat(0.f);
      for (int i = 0; i < bs; i += 4) m = wasm_f32x4_max(m, wasm_f32x4_abs(wasm_v128_load(ab + i)));
      m = wasm_f32x4_max(m, wasm_i32x4_shuffle(m, m, 2, 3, 0, 1));
      m = wasm_f32x4_max(m, wasm_i32x4_shuffle(m, m, 1, 0, 3, 2));
      float amax = wasm_f32x4_extract_lane(m, 0);
      float s = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
      v128_t vi = wasm_f32x4_splat(inv), sum = wasm_i32x4_splat(0);
      for (int i = 0; i < bs; i += 32) {
        v128_t h[4]; // elements i..i+31 as four int16x8
        for (int j = 0; j < 4; j++) {
          v128_t lo = wasm_i32x4_trunc_sat_f32x4(
              wasm_f32x4_nearest(wasm_f32x4_mul(wasm_v128_load(ab + i + 8 * j), vi)));
          v128_t hi = wasm_i32x4_trunc_sat_f32x4(
              wasm_f32x4_nearest(wasm_f32x4_mul(wasm_v128_load(ab + i + 8 * j + 4), vi)));
          sum = wasm_i32x4_add(sum, wasm_i32x4_add(lo, hi));
          h[j] = wasm_i16x8_narrow_i32x4(lo, hi);
        }
        if (split) { // evens of 0..15, of 16..31, odds of 0..15, of 16..31
          v128_t e0 = wasm_i16x8_shuffle(h[0], h[1], 0, 2, 4, 6, 8, 10, 12, 14);
          v128_t e1 = wasm_i16x8_shuffle(h[2], h[3], 0, 2, 4, 6, 8, 10, 12, 14);
          v128_t o0 = wasm_i16x8_shuffle(h[0], h[1], 1, 3, 5, 7, 9, 11, 13, 15);
          v128_t o1 = wasm_i16x8_shuffle(h[2], h[3], 1, 3, 5, 7, 9, 11, 13, 15);
          h[0] = e0, h[1] = e1, h[2] = o0, h[3] = o1;
        }
#ifdef RELAXED
        wasm_v128_store(qr + b * bs + i, wasm_i8x16_narrow_i16x8(h[0], h[1]));
        wasm_v128_store(qr + b * bs + i + 16, wasm_i8x16_narrow_i16x8(h[2], h[3]));
#else
        for (int j = 0; j < 4; j++) wasm_v128_store(qr + b * bs + i + 8 * j, h[j]);
#endif
      }
      asc[AT(r, b)] = s;
      asum[AT(r, b)] = 8 * hsum(sum); // the 4-bit zero point's share of the dot product
    }
  }
}

// 16 bytes of 4-bit weights (32 of them, zero point not taken off) as the dot product wants
// them: the low nibbles (even elements) and high ones (odd), plain SIMD's widened to int16.
#ifdef RELAXED
#define NW 2
#define DOT8x7(a, w, acc) wasm_i32x4_relaxed_dot_i8x16_i7x16_add((a), (w), (acc))
// clang makes `o += w * v` one relaxed madd where it vectorizes it in this build: so here too
#define MADD(a, b, c) wasm_f32x4_relaxed_madd((a), (b), (c))
#define SPLIT8 0
#else
#define NW 4
#define MADD(a, b, c) wasm_f32x4_add(wasm_f32x4_mul((a), (b)), (c))
#define SPLIT8 1
#endif
typedef struct { v128_t v[NW]; } wq;

static inline wq unpack4(const u8 *p) {
  const v128_t lo = wasm_i8x16_splat(15);
  v128_t wb = wasm_v128_load(p);
  v128_t e = wasm_v128_and(wb, lo), o = wasm_v128_and(wasm_u16x8_shr(wb, 4), lo);
#ifdef RELAXED
  return (wq){{e, o}};
#else
  return (wq){{wasm_u16x8_extend_low_u8x16(e), wasm_u16x8_extend_high_u8x16(e),
               wasm_u16x8_extend_low_u8x16(o), wasm_u16x8_extend_high_u8x16(o)}};
#endif
}

// acc + the dot product of 32 split activations and 32 unpacked weights, exact in int32
static inline v128_t dot32(const act_t *a, wq w, v128_t acc) {
#ifdef RELAXED
  acc = DOT8x7(wasm_v128_load(a), w.v[0], acc);
  return DOT8x7(wasm_v128_load(a + 16), w.v[1], acc);
#else
  for (int j = 0; j < 4; j++)
    acc = wasm_i32x4_add(acc, wasm_i32x4_dot_i16x8(wasm_v128_load(a + 8 * j), w.v[j]));
  return acc;
#endif
}

// [hsum(a), hsum(b), hsum(c), hsum(d)]
static inline v128_t hsum4(v128_t a, v128_t b, v128_t c, v128_t d) {
  v128_t ab = wasm_i32x4_add(wasm_i32x4_shuffle(a, b, 0, 4, 1, 5), wasm_i32x4_shuffle(a, b, 2, 6, 3, 7));
  v128_t cd = wasm_i32x4_add(wasm_i32x4_shuffle(c, d, 0, 4, 1, 5), wasm_i32x4_shuffle(c, d, 2, 6, 3, 7));
  return wasm_i32x4_add(wasm_i32x4_shuffle(ab, cd, 0, 1, 4, 5), wasm_i32x4_shuffle(ab, cd, 2, 3, 6, 7));
}

// Each block's float step is the scalar one, total += (s * asc) * (float)dot, a lane at a time:
// the tiles below give the same bits as one row and one column at a time.
#define STEP(total, sv, av, dot) \
  total = wasm_f32x4_add(total, wasm_f32x4_mul(wasm_f32x4_mul(sv, av), wasm_f32x4_convert_i32x4(dot)))

// Prefill: activation rows r..r+RT-1 against weight rows n..n+CT-1; each 16 bytes of weights is
// unpacked once for RT rows, each activation loaded once for CT weight rows. 8 x 1 with plain
// SIMD (4 registers a widened weight), 4 x 2 with relaxed SIMD (6% faster there, 8% slower here).
static void rows_tile(float *y, int r, int n, int K, int N, const u8 *w, const float *s) {
  int bs = cfg[C_BLOCK], nb = K / bs, kb = K / 2;
  const u8 *wn = w + (usize)n * kb;
  const act_t *q = aq + (usize)r * K;
  const float *c = asc + AT(r - r % TR, 0) + r % TR;
  const int *z = asum + AT(r - r % TR, 0) + r % TR;
  v128_t total[CT][RT / 4];
  for (int k = 0; k < CT; k++)
    for (int g = 0; g < RT / 4; g++) total[k][g] = wasm_f32x4_splat(0.f);
  for (int b = 0; b < nb; b++) {
    v128_t acc[CT][RT];
    for (int k = 0; k < CT; k++)
      for (int j = 0; j < RT; j++) acc[k][j] = wasm_i32x4_splat(0);
    for (int i = b * bs; i < (b + 1) * bs; i += 32) {
      wq u[CT];
      for (int k = 0; k < CT; k++) u[k] = unpack4(wn + k * kb + i / 2);
      for (int j = 0; j < RT; j++)
        for (int k = 0; k < CT; k++) acc[k][j] = dot32(q + (usize)j * K + i, u[k], acc[k][j]);
    }
    for (int g = 0; g < RT / 4; g++) {
      v128_t zp = wasm_v128_load(z + b * TR + 4 * g), sc = wasm_v128_load(c + b * TR + 4 * g);
      for (int k = 0; k < CT; k++) {
        v128_t *a = acc[k] + 4 * g;
        v128_t dot = wasm_i32x4_sub(hsum4(a[0], a[1], a[2], a[3]), zp);
        STEP(total[k][g], wasm_f32x4_splat(s[(n + k) * nb + b]), sc, dot);
      }
    }
  }
  for (int k = 0; k < CT; k++)
    for (int j = 0; j < RT; j++) y[(usize)(r + j) * N + n + k] = ((float *)&total[k][j / 4])[j % 4];
}

// Decode: activation row r against weight rows n..n+3; the activations are loaded once for four.
static void cols4(float *y, int r, int n, int K, int N, const u8 *w, const float *s) {
  int bs = cfg[C_BLOCK], nb = K / bs, kb = K / 2;
  const u8 *w0 = w + (usize)n * kb;
  const act_t *q = aq + (usize)r * K;
  v128_t total = wasm_f32x4_splat(0.f);
  int touch = 0; // (WebAssembly has no prefetch: loads whose sum goes to a volatile)
  const u8 *end = w + (usize)N * kb - 1;
  for (int b = 0; b < nb; b++) {
    v128_t a0 = wasm_i32x4_splat(0), a1 = a0, a2 = a0, a3 = a0;
    for (int i = b * bs; i < (b + 1) * bs; i += 32) {
      if ((i & 127) == 0) // a byte of each row's cache line AHEAD bytes on (not past W's end)
        for (int j = 0; j < 4; j++) touch += *near(w0 + j * kb + i / 2 + AHEAD, end);
      a0 = dot32(q + i, unpack4(w0 + i / 2), a0);
      a1 = dot32(q + i, unpack4(w0 + kb + i / 2), a1);
      a2 = dot32(q + i, unpack4(w0 + 2 * kb + i / 2), a2);
      a3 = dot32(q + i, unpack4(w0 + 3 * kb + i / 2), a3);
    }
    v128_t dot = wasm_i32x4_sub(hsum4(a0, a1, a2, a3), wasm_i32x4_splat(asum[AT(r, b)]));
    const float *sb = s + n * nb + b;
    STEP(total, wasm_f32x4_make(sb[0], sb[nb], sb[2 * nb], sb[3 * nb]),
         wasm_f32x4_splat(asc[AT(r, b)]), dot);
  }
  wasm_v128_store(y + (usize)r * N + n, total);
  sink = touch;
}

// One activation row against one weight row (what the tiles leave over).
static void one(float *y, int r, int n, int K, int N, const u8 *w, const float *s) {
  int bs = cfg[C_BLOCK], nb = K / bs;
  const u8 *wn = w + (usize)n * (K / 2);
  const act_t *q = aq + (usize)r * K;
  float total = 0.f;
  for (int b = 0; b < nb; b++) {
    v128_t acc = wasm_i32x4_splat(0);
    for (int i = b * bs; i < (b + 1) * bs; i += 32) acc = dot32(q + i, unpack4(wn + i / 2), acc);
    int dot = hsum(acc) - asum[AT(r, b)];
    total += s[n * nb + b] * asc[AT(r, b)] * (float)dot;
  }
  y[(usize)r * N + n] = total;
}

// y[rows][N] = a[rows][K] W: MatMulNBits 4-bit weights [N][K/bs][bs/2] (zero point 8) and
// scales [N][K/bs]; a already quantized (split). Weight rows go in groups of 8, so that a
// group's 8 x K/2 bytes stay in cache while every RT activation rows meet them.
static void matmul4(float *y, int rows, int K, int N, const u8 *w, const float *s) {
  int rt = rows - rows % RT, nt = N - N % CT;
  for (int n0 = 0; n0 < nt && rt; n0 += 8)
    for (int r = 0; r < rt; r += RT)
      for (int n = n0; n < n0 + 8 && n < nt; n += CT) rows_tile(y, r, n, K, N, w, s);
  for (int n = nt; n < N; n++) // a weight row the tiles leave over
    for (int r = 0; r < rt; r++) one(y, r, n, K, N, w, s);
  for (int r = rt; r < rows; r++) {
    int n = 0;
    for (; n + 4 <= N; n += 4) cols4(y, r, n, K, N, w, s);
    for (; n < N; n++) one(y, r, n, K, N, w, s);
  }
}

// The same for 8-bit weights [N][K/bs][bs] (zero point 128: its share is 16 x asum), the
// lm_head's: one activation row against four weight rows at a time. Relaxed SIMD takes a byte
// as its low 7 bits plus 128 x its top bit (two i8 x i7 dots; activations not split); plain
// SIMD takes the 16-bit lanes' low and high bytes (activations split: evens, then odds).
static inline v128_t dot32x8(const act_t *a, const u8 *w, v128_t acc) {
#ifdef RELAXED
  const v128_t low7 = wasm_i8x16_splat(127), one = wasm_i8x16_splat(1);
  v128_t lo = wasm_i32x4_splat(0), hi = lo;
  for (int h = 0; h < 32; h += 16) {
    v128_t wb = wasm_v128_load(w + h), qa = wasm_v128_load(a + h);
    lo = DOT8x7(qa, wasm_v128_and(wb, low7), lo);
    hi = DOT8x7(qa, wasm_v128_and(wasm_u16x8_shr(wb, 7), one), hi);
  }
  return wasm_i32x4_add(acc, wasm_i32x4_add(lo, wasm_i32x4_shl(hi, 7)));
#else
  const v128_t byte = wasm_i16x8_splat(255);
  v128_t w0 = wasm_v128_load(w), w1 = wasm_v128_load(w + 16);
  acc = wasm_i32x4_add(acc, wasm_i32x4_dot_i16x8(wasm_v128_load(a), wasm_v128_and(w0, byte)));
  acc = wasm_i32x4_add(acc, wasm_i32x4_dot_i16x8(wasm_v128_load(a + 8), wasm_v128_and(w1, byte)));
  acc = wasm_i32x4_add(acc, wasm_i32x4_dot_i16x8(wasm_v128_load(a + 16), wasm_u16x8_shr(w0, 8)));
  return wasm_i32x4_add(acc, wasm_i32x4_dot_i16x8(wasm_v128_load(a + 24), wasm_u16x8_shr(w1, 8)));
#endif
}

static void matmul8(float *y, int rows, int K, int N, const u8 *w, const float *s) {
  int bs = cfg[C_BLOCK], nb = K / bs;
  for (int r = 0; r < rows; r++) {
    const act_t *q = aq + (usize)r * K;
    for (int n = 0; n < N; n += 4) {
      int m = N - n < 4 ? N - n : 4, nj[4]; // rows past N repeat the last (lanes dropped)
      for (int j = 0; j < 4; j++) nj[j] = j < m ? n + j : n + m - 1;
      v128_t total = wasm_f32x4_splat(0.f);
      int touch = 0;
      const u8 *end = w + (usize)N * K - 1;
      for (int b = 0; b < nb; b++) {
        v128_t acc[4];
        for (int j = 0; j < 4; j++) acc[j] = wasm_i32x4_splat(0);
        for (int i = b * bs; i < (b + 1) * bs; i += 32) {
          if ((i & 63) == 0) // as cols4 does
            for (int j = 0; j < 4; j++) touch += *near(w + (usize)nj[j] * K + i + AHEAD8, end);
          for (int j = 0; j < 4; j++) acc[j] = dot32x8(q + i, w + (usize)nj[j] * K + i, acc[j]);
        }
        v128_t dot = wasm_i32x4_sub(hsum4(acc[0], acc[1], acc[2], acc[3]),
                                    wasm_i32x4_splat(16 * asum[AT(r, b)]));
        v128_t sv = wasm_f32x4_make(s[nj[0] * nb + b], s[nj[1] * nb + b], s[nj[2] * nb + b],
                                    s[nj[3] * nb + b]);
        STEP(total, sv, wasm_f32x4_splat(asc[AT(r, b)]), dot);
      }
      for (int j = 0; j < m; j++) y[(usize)r * N + n + j] = ((float *)&total)[j];
      sink = touch;
    }
  }
}

static void linear4(float *y, const float *a, int rows, int K, int N, const u8 *w, const u8 *s) {
  quantize(a, rows, K, 1);
  matmul4(y, rows, K, N, w, (const float *)s);
}

// A matrix of the body at 4 bits, or at 8 where the export kept it finer (llama.cpp's mixed
// placement: QKV and down of some layers): the lm_head's 8-bit path, a row at a time.
static void linear(float *y, const float *a, int rows, int K, int N, const u8 *w, const u8 *s,
                   int eight_bit) {
  if (!eight_bit) {
    linear4(y, a, rows, K, N, w, s);
  } else {
    quantize(a, rows, K, SPLIT8);
    matmul8(y, rows, K, N, w, (const float *)s);
  }
}

// 1 when the matmuls give the integers' exact dot products on this engine (4-bit weights through
// decode's tile, every byte value through the lm_head's 8-bit path): the worker loads the relaxed
// build only where this holds (an i8 x i7 dot whose operands an engine swapped, or whose 7-bit
// operand it read as signed, would give other numbers).
__attribute__((export_name("dk_selftest"))) int dk_selftest(void) {
  static float a[256], s[4] = {1.f, 1.f, 1.f, 1.f}, y[4], sc[1];
  static u8 w[4 * 128], w8[256];
  static act_t q8[256];
  static int sm[1];
  act_t *keep_q = aq;
  float *keep_sc = asc;
  int *keep_sm = asum, bs = cfg[C_BLOCK];
  aq = q8, asc = sc, asum = sm, cfg[C_BLOCK] = 256; // callable before dk_init
  int want[4] = {0, 0, 0, 0}, want8 = 0, ok = 1;
  for (int k = 0; k < 256; k++) {
    int q = (k * 37) % 255 - 127;
    a[k] = (float)q;
    for (int n = 0; n < 4; n++) {
      int nib = (k * 11 + n * 5) % 16;
      w[n * 128 + k / 2] |= (u8)(nib << (4 * (k & 1)));
      want[n] += q * (nib - 8);
    }
    w8[k] = (u8)(k * 73 + 5); // every byte once
    want8 += q * ((int)w8[k] - 128);
  }
  quantize(a, 1, 256, 1); // amax 127: the scale is 1 and the integers are a's
  matmul4(y, 1, 256, 4, w, s);
  for (int n = 0; n < 4; n++) ok &= y[n] == (float)want[n];
  quantize(a, 1, 256, SPLIT8);
  matmul8(y, 1, 256, 1, w8, s);
  ok &= y[0] == (float)want8;
  aq = keep_q, asc = keep_sc, asum = keep_sm, cfg[C_BLOCK] = bs;
  for (int i = 0; i < 4 * 128; i++) w[i] = 0;
  return ok;
}

// One 4-bit linear layer alone, y[rows][N] = a[rows][K] W (benchmarks/probes/probe_web_matmul.py
// times it beside onnxruntime-web's kernels); the activations' buffers must hold rows x K.
__attribute__((export_name("dk_linear"))) void dk_linear(float *y, const float *a, int rows,
                                                         int K, int N, const u8 *w,
                                                         const float *s, int block) {
  static usize cap, scales; // what the buffers hold: rows x K, and (rows + TR) x blocks
  cfg[C_BLOCK] = block;
  if (!aq || (usize)rows * K > cap || (usize)(rows + TR) * (K / block) > scales) {
    cap = (usize)rows * K, scales = (usize)(rows + TR) * (K / block);
    aq = dk_alloc(sizeof(act_t) * cap);
    asc = dk_alloc(4 * scales);
    asum = dk_alloc(4 * scales);
  }
  quantize(a, rows, K, 1);
  matmul4(y, rows, K, N, w, s);
}
