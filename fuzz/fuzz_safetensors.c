/* fuzz_safetensors.c - one safetensors file, any bytes: the header length,
 * the JSON header, dtypes, shapes, data_offsets, overlap and coverage checks
 * of runtime/safetensors.c.  The reader must either refuse the file with a
 * status and a message, or return tensors that all lie inside the file, do
 * not overlap and have nbytes = numel x dtype size (fuzz/st_check.h). */
#include "fuzz/st_check.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  char path[600];
  fuzz_write("model.safetensors", data, size, path, sizeof path);
  m3_st *st = NULL;
  m3_err e = {0};
  m3_status s = m3_st_open(path, &st, &e);
  fuzz_note("safetensors", s, e.msg);
  if (s == M3_OK) {
    FUZZ_CHECK(st != NULL, "M3_OK without a handle");
    FUZZ_CHECK(m3_st_index_path(st) == NULL && m3_st_n_files(st) == 1, "single file");
    fuzz_check_st(st);
    m3_st_close(st);
  } else {
    FUZZ_CHECK(st == NULL, "error %s left a handle", m3_status_name(s));
    FUZZ_CHECK(e.msg[0] != 0, "error %s without a message", m3_status_name(s));
  }
  return 0;
}
