/* m3kit.h - the public API of libm3kit.
 *
 * The flow: config -> variant key -> Lua template -> CUDA source -> NVRTC ->
 * cubin cache -> launch; and tune -> tuning DB -> runtime lookup.  Each stage
 * has its own header, included here; every function documents shapes, dtypes,
 * units, its error returns and the spec section it implements
 * (shared/spec/m3-architecture.md).
 */
#ifndef M3KIT_H
#define M3KIT_H

#include "runtime/status.h"

#define M3KIT_VERSION "0.1.0"

#endif
