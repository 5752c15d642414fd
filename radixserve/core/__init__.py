"""Plain shared types at the bottom of the runtime; they import nothing else of radixserve.

- `params`: SamplingParams (parsed and validated once, at the edge), InvalidRequest
- `limits`: caps on what one request may ask for
- `request`: TokenizedRequest in, TokenDelta objects and FinishReason out of the scheduler
- `info`: ModelInfo and SchedulerStats, what the scheduler reports about itself
- `batch`: ForwardBatch, the tensors of one model step, and KVStore, the pool it writes to
"""
