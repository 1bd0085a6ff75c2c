"""Online transcription with continuous batching: requests join the running decode as they arrive.

Dynamic batching (Ray Serve's ``@serve.batch``) collects requests for a moment and decodes them as one batch: a request
that arrives while a batch decodes waits for all of it, and the batch shrinks as its rows finish. Here one engine
thread keeps a continuous batch (:meth:`~rayspec.spec_decode.loop.VerifyLoop.decode_stream`, Orca's iteration-level
scheduling, Yu et al. OSDI 2022): a request is encoded when a slot is free and joins before the next decoder pass,
and each request resolves as soon as its own rows finish. The decoded tokens are those of
:meth:`~rayspec.pipeline.Transcriber.transcribe` (rows do not depend on their neighbours).

Used by ``rayspec serve`` replicas (every method; callers in an event loop wrap the returned futures,
``asyncio.wrap_future``) and by the Ray job's actors (``actors/``: batches of utterances, or of encoded rows on a
target actor, join one continuous batch per actor).
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Union

import numpy as np

from .manifest import Utterance
from .pipeline import Transcriber


@dataclass
class _Request:
    item: Any
    future: Future


class StreamEngine:
    """A background thread that keeps one continuous batch fed from a queue of submitted items.

    The thread builds its worker (``build()``, e.g. a :class:`~rayspec.pipeline.Transcriber`) and then, whenever
    items are waiting, runs ``stream(worker, items, slots)``: a continuous-batching stream over the queue (items in
    submission order, None for "nothing waiting now"; see :meth:`~rayspec.pipeline.Transcriber.transcribe_stream`)
    that yields ``(k, result)`` per item, ``k`` its position among the items given, as the item finishes. Each
    submitted item resolves as soon as its own rows finish, while later items keep the batch full.

    Give it a builder rather than a loaded model where nothing else in the process runs torch: the models then load
    on the engine's thread, and every torch parallel region of the process runs on that one thread. Each thread that
    runs torch on CPU gets its own OpenMP team (libgomp), and with two teams on this 2-core machine a decode ran 21%
    slower (whisper-base, batch 1, 8 LJSpeech clips: 747 against 617 ms per clip with the model loaded on the main
    thread and decoded on another; 606-629 ms with both on the other thread, as on the main thread). The likely
    mechanism: libgomp spin-waits only briefly once it manages more threads than there are cores, so each parallel
    region waits for its team to wake.

    Args:
        build: builds the worker (called on the engine thread; the constructor waits for it and raises what it
            raises).
        stream: ``stream(worker, items, slots)`` as above. If it raises, the items it had started fail with that
            exception; later items start a new stream.
        slots: most rows decoded at once.

    Raises:
        ValueError: ``slots < 1``.
    """

    def __init__(self, build: Callable[[], Any], stream: Callable[[Any, Iterator[Any], int], Iterator[tuple[int, Any]]],
                 slots: int = 16) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.slots = slots
        self._stream = stream
        self._queue: deque[_Request] = deque()
        self._wake = threading.Condition()
        self._closed = False
        built: Future = Future()
        self._thread = threading.Thread(target=self._run, args=(build, built), name="rayspec-engine", daemon=True)
        self._thread.start()
        self.worker = built.result()

    def submit_item(self, item: Any) -> Future:
        """Queue one item for the stream.

        Returns:
            A future of ``(result, in_flight)``: the item's result and how many items were decoding when it
            finished (itself included); the stream's exception if the stream raised while the item was in it.

        Raises:
            RuntimeError: the engine is closed.
        """
        request = _Request(item, Future())
        with self._wake:
            if self._closed:
                raise RuntimeError("the transcription engine is closed")
            self._queue.append(request)
            self._wake.notify()
        return request.future

    def close(self) -> None:
        """Stop the thread after the items in flight; queued items not yet started fail with RuntimeError."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join()
        while self._queue:
            self._queue.popleft().future.set_exception(RuntimeError("the transcription engine was closed"))

    def _run(self, build, built: Future) -> None:
        try:  # the constructor sets self.worker from ``built`` before any item can arrive
            built.set_result(build())
        except BaseException as exc:  # handed to the constructor, which raises it
            built.set_exception(exc)
            return
        while True:
            with self._wake:
                while not self._queue and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
            self._burst()

    def _next(self) -> Optional[_Request]:
        with self._wake:
            return self._queue.popleft() if self._queue and not self._closed else None

    def _burst(self) -> None:
        """Decode until no item is in flight or waiting."""
        started: dict[int, _Request] = {}  # stream position -> request

        def items():
            for k in itertools.count():
                req = self._next()
                while req is None:
                    yield None  # nothing waiting now: decoding goes on with the live rows
                    req = self._next()
                started[k] = req
                yield req.item

        try:
            for k, result in self._stream(self.worker, items(), self.slots):
                req = started.pop(k)
                req.future.set_result((result, len(started) + 1))
        except Exception as exc:  # noqa: BLE001 - handed to the callers of the items in flight
            for req in started.values():
                req.future.set_exception(exc)


class TranscriptionEngine(StreamEngine):
    """A :class:`StreamEngine` over waveforms or batches of utterances, decoded by a
    :class:`~rayspec.pipeline.Transcriber` (:meth:`~rayspec.pipeline.Transcriber.transcribe_stream`, which turns
    failures into error rows).

    Args:
        transcriber: the models and decoding options, or a function that builds them (called on the engine thread;
            see :class:`StreamEngine` for why a function is better).
        slots: most rows (speech segments) decoded at once.

    Raises:
        ValueError: ``slots < 1``.
    """

    def __init__(self, transcriber: Union[Transcriber, Callable[[], Transcriber]], slots: int = 16) -> None:
        build = (lambda: transcriber) if isinstance(transcriber, Transcriber) else transcriber
        super().__init__(build, lambda t, items, n: t.transcribe_stream(items, n), slots)
        self.transcriber: Transcriber = self.worker

    def submit(self, utterance: Utterance, audio: np.ndarray) -> Future:
        """Queue one waveform (mono float32 at the target's sample rate).

        Returns:
            A future of ``(row, in_flight)``: the :class:`~rayspec.results.ResultRow` (an error row if decoding
            failed, never an exception) and how many requests were decoding when it finished (itself included).

        Raises:
            RuntimeError: the engine is closed.
        """
        future: Future = Future()

        def done(f: Future) -> None:
            if f.exception() is not None:
                future.set_exception(f.exception())
            else:
                rows, in_flight = f.result()
                future.set_result((rows[0], in_flight))

        self.submit_item(([utterance], [audio])).add_done_callback(done)
        return future

    def submit_batch(self, utterances: list[Utterance], audios: Optional[list[np.ndarray]] = None) -> Future:
        """Queue one batch (as :meth:`~rayspec.pipeline.Transcriber.transcribe` takes it: ``audios`` None loads each
        utterance's file with the transcriber's limits when the batch's rows are wanted).

        Returns:
            A future of ``(rows, in_flight)``: one :class:`~rayspec.results.ResultRow` per utterance, in order.

        Raises:
            RuntimeError: the engine is closed.
        """
        return self.submit_item((utterances, audios))
