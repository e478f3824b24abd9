"""What callers use: the offline LLM, the AsyncEngine, the tokenizer, the incremental detokenizer, output
processing, outputs."""
