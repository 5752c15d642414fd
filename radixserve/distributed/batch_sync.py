"""Rank 0 -> followers: each step's ForwardBatch as two broadcasts of int64 tensors (no pickle).

Every rank owns a KV pool with the SAME slot numbering (rank 0's scheduler allocates, the
followers only mirror), so the batch rank 0 built describes every rank's pool. Per step:

    header (HEADER_LEN,) int64: [op, n_req, n_tok, n_path, n_kv]
        op = OP_FORWARD: a body follows;  op = OP_STOP: no body, the follower loop ends
    body (3*n_tok + 3*n_req + n_kv + 2*n_path,) int64, in this order:
        | input_ids | positions | out_cache_loc |     each n_tok
        | seq_lens | extend_lens | path_lens |        each n_req (path_lens[r] = len(paths[r]))
        | kv_indices of all requests, concatenated |  n_kv = sum(seq_lens)
        | path node ids | path token counts |          each n_path = sum(path_lens)

Both go over `TPGroup.ctrl` (gloo, CPU tensors). Followers block in the header broadcast
between steps; the attention plan is recomputed on every rank from the received batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from radixserve.distributed.parallel import TPGroup
from radixserve.engine.batch import ForwardBatch
from radixserve.kvcache.pool import KVPool

HEADER_LEN = 5
OP_STOP, OP_FORWARD = 0, 1


def send_batch(tp: TPGroup, batch: ForwardBatch) -> None:
    """Rank 0: broadcast `batch` to the followers. Does not modify `batch`."""
    assert tp.is_leader, f"only rank 0 sends batches, this is rank {tp.rank}"
    n_tok, n_req = batch.input_ids.numel(), batch.num_requests
    nodes = [node for path in batch.paths for node in path]  # (node_id, num_tokens)
    kv = torch.cat(batch.kv_indices) if n_req else torch.empty(0, dtype=torch.int64)
    lens = batch.seq_lens + batch.extend_lens + [len(p) for p in batch.paths]
    node_ints = [node for node, _ in nodes] + [n for _, n in nodes]
    parts = [
        batch.input_ids,
        batch.positions,
        batch.out_cache_loc,
        torch.tensor(lens, dtype=torch.int64),
        kv,
        torch.tensor(node_ints, dtype=torch.int64),
    ]
    assert all(p.dtype == torch.int64 and p.device.type == "cpu" for p in parts), [
        (p.dtype, p.device) for p in parts
    ]
    body = torch.cat(parts)  # the layout of the module docstring
    header = torch.tensor([OP_FORWARD, n_req, n_tok, len(nodes), kv.numel()], dtype=torch.int64)
    dist.broadcast(header, src=0, group=tp.ctrl)
    dist.broadcast(body, src=0, group=tp.ctrl)


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
    op, n_req, n_tok, n_path, n_kv = header.tolist()
    if op == OP_STOP:
        return None
    assert op == OP_FORWARD, f"unknown batch op {op}"
    body = torch.empty(3 * n_tok + 3 * n_req + n_kv + 2 * n_path, dtype=torch.int64)
    dist.broadcast(body, src=0, group=tp.ctrl)
    return _decode(body, n_req, n_tok, n_path, n_kv, pool)


def _decode(
    body: torch.Tensor, n_req: int, n_tok: int, n_path: int, n_kv: int, pool: KVPool
) -> ForwardBatch:
    sizes = [n_tok, n_tok, n_tok, 3 * n_req, n_kv, 2 * n_path]
    ids, pos, locs, lens, kv, nodes = body.split(sizes)
    lens_l = lens.tolist()
    seq_lens, extend_lens, path_lens = (lens_l[i * n_req : (i + 1) * n_req] for i in range(3))
    node_ids, node_tokens = nodes[:n_path].tolist(), nodes[n_path:].tolist()
    flat = list(zip(node_ids, node_tokens))
    paths, start = [], 0
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
    )
