"""Tensor parallelism: the process group, weight sharding, the per-step batch broadcast from
rank 0 to its followers, and the follower ranks' main loop.

Modules: `parallel` (group, all_reduce, sharding), `batch_sync` (ForwardBatch over
torch.distributed), `follower` (follower process main; spawning followers for an
in-process Engine).
"""
