/* code_hash.h - the identity of the code a tuning record measured.
 *
 * A tuning record says "tile X was the fastest of these candidates for key K
 * on this GPU".  That stays true for as long as the code X compiles to is the
 * code that was timed, whatever else changes in its template: a comment, a
 * Lua helper, a tile value added for another candidate, a lib/ block that
 * only other tiles emit.  So the record carries the hash of the *rendered*
 * CUDA source of (K, X, arch) with everything the compiler ignores taken out,
 * and the loader compares it with the current rendering (docs/tuning-db.md,
 * "Stale records").
 */
#ifndef M3_CODE_HASH_H
#define M3_CODE_HASH_H

#include <stddef.h>
#include <stdint.h>

/* XXH64 of `src[0..len)` normalised the way C's translation phases 1-3 see
 * it: line splices (backslash-newline) deleted, except inside raw strings;
 * comments (// and block) become one space; runs of blanks outside literals
 * become one space, blanks at line ends and empty lines go; line breaks stay
 * (they end preprocessor directives); string, character and raw-string
 * literals are kept byte for byte (a ' inside a pp-number is a digit
 * separator, not a literal).  The kernel's own name `entry` (NULL: none)
 * becomes a fixed mark wherever it stands as an identifier: it is derived
 * from the full key, so a renamed tile (a tile axis added) would otherwise
 * change the hash of unchanged code.  threads and smem (the launch the
 * source was rendered for) are hashed too.  Two sources with equal hashes
 * compile to the same program; the converse is not promised (a changed blank
 * inside a literal changes the hash: stale by caution, never the reverse).
 * Pure; 0 only when out of memory. */
uint64_t m3_code_hash(const char *src, size_t len, const char *entry, int threads, int smem);

/* The scheme of the code hashes this build computes; the text form is the
 * scheme then 16 hex digits ("c1:0123456789abcdef").  A change to the
 * normalisation changes the scheme, so that records hashed under another one
 * fall back to the template-hash rule instead of all going stale at once. */
#define M3_CODE_HASH_SCHEME "c1:"
#define M3_CODE_HASH_TEXT 24 /* bytes of the text form, its NUL included */
/* The text form of h into buf (n >= M3_CODE_HASH_TEXT). */
void m3_code_hash_text(uint64_t h, char *buf, size_t n);

/* The normalised text m3_code_hash hashes, malloc'd (NULL when out of
 * memory); *n receives its length.  For tests. */
char *m3_code_normalise(const char *src, size_t len, const char *entry, size_t *n);

#endif
