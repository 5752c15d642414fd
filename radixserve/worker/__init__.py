"""The model worker: runs one forward step of a ForwardBatch on this process's model shard.

- `model_worker`: ModelWorker (model, KV pool, attention backend; sizes the pool)
- `tp_follower`: the main loop of tensor-parallel follower ranks, and spawning them
- `batch_sync`: rank 0 broadcasts each step's ForwardBatch to its followers
"""
