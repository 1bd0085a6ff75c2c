"""CUDA-graph capture of static-shape decoder steps (:class:`~rayspec.runner.static_step.StaticSteps`).

A captured graph replays a whole decoder step (whisper-base: ~190 kernels) with one launch from the host. Capture
follows PyTorch's recipe (``torch.cuda.graphs``, "CUDA Graphs" in the CUDA semantics notes): warm-up iterations on a
side stream first (lazy initialisation, cuBLAS workspaces and autotuning happen outside the capture), then
``torch.cuda.graph`` with static inputs (the step's :class:`~rayspec.runner.static_step.StepInputs`) and a static
output (the hidden states the capture allocated). All graphs of a model share one memory pool, captured from the
largest bucket down, so the smaller ones reuse the larger ones' blocks (vLLM's order).
"""

from __future__ import annotations

import torch

from .attention import decode_attention


class CapturedStep:
    """One captured step: :meth:`replay` reruns it on whatever its input buffers hold now and returns its output
    buffers (what the captured function returned, e.g. float ``[Bb, Qb, D]``; overwritten by the next replay)."""

    def __init__(self, graph: "torch.cuda.CUDAGraph", output) -> None:
        self.graph, self.output = graph, output

    def replay(self):
        self.graph.replay()
        return self.output


def capture_steps(steps, keys: list[tuple[int, int]], warmup: int = 2, step=None) -> dict:
    """Capture ``step`` (default ``steps.step``; e.g. ``steps.head_step``) for every ``(batch bucket, query bucket)``
    in ``keys`` (largest first).

    The warm-up and captured steps write keys/values into the slots at rows whose committed lengths are 0: call
    this while no cache holds the slots (:meth:`StaticSteps.warm_up` checks).

    Returns:
        ``{(bb, qb): CapturedStep}``.

    Raises:
        RuntimeError: not a CUDA device.
    """
    dev = steps.device
    if dev.type != "cuda":
        raise RuntimeError("CUDA graphs need a CUDA device")
    step = step or steps.step
    pool = steps.graph_pool()
    graphs = {}
    side = torch.cuda.Stream(dev)
    with decode_attention(dev):
        for bb, qb in keys:
            inputs = steps.inputs(bb, qb)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                for _ in range(warmup):
                    step(inputs)
            torch.cuda.current_stream(dev).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = step(inputs)
            graphs[(bb, qb)] = CapturedStep(graph, out)
    torch.cuda.synchronize(dev)
    return graphs
