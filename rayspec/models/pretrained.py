"""``save_pretrained`` / ``from_pretrained`` for rayspec's own small modules: a directory with ``config.json`` (the
constructor's keyword arguments) and ``model.safetensors``, the layout transformers uses."""

from __future__ import annotations

import json
import os

import torch

from .errors import ModelLoadError


class Pretrained:
    """Mixin for an ``nn.Module`` whose constructor takes only JSON-able keyword arguments, returned by
    :meth:`config_dict`. ``kind`` names the module in load errors."""

    kind = "model"

    def config_dict(self) -> dict:
        raise NotImplementedError

    def save_pretrained(self, path: str, dtype: torch.dtype | None = None) -> None:
        """Write ``config.json`` + ``model.safetensors`` into ``path`` (created if needed); ``dtype`` (e.g.
        float16) halves the storage of float tensors, :meth:`from_pretrained` loads them in its own dtype."""
        from safetensors.torch import save_file

        os.makedirs(path, exist_ok=True)
        tensors = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).cpu().contiguous()
                   for k, v in self.state_dict().items()}
        save_file(tensors, os.path.join(path, "model.safetensors"))
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(self.config_dict(), f, indent=2)

    @classmethod
    def from_pretrained(cls, path: str, device="cpu", dtype: torch.dtype = torch.float32):
        """Load a module written by :meth:`save_pretrained`, in eval mode.

        Raises:
            ModelLoadError: a missing directory or file, or a config this class does not accept.
        """
        from safetensors.torch import load_file

        files = [os.path.join(path, n) for n in ("config.json", "model.safetensors")]
        if not all(os.path.exists(f) for f in files):
            raise ModelLoadError(f"{path} is not a {cls.kind} directory (config.json + model.safetensors)")
        with open(files[0]) as f:
            cfg = json.load(f)
        try:
            module = cls(**cfg)
        except TypeError as e:
            raise ModelLoadError(f"{path}: config.json does not describe a {cls.kind}: {e}") from e
        module.load_state_dict(load_file(files[1]))
        return module.to(device=device, dtype=dtype).eval()
