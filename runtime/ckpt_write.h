/* ckpt_write.h - write a random, deterministic M3 checkpoint in the released
 * layout, for tests, benchmarks and the embedded default model
 * (`m3kit make-checkpoint`).  It exists so every loader path (sharding, the VL
 * prefix, MXFP8 scales) is exercised without a 444 GB download.
 *
 * Layout written into DIR (HF conventions, as the real MXFP8 release):
 *   DIR/config.json                           VL wrapper form (m3_config_to_json_vl);
 *                                             with quantization_config {mxfp8, [1,32]}
 *                                             when mxfp8
 *   DIR/model-0000i-of-0000N.safetensors      i = 1..N, tensors in forward order
 *   DIR/model.safetensors.index.json          {"metadata": {"total_size"}, "weight_map"}
 * Tensor names carry the "language_model." prefix; the set is exactly
 * m3_ckpt_expected(c) (ckpt_names.h), plus "<name>_scale_inv" for each linear
 * weight when mxfp8.  Each file goes through m3_write_atomic.  Headers are
 * padded with spaces so the data section starts 8-byte aligned, and tensors
 * are packed with no gaps (what the official writer does).
 *
 * Values (deterministic in (seed, tensor name); independent of sharding and of
 * mxfp8, so a bf16 and an mxfp8 checkpoint of one seed hold the same weights up
 * to quantisation):
 *   embeddings, linears, router    ~ N(0, 0.02)  (bf16; router fp32)
 *   norm weights (Gemma offsets)   ~ N(0, 0.02)  (bf16: effective scale 1 + w)
 *   e_score_correction_bias        ~ N(0, 0.02)  (fp32)
 * "N" is Irwin-Hall(4) rescaled to unit variance (bounded at ±3.46 sigma): cheap,
 * platform-independent (no libm in the generator) and bit-reproducible.
 *
 * MXFP8 rule (spec §8), per row and per 32 consecutive input elements:
 *   amax = max |w| over the block; if amax == 0: s = 127;
 *   else k = floor(log2 amax) - 8, plus 1 if amax / 2^k > 448; s = clamp(k + 127, 0, 254);
 *   q = e4m3_rne_satfinite(w / 2^(s-127)),  weight_scale_inv = s (E8M0).
 * The OCP MX rule is floor(log2 amax) - 8 alone, which saturates block values in
 * [448, 512)·2^k; the +1 makes every element fit e4m3 unclipped, so dequant
 * q·2^(s-127) is the nearest e4m3 value of w at that scale.
 */
#ifndef M3_CKPT_WRITE_H
#define M3_CKPT_WRITE_H

#include <stddef.h>
#include <stdint.h>

#include "runtime/config.h"
#include "runtime/status.h"

/* Write the checkpoint (creating DIR).  n_shards in [1, number of tensors].
 * Memory: one shard is built in memory at a time.
 * Errors: M3_INVAL (n_shards), M3_IO (mkdir/write, naming the path), M3_NOMEM. */
m3_status m3_ckpt_write(const m3_config *c, const char *dir, int n_shards, int mxfp8,
                        uint64_t seed, m3_err *e);

/* The MXFP8 rule above on one row of n floats: q[n] e4m3 bits, s[ceil(n/32)]
 * E8M0 scales (a short last block uses its own amax). */
void m3_mxfp8_quantize_row(const float *x, size_t n, uint8_t *q, uint8_t *s);

/* The generator itself, for tests that want to recompute expected values:
 * fills v[n] with the values the writer uses for tensor `name` (full on-disk
 * name, prefix included) before any dtype rounding. */
void m3_ckpt_random_values(uint64_t seed, const char *name, float stddev, float *v, size_t n);

#endif
