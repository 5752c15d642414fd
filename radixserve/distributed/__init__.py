"""Tensor-parallel process groups (`parallel`): init, all_reduce, the control group.

The model's weight layout under TP is `radixserve.models.sharding`; the follower ranks'
main loop and the per-step batch broadcast are `radixserve.worker.tp_follower` and
`radixserve.worker.batch_sync`.
"""
