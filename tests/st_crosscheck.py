#!/usr/bin/env python3
"""st_crosscheck.py - check m3kit's safetensors writer and reader against the
official Python `safetensors` package (the Rust implementation).

For bf16 and mxfp8: write a tiny-preset checkpoint with 2 shards, then
  - load every shard with safetensors.deserialize (which rejects gaps,
    overlaps, bad offsets and unknown dtypes), and
  - compare names, dtypes, shapes and bytes (CRC-32) with what m3kit's reader
    reports (`st_dump dump`), and the index's weight_map with the shards.

usage: st_crosscheck.py [ST_DUMP] [--layers L]
  ST_DUMP  the tests/st_dump driver (default ./tests/st_dump), the reader; the
           writer is `m3kit make-checkpoint --preset tiny --out DIR --shards 2
           [--mxfp8]` (ST_DUMP's ../m3kit, or $M3KIT), else `st_dump write`.
  --layers L  cut the preset to L layers (default: all 60).
Exits 77 (automake "skip") when the safetensors package is not importable.
"""
import json
import os
import subprocess
import sys
import tempfile
import zlib

try:
    import safetensors
    from safetensors import deserialize
except ImportError:
    print("st_crosscheck: python package 'safetensors' not importable: skipping "
          "(pip install safetensors)")
    sys.exit(77)


def fail(msg):
    print("st_crosscheck: FAIL: " + msg)
    sys.exit(1)


def check(st_dump, layers, mxfp8, tmp):
    d = os.path.join(tmp, "mxfp8" if mxfp8 else "bf16")
    # The product's own command writes it when it is at hand (the build
    # directory, where automake runs this test); st_dump otherwise, or when
    # the layer count is cut (make-checkpoint has no --layers).
    m3kit = os.environ.get("M3KIT", os.path.join(os.path.dirname(os.path.abspath(st_dump)), "..", "m3kit"))
    if not layers and os.access(m3kit, os.X_OK):
        cmd = [m3kit, "make-checkpoint", "--preset", "tiny", "--out", d, "--shards", "2", "--seed", "7"]
    else:
        cmd = [st_dump, "write", d, "--preset", "tiny", "--shards", "2", "--seed", "7"]
        if layers:
            cmd += ["--layers", str(layers)]
    if mxfp8:
        cmd.append("--mxfp8")
    print("st_crosscheck: writing with", " ".join(cmd[:2]))
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)

    # What m3kit's reader sees.
    out = subprocess.run([st_dump, "dump", d], check=True, capture_output=True, text=True).stdout
    ours = {}
    for line in out.splitlines():
        name, dtype, shape, nbytes, crc, fname = line.split("\t")
        ours[name] = (dtype, [int(x) for x in shape.split(",")] if shape else [],
                      int(nbytes), int(crc, 16), fname)

    # What the official implementation sees.
    with open(os.path.join(d, "model.safetensors.index.json")) as f:
        index = json.load(f)
    wm = index["weight_map"]
    theirs = {}
    total = 0
    for fname in sorted(set(wm.values())):
        with open(os.path.join(d, fname), "rb") as f:
            data = f.read()
        for name, t in deserialize(data):
            if name in theirs:
                fail(f"{name} in two shards")
            b = bytes(t["data"])
            total += len(b)
            theirs[name] = (t["dtype"], list(t["shape"]), len(b), zlib.crc32(b), fname)
        # The metadata block must be readable too.
        with safetensors.safe_open(os.path.join(d, fname), framework="numpy") as h:
            if h.metadata() != {"format": "pt"}:
                fail(f"{fname}: metadata {h.metadata()}")

    if set(ours) != set(theirs):
        fail(f"name sets differ: only m3kit {sorted(set(ours) - set(theirs))[:5]}, "
             f"only safetensors {sorted(set(theirs) - set(ours))[:5]}")
    if set(wm) != set(theirs):
        fail("index weight_map and shard contents differ")
    for name, v in theirs.items():
        if ours[name] != v:
            fail(f"{name}: m3kit {ours[name]} vs safetensors {v}")
        if wm[name] != v[4]:
            fail(f"{name}: index says {wm[name]}, found in {v[4]}")
    if index["metadata"]["total_size"] != total:
        fail(f"total_size {index['metadata']['total_size']} != {total}")

    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    if cfg["model_type"] != "minimax_m3_vl" or "text_config" not in cfg:
        fail("config.json is not in VL wrapper form")
    q = cfg.get("quantization_config")
    if mxfp8 != (q is not None and q.get("quant_method") == "mxfp8"):
        fail(f"quantization_config {q} for mxfp8={mxfp8}")
    n_f8 = sum(1 for v in theirs.values() if v[0] == "F8_E4M3")
    n_sc = sum(1 for k in theirs if k.endswith(".weight_scale_inv"))
    if mxfp8 and (n_f8 == 0 or n_f8 != n_sc):
        fail(f"{n_f8} F8_E4M3 weights but {n_sc} scales")
    if not mxfp8 and n_f8:
        fail("F8 tensors in a bf16 checkpoint")
    print(f"st_crosscheck: {'mxfp8' if mxfp8 else 'bf16'}: {len(theirs)} tensors, "
          f"{total} bytes identical (safetensors {safetensors.__version__})")


def main():
    args = sys.argv[1:]
    layers = 0
    if "--layers" in args:
        i = args.index("--layers")
        layers = int(args[i + 1])
        del args[i:i + 2]
    st_dump = args[0] if args else "./tests/st_dump"
    with tempfile.TemporaryDirectory(prefix="m3st") as tmp:
        for mxfp8 in (False, True):
            check(st_dump, layers, mxfp8, tmp)


if __name__ == "__main__":
    main()
