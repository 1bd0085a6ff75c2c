"""The KV cache's slot writes (rayspec.models.cache.write_slots): what ``scatter_`` along the slot axis writes, in
every dtype a decoder caches in, for one token or several per row, through strided values."""

import pytest
import torch

from rayspec.models.cache import write_slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b, q", [(1, 1), (5, 1), (3, 4)])
def test_write_slots_writes_what_scatter_writes(dtype, b, q):
    g = torch.Generator().manual_seed(b * 10 + q)
    h, c, d = 4, 24, 8
    layer = torch.randn(b, h, c, d, generator=g).to(dtype)
    expected = layer.clone()
    slots = torch.stack([torch.randperm(c, generator=g)[:q] for _ in range(b)])
    values = torch.randn(b, q, h * d, generator=g).to(dtype).view(b, q, h, d).transpose(1, 2)  # heads, strided
    expected.scatter_(2, slots[:, None, :, None].expand(b, h, q, d), values)
    write_slots(layer, slots, values)
    assert torch.equal(layer, expected)
