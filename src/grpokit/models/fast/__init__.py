"""The fast path: our own forward for Llama-family models (Llama, Qwen2, Mistral without a sliding window),
with the same weights and math as the Hugging Face forward, faster at GRPO's shapes.

It runs in :mod:`grpokit.rollout.generate`: for sampling (``generate``: decoding with a cache that grows by
doubling, finished completions dropped) and for the log-prob passes (``sequence_logprobs``: the reference's and
the policy's, on real tokens only), whenever ``fast`` is on (the config's ``fast_path``, off for FSDP's
training passes) and :func:`~grpokit.models.fast.support.unsupported` finds nothing it cannot run (and, for
log-probs, every prompt has a real token); otherwise those fall back to the model's own forward.

Modules: :mod:`~grpokit.models.fast.llama_family` (``LlamaFamily``, the entry point, with ``unsupported`` and
``unwrap_peft``), :mod:`~grpokit.models.fast.support` (which models it runs), :mod:`~grpokit.models.fast.parts`
(the modules and pieces shared by the passes), :mod:`~grpokit.models.fast.hidden_states` (training and
reference passes), :mod:`~grpokit.models.fast.decode` (sampling) and :mod:`~grpokit.models.fast.fused_linear`
(the fused and packed linear layers).
"""
