"""Model code and weight loading against Hugging Face transformers (float32, CPU)."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, GPT2Config, LlamaConfig,
                          Qwen2Config, Qwen3Config)

from pagedllm import ops
from pagedllm.layers.attention import Attention, AttentionMetadata, set_forward_context
from pagedllm.models import load_model, resolve_model
from pagedllm.models.loader import ALIASES

ALIAS = "smollm2-135m-instruct"
BLOCK_SIZE = 16


def prefill_logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits of every position of one sequence prefilled from an empty paged cache."""
    n = input_ids.shape[0]
    num_blocks = -(-n // BLOCK_SIZE)
    param = next(model.parameters())
    for m in model.modules():
        if isinstance(m, Attention):
            k_shape, v_shape, cache_dtype = ops.kv_cache_shapes(num_blocks, BLOCK_SIZE, m.num_kv_heads,
                                                                m.head_size, param.dtype, "auto", param.device)
            m.bind_cache(torch.zeros(k_shape, dtype=cache_dtype, device=param.device),
                         torch.zeros(v_shape, dtype=cache_dtype, device=param.device), "auto", 1.0, 1.0)
    i32 = dict(dtype=torch.int32, device=param.device)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n, device=param.device), num_decode_tokens=0,
        decode_block_tables=None, decode_seq_lens=None, decode_max_seq_len=0,
        prefill_block_tables=torch.arange(num_blocks, **i32)[None],
        prefill_seq_lens=torch.tensor([n], **i32), prefill_query_start_loc=torch.tensor([0, n], **i32),
        prefill_max_query_len=n, prefill_max_seq_len=n)
    with set_forward_context(meta), torch.no_grad():
        return model.compute_logits(model(input_ids.to(param.device), torch.arange(n, device=param.device)))


