"""Linear layers for CPU inference through oneDNN-packed weights.

A decoder step multiplies a few rows (batch x new tokens) against each weight. On a CPU, MKL's ``F.linear`` is
fastest for one row, but from two rows on it re-reads the weight in a layout made for large products, so a target
pass over a speculative draft cost ~1.75x a one-token step (whisper-base, batch 1, 2 threads: 25.9 vs 15.1 ms for 10
vs 1 new tokens). oneDNN's linear over a weight reordered once into its blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``, the layout ``torch.compile`` packs CPU linears into) reads it at memory
speed for any row count: the same passes cost 16.1 vs 12.7 ms. The reordered copy is made on first use and kept
beside the weight (weakly keyed: it goes when the weight goes) until the weight changes. Models that only run
inference (rayspec's engine) replace their layers by :class:`PackedLinear` instead (:func:`pack_linears`), which
keeps the packed copy alone, so packing costs no memory.

oneDNN's call costs a fixed ~15-20 us, so small products stay with ``F.linear``: float32 weights of fewer than
:data:`MIN_ELEMENTS` elements, or products of fewer than :data:`MIN_WORK` weight elements x rows (one row against
a 512 x 512 weight: 24 vs 30 us; 2 rows: 45 vs 34 us). bfloat16 products go through oneDNN from
:data:`MIN_ELEMENTS_BF16` elements at any row count (MKL has no fast bfloat16 product here: one row against
1024 x 256, 49 vs 23 us).

The compute type int8 (:mod:`rayspec.compute`) replaces these layers by :class:`Int8Linear` (fbgemm's int8 products,
per-row activation scales) and gives the output projection a :class:`Float16RowLinear`; both compute a row the same
whatever rows share its product.

The two kernels may round differently in the last bits, so a float32 result may depend on how many rows went through
the product with it; speculation stays exact only as far as the argmax does not flip on such rounding, which the
exactness tests (tests/test_decoding_tiny.py, tests/test_real_whisper.py) check across batch sizes and drafts. A
bfloat16 decoder on a CPU runs its products in blocks of at most :data:`REDUCTION_BLOCK` inputs instead
(:func:`linear_in_blocks`, :mod:`rayspec.models.invariant`), which gives a row the same bits at any row count.
"""

from __future__ import annotations

import os
import warnings
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakTensorKeyDictionary

MIN_ELEMENTS = 1 << 17  # float32 weights below this many elements always use F.linear
MIN_WORK = 1 << 19  # ... and products below this many weight elements x rows
MIN_ELEMENTS_BF16 = 1 << 16  # bfloat16 weights from this many elements use oneDNN at any row count
# Int8Linear's activation quantization of rows scaled to [-1, 1]: what PyTorch's dynamic linear picks for that range
# with reduce_range (7 bits: 0 .. 127, scale (1 - -1) / 127, zero point round(63.5) = 64)
ACT_SCALE, ACT_ZERO_POINT = 2 / 127, 64

_AVAILABLE = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
# oneDNN's bfloat16 reorder needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT: elsewhere bfloat16 weights stay unpacked
_BF16 = _AVAILABLE and hasattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported") and bool(
    torch.ops.mkldnn._is_mkldnn_bf16_supported())
_PACKED = WeakTensorKeyDictionary()  # weight -> (its (data_ptr, version) when packed, the packed copy)
_BLOCKS = WeakTensorKeyDictionary()  # weight -> (its (data_ptr, version, block), its blocks: see linear_in_blocks)
REDUCTION_BLOCK = 1024
"""Most inputs per product in :func:`linear_in_blocks` (row-invariant decoder products, :mod:`rayspec.models.
invariant`)."""


def _packable(weight: torch.Tensor) -> bool:
    """A CPU weight large enough for oneDNN: float32 from MIN_ELEMENTS elements, bfloat16 from MIN_ELEMENTS_BF16."""
    n = weight.numel()
    fp32, bf16 = weight.dtype == torch.float32, weight.dtype == torch.bfloat16
    return _AVAILABLE and weight.device.type == "cpu" and (
        (fp32 and n >= MIN_ELEMENTS) or (bf16 and _BF16 and n >= MIN_ELEMENTS_BF16))


