/* fuzz_code_hash.c - source text through the code-hash normaliser
 * (gen/code_hash.c), a small C lexer (splices, comments, literals, raw
 * strings, pp-numbers) whose output decides whether a tuning record is still
 * trusted.  Promises checked: the output fits the bound the allocation was
 * sized for, its length is what *n says, it is deterministic, and a comment
 * in front of the source (where it can end nothing) changes no hash. */
#include "fuzz/fuzz.h"
#include "gen/code_hash.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  const char *src = (const char *)data;
  static const char *const entries[] = {NULL, "ab", "m3k_attn_dense_0123456789abcdef"};
  for (int k = 0; k < 3; k++) {
    size_t n, n2;
    char *t = m3_code_normalise(src, size, entries[k], &n);
    FUZZ_CHECK(t != NULL, "normalise returned NULL for %zu bytes", size);
    const size_t el = entries[k] ? strlen(entries[k]) : 0;
    FUZZ_CHECK(n <= size + 1 + (el && el < 13 ? (size / el + 1) * 13 : 0), "output %zu bytes from %zu", n, size);
    FUZZ_CHECK(t[n] == '\0', "output not terminated at its length");
    char *t2 = m3_code_normalise(src, size, entries[k], &n2);
    FUZZ_CHECK(t2 && n2 == n && !memcmp(t, t2, n), "not deterministic");
    free(t);
    free(t2);
  }
  const uint64_t h = m3_code_hash(src, size, "ab", 128, 0);
  FUZZ_CHECK(h == m3_code_hash(src, size, "ab", 128, 0), "hash not deterministic");
  char *pre = malloc(size + 8);
  FUZZ_CHECK(pre != NULL, "malloc");
  memcpy(pre, "/* x */", 7);
  memcpy(pre + 7, data, size);
  FUZZ_CHECK(m3_code_hash(pre, size + 7, "ab", 128, 0) == h, "a leading comment changed the hash");
  free(pre);
  return 0;
}
