"""radixserve: LLM serving with a radix-tree KV cache and tree-structured attention."""
