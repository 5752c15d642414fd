"""The offline Engine: the scheduler driven in-process, prompts in and results out, no server."""
