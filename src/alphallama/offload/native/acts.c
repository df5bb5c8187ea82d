/* The expert contract's activations (kernels/moe/expert_q8.py): the int8 quantization of a
 * row (quantize_q8), exp_c, SiLU x up and gpt-oss's swiglu_oai, in the contract's fixed
 * float sequence. Included by experts.c. */

static inline float rne(float v) { return (v + RNE_MAGIC) - RNE_MAGIC; }

void aq_quantize(const float *x, int K, int8_t *xq, float *dx, int32_t *xs) {
    for (int b = 0; b < K / QBLOCK; b++) {
        const float *xb = x + b * QBLOCK;
        float amax = 0.0f;
        for (int i = 0; i < QBLOCK; i++) {
            float a = xb[i] < 0 ? -xb[i] : xb[i];
            amax = a > amax ? a : amax;
        }
        dx[b] = amax / 127.0f;
        float inv = amax > 0 ? 127.0f / amax : 0.0f;
        for (int i = 0; i < QBLOCK; i++) xq[b * QBLOCK + i] = (int8_t)(int32_t)rne(xb[i] * inv);
        for (int g = 0; g < QBLOCK / 16; g++) {
            int32_t s = 0;
            for (int i = 0; i < 16; i++) s += xq[b * QBLOCK + g * 16 + i];
            xs[b * 2 + g] = s;
        }
    }
}

#define LOG2E ((float)1.4426950408889634)
#define LN2_HI ((float)0.693359375)
#define LN2_LO ((float)-2.1219444005469057e-4)

static inline float exp_c1(float v) {
    v = v < -87.0f ? -87.0f : (v > 87.0f ? 87.0f : v);
    float n = rne(v * LOG2E);
    float r = (v - n * LN2_HI) - n * LN2_LO;
    float p = (float)(1.0 / 5040);
    p = p * r + (float)(1.0 / 720);
    p = p * r + (float)(1.0 / 120);
    p = p * r + (float)(1.0 / 24);
    p = p * r + (float)(1.0 / 6);
    p = p * r + (float)(1.0 / 2);
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

void aq_exp(const float *v, int n, float *out) {
    for (int i = 0; i < n; i++) out[i] = exp_c1(v[i]);
}

void aq_silu_mul(const float *g, const float *u, int n, float *out) {
    for (int i = 0; i < n; i++) out[i] = (g[i] * (1.0f / (1.0f + exp_c1(-g[i])))) * u[i];
}

#define OAI_ALPHA ((float)1.702)   /* gpt-oss's (kernels/activations/act_ids.py), rounded once */
#define OAI_LIMIT 7.0f

/* swiglu_oai: g clamped above at 7, u to [-7, 7] (compare-selects), g sigmoid(1.702 g) (u + 1). */
void aq_swiglu_oai(const float *g, const float *u, int n, float *out) {
    for (int i = 0; i < n; i++) {
        float gi = g[i] > OAI_LIMIT ? OAI_LIMIT : g[i];
        float ui = (u[i] > OAI_LIMIT ? OAI_LIMIT : (u[i] < -OAI_LIMIT ? -OAI_LIMIT : u[i])) + 1.0f;
        out[i] = (gi * (1.0f / (1.0f + exp_c1(-(gi * OAI_ALPHA))))) * ui;
    }
}

/* The contract's activations by id (act_ids.ACT_IDS; expert_q8.CONTRACT_ACTS). */
typedef void (*act_fn)(const float *, const float *, int, float *);
enum { ACT_SILU = 0, ACT_OAI = 2, N_ACTS = 3 };
static const act_fn ACTS[N_ACTS] = {[ACT_SILU] = aq_silu_mul, [ACT_OAI] = aq_swiglu_oai};

/* act(g, u) of n values into out; -1 for an id the contract has not. */
int aq_act(int act, const float *g, const float *u, int n, float *out) {
    if (act < 0 || act >= N_ACTS || !ACTS[act]) return -1;
    ACTS[act](g, u, n, out);
    return 0;
}