def hf_logits(hf_model, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(input_ids[None]).logits[0].float()


def assert_close_relative(ours: torch.Tensor, theirs: torch.Tensor, rel: float = 1e-4) -> None:
    assert ours.dtype == torch.float32 and ours.shape == theirs.shape
    err = (ours - theirs).abs().max() / theirs.abs().max()
    assert err < rel, f"max error {err:.2e} relative to the largest logit"


# ---------------------------------------------------------------------------------------------------
# SmolLM2 from the bundled GGUF
# ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gguf_cache(tmp_path_factory):
    """The alias converted once into a private cache directory: (cache base, converted directory)."""
    pytest.importorskip("gguf", reason="GGUF conversion needs the gguf package (absent on the GPU machine)")
    base = tmp_path_factory.mktemp("pagedllm-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDLLM_CACHE_DIR", str(base))
        yield base, resolve_model(ALIAS)


@pytest.fixture(scope="module")
def hf_smollm2(gguf_cache):
    """transformers' own GGUF reading (the function behind from_pretrained(gguf_file=...), which would
    also want the accelerate package) -> (model, what transformers parsed from the GGUF metadata).
    The model is built from our config.json, which test_gguf_weights_match_transformers checks."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    _, model_dir = gguf_cache
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.float32,
                                             attn_implementation="eager")
    parsed = load_gguf_checkpoint(ALIASES[ALIAS](), return_tensors=True, model_to_load=model)
    model.load_state_dict(parsed["tensors"], strict=False)
    model.tie_weights()
    assert set(model.state_dict()) - set(parsed["tensors"]) == {"lm_head.weight"}
    return model.eval(), parsed


def test_gguf_weights_match_transformers(gguf_cache, hf_smollm2):
    _, model_dir = gguf_cache
    hf_model, parsed = hf_smollm2
    hf_config = parsed["config"]
    theirs = hf_model.state_dict()
    ours = {}
    for f in model_dir.glob("*.safetensors"):
        with safe_open(f, framework="pt") as st:
            ours.update({name: st.get_tensor(name) for name in st.keys()})
    # The head is tied to the embedding: transformers lists it, the GGUF (and our conversion) does not.
    assert set(ours) == set(theirs) - {"lm_head.weight"}
    for name, tensor in ours.items():
        assert torch.equal(tensor.float(), theirs[name]), name
    config = json.loads((model_dir / "config.json").read_text())
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "rms_norm_eps", "vocab_size", "tie_word_embeddings",
                "max_position_embeddings", "bos_token_id", "eos_token_id"):
        assert config[key] == hf_config[key], key
    assert config["rope_parameters"]["rope_theta"] == hf_config["rope_theta"]


def test_gguf_tokenizer_and_generation_config(gguf_cache, hf_smollm2, tmp_path):
    base, model_dir = gguf_cache
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer.chat_template == hf_smollm2[1]["tokenizer_config"]["chat_template"]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                           add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert GenerationConfig.from_pretrained(model_dir).eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    # Converted once: a second resolve reuses the directory, and so does a copy of the file elsewhere (a reinstall:
    # new path, new mtime); no temporary directory is left behind.
    copy = tmp_path / ALIASES[ALIAS]().name
    shutil.copyfile(ALIASES[ALIAS](), copy)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDLLM_CACHE_DIR", str(base))
        assert resolve_model(ALIAS) == model_dir
        assert resolve_model(str(copy)) == model_dir
    assert sorted(os.listdir(base)) == [".seen", model_dir.name] and len(os.listdir(base / ".seen")) == 2


def test_smollm2_logits_match_transformers(gguf_cache, hf_smollm2):
    base, model_dir = gguf_cache
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDLLM_CACHE_DIR", str(base))
        model, config, loaded_dir = load_model(ALIAS, torch.float32, "cpu")
    assert loaded_dir == model_dir and config.architectures == ["LlamaForCausalLM"]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = torch.tensor(tokenizer("The capital of France is Paris, and the capital of Germany is").input_ids)
    assert_close_relative(prefill_logits(model, ids), hf_logits(hf_smollm2[0], ids))


def test_conversion_failure_leaves_no_cache(tmp_path, monkeypatch):
    pytest.importorskip("gguf", reason="GGUF conversion needs the gguf package (absent on the GPU machine)")
    import pagedllm.models.gguf as gguf_module

    def broken(gguf_path, out_dir):
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(gguf_module, "convert_gguf", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        resolve_model(ALIAS)
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------------------------------------------
# Small random models saved by transformers
# ---------------------------------------------------------------------------------------------------
SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, max_position_embeddings=128)

CASES = {
    "llama-tied-gqa": (LlamaConfig, dict(num_key_value_heads=2, tie_word_embeddings=True), None),
    "llama-mqa-untied-sharded": (LlamaConfig, dict(num_key_value_heads=1, tie_word_embeddings=False), "40KB"),
    "llama3-rope": (LlamaConfig, dict(num_key_value_heads=2, tie_word_embeddings=False, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32, "rope_theta": 10000.0}), None),
    "llama-linear-rope-bias": (LlamaConfig, dict(num_key_value_heads=4, attention_bias=True, mlp_bias=True,
                                                 rope_scaling={"rope_type": "linear", "factor": 2.0}), None),
    "qwen2-qkv-bias": (Qwen2Config, dict(num_key_value_heads=2, tie_word_embeddings=False), None),
    "qwen3-qk-norm-head-dim": (Qwen3Config, dict(num_key_value_heads=2, head_dim=32,
                                                 tie_word_embeddings=True), None),
}


def random_hf_model(config_cls, overrides: dict):
    torch.manual_seed(0)
    config = config_cls(**SMALL, **overrides)
    config.architectures = [config_cls.__name__.replace("Config", "ForCausalLM")]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager").eval()
    # transformers starts biases at 0 and norms at 1; random values make every tensor count.
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.05 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("case", CASES)
def test_random_model_logits_match_transformers(case, tmp_path):
    config_cls, overrides, shard_size = CASES[case]
    hf_model = random_hf_model(config_cls, overrides)
    hf_model.save_pretrained(tmp_path, **({"max_shard_size": shard_size} if shard_size else {}))
    if shard_size:
        assert (tmp_path / "model.safetensors.index.json").is_file()
    model, config, model_dir = load_model(str(tmp_path), torch.float32, "cpu")
    assert model_dir == tmp_path and config.architectures == hf_model.config.architectures
    ids = torch.randint(0, SMALL["vocab_size"], (37,), generator=torch.Generator().manual_seed(1))
    assert_close_relative(prefill_logits(model, ids), hf_logits(hf_model, ids))


def test_missing_checkpoint_tensor_is_named(tmp_path):
    hf_model = random_hf_model(Qwen2Config, dict(num_key_value_heads=2))
    hf_model.save_pretrained(tmp_path)
    model, _, _ = load_model(str(tmp_path), torch.float32, "cpu", load_format="dummy")
    weights = {k: v for k, v in hf_model.state_dict().items() if k != "model.layers.1.self_attn.k_proj.bias"}
    with pytest.raises(ValueError, match=r"model.layers.1.self_attn.qkv_proj.bias\[k_proj\]"):
        model.load_weights(weights.items())
    weights["model.layers.0.extra.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match="model.layers.0.extra.weight"):
        model.load_weights(weights.items())


def test_dummy_weights_are_seeded(tmp_path):
    random_hf_model(Qwen3Config, dict(num_key_value_heads=2, head_dim=16)).config.save_pretrained(tmp_path)
    a, _, _ = load_model(str(tmp_path), torch.float32, "cpu", load_format="dummy", seed=3)
    b, _, _ = load_model(str(tmp_path), torch.float32, "cpu", load_format="dummy", seed=3)
    c, _, _ = load_model(str(tmp_path), torch.float32, "cpu", load_format="dummy", seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.embed_tokens.weight"], sc["model.embed_tokens.weight"])
    assert torch.equal(sa["model.layers.0.self_attn.q_norm.weight"], torch.ones(16))
    logits = prefill_logits(a, torch.arange(20))
    assert torch.isfinite(logits).all() and logits.abs().max() < 10


def test_bf16_model_runs(tmp_path):
    random_hf_model(LlamaConfig, dict(num_key_value_heads=2)).save_pretrained(tmp_path)
    model, _, _ = load_model(str(tmp_path), torch.bfloat16, "cpu")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert torch.get_default_dtype() == torch.float32
    assert torch.isfinite(prefill_logits(model, torch.arange(20))).all()


# ---------------------------------------------------------------------------------------------------
# Clear errors
# ---------------------------------------------------------------------------------------------------
def test_unsupported_architecture_is_named(tmp_path):
    GPT2Config(architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        load_model(str(tmp_path), torch.float32, "cpu", load_format="dummy")


def test_unsupported_rope_type_is_named(tmp_path):
    config = LlamaConfig(**SMALL, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="'dynamic'"):
        load_model(str(tmp_path), torch.float32, "cpu", load_format="dummy")


def test_missing_paths_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_model(str(tmp_path / "nowhere"), torch.float32, "cpu")
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model(str(tmp_path))
    LlamaConfig(**SMALL, architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"no \*.safetensors"):
        load_model(str(tmp_path), torch.float32, "cpu")
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="model-00001-of-00002.safetensors"):
        load_model(str(tmp_path), torch.float32, "cpu")
    (tmp_path / "weights.bin").write_text("")
    with pytest.raises(ValueError, match="not a .gguf"):
        load_model(str(tmp_path / "weights.bin"), torch.float32, "cpu")


def test_bad_load_format(tmp_path):
    LlamaConfig(**SMALL, architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="'pt'.*auto"):
        load_model(str(tmp_path), torch.float32, "cpu", load_format="pt")
    with pytest.raises(ValueError, match="needs a .gguf file"):
        load_model(str(tmp_path), torch.float32, "cpu", load_format="gguf")
