"""Prompt modules (Prompt Cache): the PML schema/prompt language, its Python API, the
position layout, and the chat-template role markup that PML and the DSL share.

    pml.py     markup <-> trees (`schema`, `module`, `param`, `union`, `role`, `prompt`, `use`)
    layout.py  trees + a tokenizer -> each module's tokens and positions; a prompt's imports
    roles.py   each role's prefix and suffix, cut from the model's chat template

Pure Python (no torch): the tokenizer process, the offline Engine and the DSL all use it.
"""
