"""The shared copy streams (vramkit.memory.transfer): the host stand-in and its log, the
process-wide registry, and (on a GPU) real streams and events."""

from __future__ import annotations

import pytest
import torch

from vramkit.memory.transfer import (
    CudaStreams,
    HostStreams,
    StreamOp,
    Streams,
    transfer_streams,
)


def test_host_streams_copy_at_once_and_log_every_op() -> None:
    log: list[StreamOp] = []
    streams = HostStreams(log=log)
    assert isinstance(streams, Streams)
    src = torch.arange(6, dtype=torch.float32)
    dst = torch.zeros(6)
    ready = streams.event()
    streams.wait(streams.h2d, ready)
    streams.copy(dst, src, streams.h2d, "blocks.0")
    assert torch.equal(dst, src)  # synchronous: no event needed to see the bytes
    streams.record(ready, streams.h2d)
    streams.synchronize(ready)
    assert [(op.kind, op.stream, op.event, op.what) for op in log] == [
        ("wait", "h2d", ready.id, ""),
        ("copy", "h2d", None, "blocks.0"),
        ("record", "h2d", ready.id, ""),
        ("sync", "compute", ready.id, ""),
    ]
    assert streams.done(ready)
    assert ready.recorded == 1


def test_host_streams_events_are_distinct_and_count_records() -> None:
    streams = HostStreams()
    a, b = streams.event(), streams.event()
    assert a.id != b.id
    streams.record(a, streams.d2h)
    streams.record(a, streams.current())
    assert (a.recorded, b.recorded) == (2, 0)
    assert streams.done(b)  # a host event never blocks


def test_host_streams_without_log_keep_nothing() -> None:
    streams = HostStreams()
    assert streams.log is None
    dst = torch.zeros(2)
    streams.copy(dst, torch.ones(2), streams.d2h)
    assert torch.equal(dst, torch.ones(2))


def test_on_switches_the_current_stream_and_nests() -> None:
    log: list[StreamOp] = []
    streams = HostStreams(log=log)
    compute = streams.current()
    assert compute.name == "compute"
    with streams.on(streams.h2d) as s:
        assert s is streams.h2d and streams.current() is streams.h2d
        with streams.on(streams.d2h):
            assert streams.current() is streams.d2h
            streams.synchronize(streams.event())
        assert streams.current() is streams.h2d
    assert streams.current() is compute
    with pytest.raises(RuntimeError), streams.on(streams.d2h):
        raise RuntimeError("boom")
    assert streams.current() is compute  # popped on error too
    assert log[0].kind == "sync" and log[0].stream == "d2h"


def test_transfer_streams_are_shared_per_device() -> None:
    a = transfer_streams("cpu")
    b = transfer_streams(torch.device("cpu"))
    assert a is b
    assert isinstance(a, HostStreams)
    assert a.device == torch.device("cpu")


def test_transfer_streams_reject_other_device_types() -> None:
    with pytest.raises(ValueError):
        transfer_streams("meta")


@pytest.mark.gpu
def test_cuda_streams_copy_asynchronously_and_order_by_events() -> None:
    streams = transfer_streams("cuda")
    assert isinstance(streams, CudaStreams)
    assert streams is transfer_streams(torch.device("cuda", torch.cuda.current_device()))
    assert streams.h2d != streams.current() and streams.d2h != streams.h2d
    host = torch.arange(1 << 20, dtype=torch.float32).pin_memory()
    dev = torch.empty_like(host, device=streams.device)
    loaded = streams.event()
    streams.copy(dev, host, streams.h2d, "test")
    streams.record(loaded, streams.h2d)
    streams.wait(streams.current(), loaded)
    result = dev * 2  # on the compute stream, after the copy
    back = torch.empty_like(host).pin_memory()
    computed = streams.event()
    streams.record(computed, streams.current())
    streams.wait(streams.d2h, computed)
    streams.copy(back, result, streams.d2h, "test")
    done = streams.event()
    streams.record(done, streams.d2h)
    streams.synchronize(done)
    assert streams.done(done)
    assert torch.equal(back, host * 2)
    with streams.on(streams.h2d):
        assert torch.cuda.current_stream() == streams.h2d


@pytest.mark.gpu
def test_cuda_streams_fast_paths_keep_the_callers_stream() -> None:
    # copy() sets the copy stream directly (not through torch.cuda.stream) and current() reuses
    # the stream object while the raw handle is unchanged: both must follow the caller's
    # stream and restore it, also when the copy fails.
    streams = transfer_streams("cuda")
    side = torch.cuda.Stream(streams.device)
    host = torch.arange(4096, dtype=torch.float32).pin_memory()
    dev = torch.empty_like(host, device=streams.device)
    before = streams.current()
    with torch.cuda.stream(side):
        assert streams.current() == side  # a new current stream is seen at once
        streams.copy(dev, host, streams.h2d, "test")
        assert torch.cuda.current_stream(streams.device) == side
        with pytest.raises(RuntimeError):
            streams.copy(dev[:10], host, streams.h2d, "shape mismatch")
        assert torch.cuda.current_stream(streams.device) == side
    assert streams.current() == before
    loaded = streams.event()
    streams.record(loaded, streams.h2d)
    streams.wait(streams.current(), loaded)
    assert torch.equal((dev + 0).cpu(), host)
