  for (int h = 0; h < HPW; h++) {
    int s = sl[h];
    if (s < 0) continue;
    const i64 t = tok[h], slot = slt[h];
    bf16_t *row = qkv + t * (i64)ROW;
    const i64 page = slot / BS, off = slot % BS;
    if (s < NQ) {                                   /* Q head */
      f4 x = NORMED(h);
      store4_bf16(q_out ? q_out + t * (i64)(NQ * HD) + s * HD + j * DPL : row + s * HD + j * DPL, x);
      continue;
    }
    s -= NQ;
    if (s < NKV) {                                  /* K head */
      bf16_t *src = row + (NQ + s) * HD + j * DPL;
      f4 x = NORMED(h);
      store4_bf16(src, x);
      if (INSERT) {
        i64 at = ((page * NKV + s) * BS + off) * (2 * HD) + j * DPL;
        if (KV_E4M3) store4_e4m3((e4m3_t *)kv_cache + at, SPARSE ? x : round4_bf16(x));
        else store4_bf16((bf16_t *)kv_cache + at, x);
      }
      continue;
    }
    s -= NKV;
    if (INSERT && s < NKV) {                        /* V head: copied as is */
      i64 at = ((page * NKV + s) * BS + off) * (2 * HD) + HD + j * DPL;
      if (KV_E4M3) store4_e4m3((e4m3_t *)kv_cache + at, unpack4(xin[h]));
      else storepk((bf16_t *)kv_cache + at, xin[h]);
      continue;
    }
    if (INSERT) s -= NKV;
#if SPARSE
    if (s < NIQ) {                                  /* index-Q head */
      bf16_t *src = row + (NQ + 2 * NKV + s) * HD + j * DPL;
      f4 x = NORMED(h);
      if (index_q_out) {
        i64 at = t * (i64)(NIQ * HD) + s * HD + j * DPL;
        if (IDX_E4M3) store4_e4m3((e4m3_t *)index_q_out + at, x);
        else store4_bf16((bf16_t *)index_q_out + at, x);
      } else {
        store4_bf16(src, x);
      }
      continue;
    }
    {                                               /* the single index-K head */
      bf16_t *src = row + (NQ + 2 * NKV + NIQ) * HD + j * DPL;
      f4 x = NORMED(h);
      store4_bf16(src, x);
      if (INSERT) {
        i64 islot = index_slot_mapping ? index_slot_mapping[t] : slot;
        if (islot >= 0) {
          i64 at = islot * HD + j * DPL;
          if (IDX_E4M3) store4_e4m3((e4m3_t *)index_cache + at, x);
          else store4_bf16((bf16_t *)index_cache + at, x);
        }
      }
    }
#endif
  }
}
