"""Models: loading a Hugging Face causal LM, devices and precision, LoRA and the reference policy
(:mod:`.loading`); a GGUF file → a Hugging Face directory (:mod:`.gguf`); the log-prob passes (:mod:`.logprobs`),
their LM head in chunks (:mod:`.chunked_logprobs`), and the fast path for Llama-family models (:mod:`.fast`)."""
