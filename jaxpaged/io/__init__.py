"""The text side of a request: prompt parsing, tokenizer, incremental detokenizer, outputs."""
