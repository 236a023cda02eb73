/* embedded.h - text files compiled into the library (templates, presets). */
#ifndef M3_EMBEDDED_H
#define M3_EMBEDDED_H
#include <stddef.h>
typedef struct m3_embedded {
  const char *name; /* path relative to its root, e.g. "qknorm_rope.lua" */
  const char *text; /* NUL-terminated */
  size_t len;
} m3_embedded;
#endif