def _uses_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    if torch.is_grad_enabled() or x.dtype != weight.dtype or x.device.type != "cpu" or not _packable(weight):
        return False
    return weight.dtype == torch.bfloat16 or weight.numel() * (x.numel() // x.shape[-1]) >= MIN_WORK


def _packed(weight: torch.Tensor) -> torch.Tensor:
    # an inference tensor (made under inference_mode) has no version counter: its data pointer alone is the key
    key = (weight.data_ptr(), None if weight.is_inference() else weight._version)
    entry = _PACKED.get(weight)
    if entry is None or entry[0] != key:
        entry = (key, torch.ops.mkldnn._reorder_linear_weight(weight.detach()))
        _PACKED[weight] = entry
    return entry[1]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: ``x`` ``[..., in]``, ``weight`` ``[out, in]``, ``bias`` ``[out]`` or None ->
    ``[..., out]`` in ``x``'s dtype. On a CPU without autograd (``no_grad`` / ``inference_mode``) products large
    enough to gain (see the module docstring) run through a oneDNN-packed copy of ``weight``; anything else, and
    every product that needs gradients, through ``F.linear`` itself."""
    if _uses_onednn(x, weight):
        return torch.ops.mkldnn._linear_pointwise(x, _packed(weight), bias, "none", [], "")
    return F.linear(x, weight, bias)


def _fusable(layer: torch.nn.Module, x: torch.Tensor) -> Optional[torch.Tensor]:
    """The packed float32 weight through which :func:`linear_layer` runs ``layer`` on ``x`` with oneDNN, or None."""
    if torch.is_grad_enabled() or x.dtype != torch.float32:
        return None
    if type(layer) is PackedLinear:
        return layer.packed if layer.packed.dtype == torch.float32 and layer.reduction_block is None else None
    if type(layer) is torch.nn.Linear and _uses_onednn(x, layer.weight):
        return _packed(layer.weight)
    return None


def linear_gelu(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``F.gelu(linear_layer(layer, x))`` (exact erf GELU): float ``[..., in]`` -> ``[..., out]``. A float32 product
    through oneDNN runs the GELU as the product's post-op, in one pass over the output: bitwise the separate ops'
    result (checked with AVX-512 and with AVX2 kernels), and whisper-base's encoder fc1 at 1,500 positions, 2 threads,
    ~6 ms faster. Other types keep the two ops (oneDNN's bfloat16 post-op rounds once, not twice)."""
    w = _fusable(layer, x)
    if w is None:
        return F.gelu(linear_layer(layer, x))
    return torch.ops.mkldnn._linear_pointwise(x, w, layer.bias, "gelu", [], "none")


def linear_add(layer: torch.nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """``residual + linear_layer(layer, x)``: ``x`` ``[..., in]``, ``residual`` ``[..., out]`` (the output's shape and
    dtype) -> ``[..., out]``. A float32 product through oneDNN adds ``residual`` as the product's post-op: bitwise the
    separate ops' result (float addition is commutative), without a second pass over the output."""
    w = _fusable(layer, x)
    if w is None or residual.shape[:-1] != x.shape[:-1] or not residual.is_contiguous():
        return residual + linear_layer(layer, x)
    return torch.ops.mkldnn._linear_pointwise.binary(x, residual, w, layer.bias, "add")


class PackedLinear(torch.nn.Module):
    """An inference-only ``nn.Linear`` that holds only oneDNN's packed copy of its weight (no float32 original, so
    packing costs no memory): ``forward`` maps ``[..., in]`` -> ``[..., out]``; no gradients flow through it.

    Args:
        layer: the ``nn.Linear`` to replace (CPU, float32 or bfloat16); its weight is copied, its bias shared.
        reduction_block: if set and the layer has more inputs, the weight is packed as blocks of this many inputs
            and ``forward`` sums their products in order (:func:`linear_in_blocks`).
    """

    def __init__(self, layer: torch.nn.Linear, reduction_block: Optional[int] = None) -> None:
        super().__init__()
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.reduction_block = reduction_block if reduction_block and layer.in_features > reduction_block else None
        blocks = layer.weight.detach().split(self.reduction_block or layer.in_features, 1)
        # [out, in] (or [out, block] each), oneDNN layout
        self.blocks = [torch.ops.mkldnn._reorder_linear_weight(w.contiguous()) for w in blocks]
        self.packed = self.blocks[0]
        self.bias = layer.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T + b`` on the packed weight: float ``[..., in_features]`` -> ``[..., out_features]``."""
        if self.reduction_block is None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        n = self.reduction_block
        return _sum_blocks([torch.ops.mkldnn._linear_pointwise(x[..., i * n:(i + 1) * n], w,
                                                               self.bias if i == 0 else None, "none", [], "")
                            for i, w in enumerate(self.blocks)])


def _sum_blocks(parts: list[torch.Tensor]) -> torch.Tensor:
    out = parts[0]
    for part in parts[1:]:
        out = out + part
    return out


def linear_in_blocks(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``linear_layer(layer, x)`` with the inputs reduced in blocks of at most :data:`REDUCTION_BLOCK` inputs, one
    product per block, the blocks' results summed in order (the bias in the first): float ``[..., in]`` ->
    ``[..., out]``. A row then gets the same bits whatever rows share the product where products over that many
    inputs are row-invariant and larger ones are not (:mod:`rayspec.models.invariant`).

    Raises:
        ValueError: a :class:`PackedLinear` with more inputs than :data:`REDUCTION_BLOCK` packed without blocks.
    """
    if layer.in_features <= REDUCTION_BLOCK or type(layer) is Int8Linear:  # int8 products are row-invariant as they are
        return linear_layer(layer, x)
    if type(layer) is PackedLinear:
        if layer.reduction_block is None:
            raise ValueError(f"a layer of {layer.in_features} inputs packed without reduction blocks of "
                             f"{REDUCTION_BLOCK}")
        return layer.forward(x)
    # with gradients: views of the weight (gradients flow to it); without: contiguous copies, packed once each
    weights = (layer.weight.split(REDUCTION_BLOCK, 1) if torch.is_grad_enabled() else
               _weight_blocks(layer.weight, REDUCTION_BLOCK))
    return _sum_blocks([linear(xb, wb, layer.bias if i == 0 else None)
                        for i, (xb, wb) in enumerate(zip(x.split(REDUCTION_BLOCK, -1), weights))])


def _weight_blocks(weight: torch.Tensor, block: int) -> list[torch.Tensor]:
    """Contiguous copies of ``weight``'s blocks of ``block`` inputs, made once per weight (and kept beside it, weakly
    keyed, until it changes), so that :func:`linear` packs each once."""
    key = (weight.data_ptr(), None if weight.is_inference() else weight._version, block)
    entry = _BLOCKS.get(weight)
    if entry is None or entry[0] != key:
        entry = (key, [w.contiguous() for w in weight.detach().split(block, 1)])
        _BLOCKS[weight] = entry
    return entry[1]


def pack_linears(module: torch.nn.Module, reduction_block: Optional[int] = None) -> int:
    """Replace, in place, every ``nn.Linear`` under ``module`` whose weight :func:`linear` would pack (CPU, float32
    with at least :data:`MIN_ELEMENTS` elements, or bfloat16 with :data:`MIN_ELEMENTS_BF16`) by a
    :class:`PackedLinear` (packed in blocks of ``reduction_block`` inputs if given: :func:`linear_in_blocks`),
    freeing the dense weights: for models that only run inference (rayspec's engine), never for training. A no-op
    without oneDNN. Returns how many layers were replaced."""
    swaps = [(parent, name) for parent in module.modules() for name, child in parent.named_children()
             if type(child) is torch.nn.Linear and _packable(child.weight)]
    for parent, name in swaps:  # one at a time, so that each dense weight can go before the next is packed
        setattr(parent, name, PackedLinear(getattr(parent, name), reduction_block))
    return len(swaps)


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A linear weight ``[out, in]`` quantized per output channel, symmetric (:class:`Int8Linear`): int8 ``[out, in]``
    (``round(w / scale)``, as ``torch.quantize_per_channel`` rounds) and the float32 scales ``[out]`` (each row's
    largest magnitude / 127). A row's result does not depend on the other rows: rows quantized together (fused
    products) equal rows quantized alone."""
    w = weight.detach().float()
    scale = w.abs().amax(1).clamp_min(1e-12) / 127
    with warnings.catch_warnings():  # quantized tensors are deprecated (see Int8Linear)
        warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*deprecated")
        qw = torch.quantize_per_channel(w, scale.double(), torch.zeros(len(w), dtype=torch.long), 0, torch.qint8)
    return qw.int_repr(), scale


class Int8Linear(torch.nn.Module):
    """An inference-only ``nn.Linear`` in int8 (compute type ``int8``): weights quantized per output channel
    (symmetric, scale = the row's largest magnitude / 127), activations quantized per row (per token) as they come,
    products in integers through fbgemm's int8 linear (x86), the result scaled back to float32.

    Per-row activation scales make a row's result independent of the other rows in the product (the integer sums are
    exact), so a one-token decoder step and a multi-token verification pass give a token bitwise the same logits:
    every exact method stays exact at int8. Each row is divided by its largest magnitude, so that its values lie in
    [-1, 1], and quantized with one fixed scale and zero point, those PyTorch's dynamic int8 linear chooses for an input
    of range [-1, 1] (scale 2/127, zero point 64: activations take 7 bits, ``reduce_range``, which keeps fbgemm's AVX2
    kernels from saturating their 16-bit pair sums, as PyTorch's x86 dynamic quantization does); the row's magnitude
    multiplies the result afterwards (the bias added last). The fixed parameters go to fbgemm's
    ``quantized::linear_with_input_q_dq_qweight_dq_output_fp32``, the dynamic linear's kernel without its pass
    over the input for the range: the same results bit for bit as the dynamic linear over the scaled rows with a row
    of +1 and -1 appended to pin the range (this class's first form), without that pass, the copy and the extra row
    (whisper-base's encoder, 1,500 rows, AVX2, 2 threads: see ``docs/benchmarks/peers.md``). PyTorch 2.13 marks
    quantized tensors (which fbgemm's prepacking takes) deprecated, to be removed in a later release: the warning is
    silenced here, and this class will need another int8 kernel when the pinned PyTorch moves on.

    Args:
        layer: the ``nn.Linear`` to replace (CPU, float32); its weight is quantized (:func:`quantize_weight`; the
            float weight is not kept), its bias shared.
        quantized, bias: instead of ``layer``, a weight already quantized by :func:`quantize_weight` (int8
            ``[out, in]``, float32 scales ``[out]``: e.g. read back from :func:`quantize_linears`' cache) and the
            float32 bias ``[out]`` or None.

    Raises:
        ValueError: both or neither of ``layer`` and ``quantized``.
    """

    def __init__(self, layer: Optional[torch.nn.Linear] = None, *, quantized: Optional[tuple] = None,
                 bias: Optional[torch.Tensor] = None) -> None:
        super().__init__()
        if (layer is None) == (quantized is None):
            raise ValueError("Int8Linear takes a linear layer or its quantized weight, not both or neither")
        if layer is not None:
            quantized, bias = quantize_weight(layer.weight), layer.bias
        weight, scale = quantized
        self.out_features, self.in_features = weight.shape
        with warnings.catch_warnings():  # quantized tensors are deprecated (see the class docstring)
            warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*deprecated")
            qw = torch._make_per_channel_quantized_tensor(weight, scale.double(), torch.zeros(len(weight),
                                                                                              dtype=torch.long), 0)
        self.packed = torch.ops.quantized.linear_prepack(qw, None)
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """float32 ``[..., in_features]`` -> float32 ``[..., out_features]`` (see the class docstring)."""
        rows = x.reshape(-1, self.in_features)
        # each row's largest magnitude: abs + amax reads a row twice yet runs ~4x faster than aminmax + maximum here
        # (1,500 x 512, 2 threads, AVX2: 0.23 vs 1.0 ms), the same values
        mag = rows.abs().amax(-1, keepdim=True).clamp_min_(1e-30)
        y = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(rows / mag, ACT_SCALE, ACT_ZERO_POINT,
                                                                             self.packed)
        y = y.mul_(mag) if self.bias is None else torch.addcmul(self.bias, y, mag)
        return y.view(*x.shape[:-1], self.out_features)


class Float16RowLinear(torch.nn.Module):
    """An inference-only, bias-free ``nn.Linear`` whose weight is held in float16 (fbgemm's packed layout; float32
    activations and sums): the int8 compute type's output projection (:meth:`WhisperASR.project
    <rayspec.models.whisper.WhisperASR.project>`), where int8 products lose too much (whisper-base, 99 held-out
    LJSpeech clips: WER 3.69% vs float32's 3.32%) and float16 weights read half float32's bytes (51,865 x 512, AVX2,
    one row: 1.9 ms vs oneDNN's float32 3.9 ms). fbgemm computes one row differently from a row among others, so
    every row runs as its own one-row product: a row's result never depends on the rows beside it.

    fbgemm's packing converts and lays out the weight one element at a time on one core (whisper-base's 51,865 x
    512: 0.45-0.65 s, AVX2), so with ``background`` it runs in a thread (the operator releases the GIL) while the
    process goes on (the other layers' packing, the tokenizer, the audio); the first :meth:`forward` waits for it.
    The packed weight is the same either way.

    Args:
        layer: the ``nn.Linear`` (CPU, float32, no bias) whose weight is copied.
        background: pack in a thread (see above) instead of before returning.

    Raises:
        ValueError: a layer with a bias.
    """

    def __init__(self, layer: torch.nn.Linear, background: bool = False) -> None:
        super().__init__()
        if layer.bias is not None:
            raise ValueError("Float16RowLinear takes a linear layer without bias")
        self.in_features, self.out_features = layer.in_features, layer.out_features
        weight = layer.weight.detach()
        self._packed = None
        self._packing = None
        if background:
            import concurrent.futures

            pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rayspec-fp16-pack")
            self._packing = pool.submit(torch.ops.quantized.linear_prepack_fp16, weight.float(), None)
            pool.shutdown(wait=False)
        else:
            self._packed = torch.ops.quantized.linear_prepack_fp16(weight.float(), None)

    @property
    def packed(self):
        """fbgemm's packed float16 weight (waits for a packing still under way; re-raises its error)."""
        if self._packed is None:
            self._packed, self._packing = self._packing.result(), None
        return self._packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """float32 ``[..., in_features]`` -> float32 ``[..., out_features]``, one product per row."""
        rows = x.reshape(-1, self.in_features)
        packed = self.packed
        out = torch.cat([torch.ops.quantized.linear_dynamic_fp16(r, packed) for r in rows.split(1)])
        return out.view(*x.shape[:-1], self.out_features)


INT8_FILE = "int8.safetensors"
"""The file of a :func:`quantize_linears` cache folder: ``NAME.weight`` (int8 ``[out, in]``) and ``NAME.scale``
(float32 ``[out]``) per quantized layer."""


def quantize_linears(module: torch.nn.Module,
                     fuse: Optional[Callable[[str, torch.nn.Module], dict[str, tuple[str, ...]]]] = None,
                     cache: Optional[str] = None) -> int:
    """Replace, in place, every float32 ``nn.Linear`` under ``module`` by an :class:`Int8Linear`: for models that
    only run inference. Returns how many :class:`Int8Linear` layers were made.

    Args:
        fuse: ``fuse(name, submodule)`` -> ``{new attribute: (linear attributes, ...)}``: linears of one submodule
            that read the same input become one :class:`Int8Linear` of their weights stacked by rows (e.g. an
            attention's ``q_proj``, ``k_proj``, ``v_proj`` -> ``qkv_proj``), and the separate layers are removed: one
            activation quantization and one product instead of several, each output column bitwise what its own
            layer gave (per-row activation scales, per-channel weight scales, exact integer sums). A layer missing
            or not float32 leaves its group unfused.
        cache: a folder holding the quantized weights of exactly this ``module`` as loaded (its checkpoint's cache
            key: see :meth:`WhisperASR.pack_for_inference <rayspec.models.whisper.WhisperASR.pack_for_inference>`):
            read from :data:`INT8_FILE` there, so that no float32 weight of a replaced layer is read or quantized
            (whisper-base, 2 threads, AVX2: its int8 packing 0.7-1.0 s instead of 1.0-1.3 s, the rest being fbgemm's
            prepacking and the output projection's float16 copy), or written there after quantizing
            (:func:`~rayspec.models.registry.build_cached`; an unwritable cache is skipped).
    """
    plan = []  # (name, parent, attribute, layers, attributes replaced)
    for pname, parent in module.named_modules():
        done = set()
        for attr, members in (fuse(pname, parent) if fuse else {}).items():
            layers = [getattr(parent, m, None) for m in members]
            if all(type(x) is torch.nn.Linear and x.weight.dtype == torch.float32 for x in layers):
                plan.append((f"{pname}.{attr}".lstrip("."), parent, attr, layers, members))
                done.update(members)
        plan += [(f"{pname}.{name}".lstrip("."), parent, name, [child], (name,))
                 for name, child in parent.named_children()
                 if name not in done and type(child) is torch.nn.Linear and child.weight.dtype == torch.float32]
    names = [p[0] for p in plan]
    quantized = _read_quantized(cache, names) if cache else None
    if quantized is None:
        quantized = {name: quantize_weight(torch.cat([x.weight for x in layers]) if len(layers) > 1 else
                                           layers[0].weight) for name, _, _, layers, _ in plan}
        if cache and plan:
            _write_quantized(cache, quantized)
    for name, parent, attr, layers, members in plan:  # one at a time: each float weight can go before the next
        biases = [x.bias for x in layers]
        bias = None if all(b is None for b in biases) else torch.cat(
            [b.detach() if b is not None else x.weight.new_zeros(x.out_features) for b, x in zip(biases, layers)])
        for m in members:
            delattr(parent, m)
        setattr(parent, attr, Int8Linear(quantized=quantized.pop(name), bias=bias))
    return len(plan)


def _read_quantized(folder: str, names: list[str]) -> Optional[dict]:
    """``{name: (int8 weight, float32 scale)}`` from ``folder``'s :data:`INT8_FILE`, or None where it is missing,
    unreadable or holds other layers."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        flat = load_file(os.path.join(folder, INT8_FILE))
    except (OSError, SafetensorError):
        return None
    if set(flat) != {f"{n}.{part}" for n in names for part in ("weight", "scale")}:
        return None
    return {n: (flat[f"{n}.weight"], flat[f"{n}.scale"]) for n in names}


def _write_quantized(folder: str, quantized: dict) -> None:
    """Write ``{name: (int8 weight, float32 scale)}`` to ``folder``/:data:`INT8_FILE` (made atomically); an
    unwritable cache is skipped with a warning."""
    from safetensors.torch import save_file

    from .errors import ModelLoadError
    from .registry import build_cached

    flat = {f"{n}.{part}": t.contiguous() for n, (w, s) in quantized.items() for part, t in (("weight", w),
                                                                                            ("scale", s))}
    try:
        build_cached(folder, lambda tmp: save_file(flat, os.path.join(tmp, INT8_FILE)),
                     lambda d: os.path.isfile(os.path.join(d, INT8_FILE)), "the int8 weights")
    except ModelLoadError as e:
        warnings.warn(f"int8 weights not cached: {e}", stacklevel=3)


def linear_layer(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)`` for an ``nn.Linear`` (through :func:`linear`, without the module call: what its ``forward``
    computes), a :class:`PackedLinear` or an :class:`Int8Linear`: float ``[..., in_features]`` ->
    ``[..., out_features]``."""
    if type(layer) is PackedLinear or type(layer) is Int8Linear:
        return layer.forward(x)  # no module call: these layers hold no hooks
    return linear(x, layer.weight, layer.bias)
