/* code_hash.c - see code_hash.h.  A small lexer over the source: the only C
 * it needs to know is where line splices, comments, literals (raw strings
 * included) and pp-numbers (whose ' is a digit separator) begin and end. */
#include "gen/code_hash.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

static int blank(char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\f' || c == '\v'; }
static int ident(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_'; }
static int digit(char c) { return c >= '0' && c <= '9'; }

/* The first index at or after i that is not inside a line splice
 * (backslash-newline, which translation phase 2 deletes everywhere but in raw
 * strings). */
static size_t sk(const char *s, size_t len, size_t i) {
  while (i < len && s[i] == '\\') {
    if (i + 1 < len && s[i + 1] == '\n') i += 2;
    else if (i + 2 < len && s[i + 1] == '\r' && s[i + 2] == '\n') i += 3;
    else break;
  }
  return i;
}

/* Does out[0..o) end with a raw-string prefix token (R, u8R, uR, UR, LR)? */
static int raw_prefix(const char *out, size_t o) {
  static const char *const p[] = {"u8R", "uR", "UR", "LR", "R"};
  for (size_t k = 0; k < sizeof p / sizeof *p; k++) {
    const size_t l = strlen(p[k]);
    if (o >= l && !memcmp(out + o - l, p[k], l) && (o == l || !ident(out[o - l - 1]))) return 1;
  }
  return 0;
}

char *m3_code_normalise(const char *s, size_t len, const char *entry, size_t *n) {
  static const char mark[] = "__m3_entry__";
  const size_t el = entry ? strlen(entry) : 0;
  /* Output never exceeds the input plus a closing line break, except where a
   * shorter entry name becomes the mark: size for both. */
  char *out = malloc(len + 2 + (el && el < sizeof mark ? (len / el + 1) * sizeof mark : 0));
  if (!out) return NULL;
  size_t o = 0, i = 0;
  int pend_space = 0; /* a blank run (or comment) since the last token on this line */
  int num = 0;        /* inside a pp-number */
  while ((i = sk(s, len, i)) < len) {
    const char c = s[i];
    const size_t j = sk(s, len, i + 1); /* the next character */
    const char d = j < len ? s[j] : '\0';
    if (c == '\n') { /* line end: trailing blanks dropped, empty lines dropped */
      pend_space = num = 0;
      if (o > 0 && out[o - 1] != '\n') out[o++] = '\n';
      i++;
    } else if (blank(c)) {
      pend_space = 1, num = 0;
      i++;
    } else if (c == '/' && d == '/') { /* to the line end (a splice continues it) */
      for (i = j; (i = sk(s, len, i)) < len && s[i] != '\n'; i++) {}
      pend_space = 1, num = 0;
    } else if (c == '/' && d == '*') { /* as in C, the whole comment, line breaks included, is one space */
      for (i = sk(s, len, j + 1); i < len; i = sk(s, len, i + 1)) {
        const size_t k = sk(s, len, i + 1);
        if (s[i] == '*' && k < len && s[k] == '/') {
          i = k + 1;
          break;
        }
      }
      pend_space = 1, num = 0;
    } else {
      const int starts = pend_space || o == 0 || out[o - 1] == '\n' || !ident(out[o - 1]);
      if (pend_space && o > 0 && out[o - 1] != '\n') out[o++] = ' ';
      pend_space = 0;
      size_t q = i + 1; /* a raw string's opening: R"delim( with delim of at most 16 characters */
      if (c == '"' && raw_prefix(out, o))
        while (q < len && q - i <= 16 && s[q] != '(' && s[q] != '"' && s[q] != '\\') q++;
      if (c == '"' && raw_prefix(out, o) && q < len && s[q] == '(') { /* byte for byte: no splices inside */
        const size_t dl = q - i - 1;
        size_t end = q + 1;
        while (end < len && !(s[end] == ')' && end + 1 + dl < len && !memcmp(s + end + 1, s + i + 1, dl) &&
                              s[end + 1 + dl] == '"'))
          end++;
        end = end < len ? end + dl + 2 : len;
        memcpy(out + o, s + i, end - i);
        o += end - i;
        i = end;
        num = 0;
      } else if (c == '"' || (c == '\'' && !num)) { /* a literal, up to its unescaped closing quote or the line end */
        out[o++] = c;
        for (i = j; (i = sk(s, len, i)) < len && s[i] != c && s[i] != '\n'; i++) {
          if (s[i] == '\\') {
            out[o++] = s[i];
            i = sk(s, len, i + 1);
            if (i >= len) break;
          }
          out[o++] = s[i];
        }
        if (i < len && s[i] == c) out[o++] = s[i++];
        num = 0;
      } else if (el && starts && !num && ident(c) && i + el <= len && !memcmp(s + i, entry, el) &&
                 (i + el == len || !ident(s[i + el]))) {
        memcpy(out + o, mark, sizeof mark - 1);
        o += sizeof mark - 1;
        i += el;
      } else {
        /* pp-numbers: a digit (or . digit) starts one; ' inside is a digit separator */
        if (!num && starts && (digit(c) || (c == '.' && digit(d)))) num = 1;
        else if (num && !(ident(c) || c == '.' || c == '\'' ||
                          ((c == '+' || c == '-') && o > 0 && strchr("eEpP", out[o - 1]))))
          num = 0;
        out[o++] = c;
        i = j;
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

void m3_code_hash_text(uint64_t h, char *buf, size_t n) { snprintf(buf, n, "%s%016llx", M3_CODE_HASH_SCHEME, (unsigned long long)h); }
