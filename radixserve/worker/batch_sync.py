"""Rank 0 -> followers: each step's ForwardBatch as two broadcasts of int64 tensors (no pickle).

Every rank owns a KV pool with the SAME slot numbering (rank 0's scheduler allocates, the
followers only mirror), so the batch rank 0 built describes every rank's pool. Per step:

    header (HEADER_LEN,) int64: [op, n_req, n_tok, n_path, n_kv, n_swa]
        op = OP_FORWARD: a body follows;  op = OP_STOP: no body, the follower loop ends
    body (3*n_tok + 3*n_req + n_kv + 2*n_path + n_swa,) int64, in this order:
        | input_ids | positions | out_cache_loc |     each n_tok
        | seq_lens | extend_lens | path_lens |        each n_req (path_lens[r] = len(paths[r]))
        | kv_indices of all requests, concatenated |  n_kv = sum(seq_lens)
        | path node ids | path token counts |          each n_path = sum(path_lens)
        | swa_kv_indices, concatenated |               n_swa = n_kv, or 0 when None

Both go over `TPGroup.ctrl` (gloo, CPU tensors). Followers block in the header broadcast
between steps; the attention plan is recomputed on every rank from the received batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from radixserve.core.batch import ForwardBatch, cat_slots
from radixserve.distributed.parallel import TPGroup
from radixserve.kvcache.pool import KVPool

HEADER_LEN = 6
OP_STOP, OP_FORWARD = 0, 1


def send_batch(tp: TPGroup, batch: ForwardBatch) -> None:
    """Rank 0: broadcast `batch` to the followers. Does not modify `batch`."""
    assert tp.is_leader, f"only rank 0 sends batches, this is rank {tp.rank}"
    header, body = encode_batch(batch)
    dist.broadcast(header, src=0, group=tp.ctrl)
    dist.broadcast(body, src=0, group=tp.ctrl)


def encode_batch(batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(header (HEADER_LEN,), body) int64 CPU tensors in the layout of the module docstring."""
    n_tok, n_req = batch.input_ids.numel(), batch.num_requests
    nodes = [node for path in batch.paths for node in path]  # (node_id, num_tokens)
    kv = cat_slots(batch.kv_indices)
    swa = batch.swa_kv_indices
    rows = torch.cat(swa) if swa and n_req else torch.empty(0, dtype=torch.int64)
    lens = batch.seq_lens + batch.extend_lens + [len(p) for p in batch.paths]
    node_ints = [node for node, _ in nodes] + [n for _, n in nodes]
    parts = [
        batch.input_ids,
        batch.positions,
        batch.out_cache_loc,
        torch.tensor(lens, dtype=torch.int64),
        kv,
        torch.tensor(node_ints, dtype=torch.int64),
        rows,
    ]
    assert all(p.dtype == torch.int64 and p.device.type == "cpu" for p in parts), [
        (p.dtype, p.device) for p in parts
    ]
    header = torch.tensor(
        [OP_FORWARD, n_req, n_tok, len(nodes), kv.numel(), rows.numel()], dtype=torch.int64
    )
    return header, torch.cat(parts)


def send_stop(tp: TPGroup) -> None:
    """Rank 0: tell the followers to leave their loop (they then exit cleanly)."""
    assert tp.is_leader, f"only rank 0 sends stop, this is rank {tp.rank}"
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)  # op = OP_STOP
    dist.broadcast(header, src=0, group=tp.ctrl)


def recv_batch(tp: TPGroup, pool: KVPool) -> ForwardBatch | None:
    """Follower: wait for rank 0's next batch (over `pool`), or None on stop.

    Raises RuntimeError (from gloo) when rank 0 dies.
    """
    assert not tp.is_leader, "rank 0 builds batches, it does not receive them"
    header = torch.empty(HEADER_LEN, dtype=torch.int64)
    dist.broadcast(header, src=0, group=tp.ctrl)
    if int(header[0]) == OP_STOP:
        return None
    body = torch.empty(body_len(header), dtype=torch.int64)
    dist.broadcast(body, src=0, group=tp.ctrl)
    return decode_batch(header, body, pool)


def body_len(header: torch.Tensor) -> int:
    op, n_req, n_tok, n_path, n_kv, n_swa = header.tolist()
    assert op == OP_FORWARD, f"unknown batch op {op}"
    return 3 * n_tok + 3 * n_req + n_kv + 2 * n_path + n_swa


def decode_batch(header: torch.Tensor, body: torch.Tensor, pool: KVPool) -> ForwardBatch:
    """The batch `encode_batch` encoded, over `pool`. Its tensors are views of `body`."""
    _, n_req, n_tok, n_path, n_kv, n_swa = header.tolist()
    assert body.numel() == body_len(header), f"body {body.numel()} for header {header.tolist()}"
    sizes = [n_tok, n_tok, n_tok, 3 * n_req, n_kv, 2 * n_path, n_swa]
    ids, pos, locs, lens, kv, nodes, rows = body.split(sizes)
    lens_l = lens.tolist()
    seq_lens, extend_lens, path_lens = (lens_l[i * n_req : (i + 1) * n_req] for i in range(3))
    node_ids, node_tokens = nodes[:n_path].tolist(), nodes[n_path:].tolist()
    flat = list(zip(node_ids, node_tokens))
    paths: list[list[tuple[int, int]]] = []
    start = 0
    for n in path_lens:
        paths.append(flat[start : start + n])
        start += n
    return ForwardBatch(
        input_ids=ids,
        positions=pos,
        out_cache_loc=locs,
        seq_lens=seq_lens,
        extend_lens=extend_lens,
        kv_indices=list(kv.split(seq_lens)),
        paths=paths,
        kv_pool=pool,
        swa_kv_indices=list(rows.split(seq_lens)) if pool.swa_of is not None else None,
    )
