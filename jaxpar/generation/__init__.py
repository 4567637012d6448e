"""`jaxpar generate`: KV-cache decoding on a sharded model (`decoding`), and prompts in and
completions out (`prompts`)."""
