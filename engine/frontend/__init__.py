"""What callers use: the offline LLM, the AsyncEngine, tokenizer, incremental detokenizer, output processing, outputs."""
