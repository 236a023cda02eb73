/* code_hash.c - see code_hash.h.  A small state machine over the source: the
 * only C lexing it needs is where comments and literals begin and end. */
#include "gen/code_hash.h"

#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

static int blank(char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\f' || c == '\v'; }

static int ident(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_'; }

char *m3_code_normalise(const char *s, size_t len, const char *entry, size_t *n) {
  static const char mark[] = "__m3_entry__";
  const size_t el = entry ? strlen(entry) : 0;
  /* the entry's name may be shorter than the mark: size for the worst case */
  char *out = malloc(len + 1 + (el && el < sizeof mark ? (len / el + 1) * sizeof mark : 0));
  if (!out) return NULL;
  size_t o = 0, i = 0;
  int pend_space = 0; /* a blank run (or comment) seen since the last token on this line */
  while (i < len) {
    const char c = s[i];
    if (c == '\n') { /* line end: trailing blanks dropped, empty lines dropped */
      pend_space = 0;
      if (o > 0 && out[o - 1] != '\n') out[o++] = '\n';
      i++;
    } else if (blank(c)) {
      pend_space = 1;
      i++;
    } else if (c == '/' && i + 1 < len && s[i + 1] == '/') {
      while (i < len && s[i] != '\n') i++;
      pend_space = 1;
    } else if (c == '/' && i + 1 < len && s[i + 1] == '*') {
      i += 2;
      /* as in C, the whole comment, line breaks included, is one space */
      while (i + 1 < len && !(s[i] == '*' && s[i + 1] == '/')) i++;
      i = i + 1 < len ? i + 2 : len;
      pend_space = 1;
    } else {
      if (pend_space && o > 0 && out[o - 1] != '\n') out[o++] = ' ';
      pend_space = 0;
      if (c == '"' || c == '\'') { /* a literal, verbatim up to its unescaped closing quote or the line end */
        out[o++] = s[i++];
        while (i < len && s[i] != c && s[i] != '\n') {
          if (s[i] == '\\' && i + 1 < len) out[o++] = s[i++];
          out[o++] = s[i++];
        }
        if (i < len && s[i] == c) out[o++] = s[i++];
      } else if (el && ident(c) && (i == 0 || !ident(s[i - 1])) && i + el <= len && !memcmp(s + i, entry, el) &&
                 (i + el == len || !ident(s[i + el]))) {
        memcpy(out + o, mark, sizeof mark - 1);
        o += sizeof mark - 1;
        i += el;
      } else {
        out[o++] = s[i++];
      }
    }
  }
  if (o > 0 && out[o - 1] != '\n') out[o++] = '\n';
  out[o] = '\0';
  *n = o;
  return out;
}

uint64_t m3_code_hash(const char *src, size_t len, const char *entry, int threads, int smem) {
  size_t n;
  char *t = m3_code_normalise(src, len, entry, &n);
  XXH64_state_t *st = XXH64_createState();
  if (!t || !st) { /* out of memory: a hash no record carries, so nothing is trusted by mistake */
    free(t);
    XXH64_freeState(st);
    return 0;
  }
  XXH64_reset(st, 0x6d33636f6465ULL); /* "m3code" */
  XXH64_update(st, t, n);
  const int launch[2] = {threads, smem};
  XXH64_update(st, launch, sizeof launch);
  uint64_t h = XXH64_digest(st);
  XXH64_freeState(st);
  free(t);
  return h;
}
