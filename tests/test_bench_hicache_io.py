"""benchmarks/bench_hicache_io.py codec at a tiny size: both codecs at both pool layouts,
each record decoded bit for bit, sizes as the record layouts state, the JSON record as
returned, the CPU named."""

from __future__ import annotations

import json
from pathlib import Path

import bench_hicache_io as bhi

from radixserve.kvcache.tier_store import (
    CHUNK_TOKENS,
    MAC_BYTES,
    MAGIC,
    NONCE_BYTES,
    SEALED_MAGIC,
    TAG_BYTES,
)


def test_codec_rows_cover_both_codecs_at_both_layouts(tmp_path: Path) -> None:
    out = tmp_path / "results" / "tier_crypt.json"
    report = bhi.main(["codec", "--chunks", "2", "--repeat", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == report
    assert report["cpu"] and report["command"].startswith("python benchmarks/bench_hicache_io")
    rows = {(r["layout"], r["codec"]): r for r in report["rows"]}
    assert list(rows) == [(name, c) for name in bhi.LAYOUTS for c in ("mac", "sealed")]
    frame = {"mac": len(MAGIC) + MAC_BYTES, "sealed": len(SEALED_MAGIC) + NONCE_BYTES + TAG_BYTES}
    for name, (layers, heads, dim) in bhi.LAYOUTS.items():
        chunk_bytes = layers * 2 * CHUNK_TOKENS * heads * dim * 2  # float16
        mac, sealed = rows[(name, "mac")], rows[(name, "sealed")]
        assert mac["chunk_bytes"] == sealed["chunk_bytes"] == chunk_bytes
        # the same header and payload inside; only the frame around them differs
        assert sealed["record_bytes"] - mac["record_bytes"] == frame["sealed"] - frame["mac"]
        assert mac["record_bytes"] > chunk_bytes + 4 * CHUNK_TOKENS + frame["mac"]
        for row in (mac, sealed):
            assert row["samples"] == 2 and row["encode_us"] > 0 and row["decode_us"] > 0
