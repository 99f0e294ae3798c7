"""Models: a Hugging Face directory loaded and saved (:mod:`.loading`), LoRA (:mod:`.lora`), the reference policy
(:mod:`.reference`), what differs under FSDP (:mod:`.sharding`); a GGUF file → a Hugging Face directory
(:mod:`.gguf`); the log-prob passes (:mod:`.logprobs`), their LM head in chunks (:mod:`.chunked_logprobs`), the
sampler's copy of the weights (:mod:`.rollout_weights`), and the fast path for Llama-family models (:mod:`.fast`)."""
