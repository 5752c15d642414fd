"""Tokenizer process: tokenize, chat template, incremental detokenize, stop-string trimming."""
