"""Checkpoint paths that are not safetensors checkpoints fail fast, say what they are and what
to do: FIFOs, sockets, devices, link loops, dangling links, permissions, directories without
safetensors, diffusers pipeline roots, Hugging Face repo ids, pickle checkpoints."""

from __future__ import annotations

import errno
import json
import os
import pickle
import socket
import stat
import struct
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from vramkit.errors import SafetensorsFormatError, VramkitError
from vramkit.io import _paths
from vramkit.io._header import read_header, read_index
from vramkit.io.lazy import LazySafetensors, resolve_checkpoint
from vramkit.io.loader import MemoryEfficientLoader, load_into

FAST_S = 5.0  # a path check takes microseconds; a blocking open() never returns


def outcome_within(call: Callable[[], Any], fifo: Path | None = None,
                   seconds: float = FAST_S) -> BaseException | None:
    """Run ``call`` in a thread and return what it raised (None if nothing); fail when it has
    not returned after ``seconds``. A thread stuck opening ``fifo`` is released by opening the
    FIFO's write end, so a regression fails this test instead of hanging the suite."""
    result: list[BaseException | None] = []

    def target() -> None:
        try:
            call()
            result.append(None)
        except BaseException as err:  # handed to the test
            result.append(err)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        if fifo is not None:
            try:  # a reader blocked in open() gets its writer and returns
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
            thread.join(seconds)
        pytest.fail(f"{call} did not return within {seconds} s (blocked opening a FIFO?)")
    return result[0]


def path_error(call: Callable[[], Any], kind: str, fifo: Path | None = None) -> SafetensorsFormatError:
    err = outcome_within(call, fifo)
    assert isinstance(err, SafetensorsFormatError), f"expected a vramkit error, got {err!r}"
    assert isinstance(err, VramkitError)
    assert getattr(err, "kind", None) == kind, (kind, err)
    assert err.hint and "hint:" in str(err)
    return err


@pytest.fixture
def good(tmp_path: Path) -> Path:
    save_file({"w": torch.arange(6.0).reshape(2, 3)}, tmp_path / "good.safetensors")
    return tmp_path / "good.safetensors"


def entry_points(path: Path) -> dict[str, Callable[[], Any]]:
    """Every public way a path reaches the readers."""
    return {
        "LazySafetensors.open": lambda: LazySafetensors.open(path),
        "load_safetensors": lambda: MemoryEfficientLoader("cpu").load_safetensors(path),
        "load_into": lambda: load_into(torch.nn.Linear(3, 2), path),
        "read_header": lambda: read_header(path),
    }


# -- not regular files -----------------------------------------------------------------------


@pytest.fixture
def fifo(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "model.safetensors"
    os.mkfifo(path)
    yield path


@pytest.mark.parametrize("how", ["LazySafetensors.open", "load_safetensors", "load_into",
                                 "read_header"])
def test_fifo_fails_fast_everywhere(fifo: Path, how: str) -> None:
    err = path_error(entry_points(fifo)[how], "fifo", fifo)
    assert str(fifo) in err.message and "named pipe (FIFO)" in err.message
    assert "save the stream to a file" in err.hint


def test_fifo_swapped_in_after_the_check_does_not_block(fifo: Path,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        good: Path) -> None:
    # The race: the path was a regular file when stat() looked, a FIFO when open() runs.
    # open_file opens with O_NONBLOCK and checks again with fstat.
    regular = os.stat(good)
    monkeypatch.setattr(_paths, "check_path", lambda path: regular)
    err = path_error(lambda: _paths.open_file(fifo), "fifo", fifo)
    assert "named pipe" in err.message


def test_fifo_index_and_fifo_shard(tmp_path: Path) -> None:
    index = tmp_path / "model.safetensors.index.json"
    os.mkfifo(index)
    err = path_error(lambda: LazySafetensors.open(tmp_path), "fifo", index)
    assert "model.safetensors.index.json" in err.message
    index.unlink()
    save_file({"a": torch.ones(2)}, tmp_path / "model-00001-of-00002.safetensors")
    shard = tmp_path / "model-00002-of-00002.safetensors"
    os.mkfifo(shard)
    # without an index: the FIFO shard is named, not silently skipped
    err = path_error(lambda: LazySafetensors.open(tmp_path), "fifo", shard)
    assert "model-00002-of-00002.safetensors" in err.message
    # through an index
    index.write_text(json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors",
                                                "b": "model-00002-of-00002.safetensors"}}))
    err = path_error(lambda: LazySafetensors.open(index), "fifo", shard)
    assert "model-00002-of-00002.safetensors" in err.message


def test_unix_socket(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    server = socket.socket(socket.AF_UNIX)
    try:
        server.bind(str(path))
        for call in entry_points(path).values():
            err = path_error(call, "socket")
            assert "Unix socket" in err.message and "not a regular file" in err.message
    finally:
        server.close()


@pytest.mark.skipif(not os.path.exists("/dev/null"), reason="no /dev/null")
def test_device_file() -> None:
    path = Path("/dev/null")
    for call in entry_points(path).values():
        err = path_error(call, "char-device")
        assert "/dev/null" in err.message and "character device" in err.message
        assert ".safetensors file" in err.hint


def test_a_directory_where_a_file_is_expected(tmp_path: Path) -> None:
    (tmp_path / "shard.safetensors").mkdir()
    err = path_error(lambda: read_header(tmp_path / "shard.safetensors"), "directory")
    assert "is a directory" in err.message


# -- paths that lead nowhere -----------------------------------------------------------------


def test_symlink_loop_is_a_vramkit_error(tmp_path: Path) -> None:
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    os.symlink(b, a)
    os.symlink(a, b)
    for call in entry_points(a).values():
        err = path_error(call, "symlink-loop")
        assert "symbolic-link loop" in err.message and "a.safetensors" in err.message
        assert "b.safetensors" in err.message  # the chain is shown
        assert "links" in err.hint
        assert not isinstance(err, FileNotFoundError)  # it is not a missing file


def test_symlink_loop_among_the_shards_is_named(tmp_path: Path) -> None:
    save_file({"a": torch.ones(2)}, tmp_path / "model-1.safetensors")
    os.symlink(tmp_path / "model-2.safetensors", tmp_path / "model-2.safetensors")
    err = path_error(lambda: LazySafetensors.open(tmp_path), "symlink-loop")
    assert "model-2.safetensors" in err.message


def test_dangling_symlink(tmp_path: Path) -> None:
    link = tmp_path / "model.safetensors"
    os.symlink(tmp_path / "blobs" / "gone", link)
    err = path_error(lambda: LazySafetensors.open(link), "dangling-symlink")
    assert "symbolic link to" in err.message and "does not exist" in err.message
    assert "download" in err.hint
    assert isinstance(err, FileNotFoundError)


def test_missing_file_is_a_vramkit_error_and_still_a_file_not_found(tmp_path: Path) -> None:
    path = tmp_path / "nothing.safetensors"
    err = path_error(lambda: LazySafetensors.open(path), "missing")
    assert isinstance(err, FileNotFoundError)
    assert "does not exist" in err.message and "Check the path" in err.hint
    clone = pickle.loads(pickle.dumps(err))  # errors cross process boundaries
    assert type(clone) is type(err) and str(clone) == str(err) and clone.kind == "missing"


def test_a_file_where_a_directory_is_expected(good: Path) -> None:
    err = path_error(lambda: LazySafetensors.open(good / "model.safetensors"), "not-a-directory")
    assert "not a directory" in err.message


@pytest.mark.parametrize("repo_id", ["black-forest-labs/FLUX.1-dev",
                                     "stabilityai/stable-diffusion-xl-base-1.0"])
def test_hugging_face_repo_id(repo_id: str, tmp_path: Path,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    for call in entry_points(Path(repo_id)).values():
        err = path_error(call, "repo-id")
        assert "Hugging Face repo id" in err.message and "does not download" in err.message
        assert f"hf download {repo_id} --local-dir" in err.hint
        assert f"snapshot_download({repo_id!r})" in err.hint


def test_repo_id_found_in_the_hugging_face_cache(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    cache = tmp_path / "hub"
    repo = cache / "models--org--tiny"
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    err = path_error(lambda: LazySafetensors.open("org/tiny"), "repo-id")
    assert str(snapshot) in err.message


def test_a_local_relative_path_is_not_taken_for_a_repo_id(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    err = path_error(lambda: LazySafetensors.open("models/flux"), "missing")
    assert "repo id" not in err.message


# -- permissions -----------------------------------------------------------------------------


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode; "
                                              "test_permission_denied_simulated covers it")
def test_permission_denied(good: Path) -> None:
    good.chmod(0)
    try:
        for call in entry_points(good).values():
            err = path_error(call, "permission")
            assert isinstance(err, PermissionError)
            assert "permission denied" in err.message and "chmod" in err.hint
    finally:
        good.chmod(stat.S_IRUSR | stat.S_IWUSR)


def test_permission_denied_simulated(good: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # As root a mode-000 file is readable, so the kernel's answer is simulated for this path.
    real_open = os.open

    def refusing_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if os.fspath(path) == os.fspath(good):
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing_open)
    for call in entry_points(good).values():
        err = path_error(call, "permission")
        assert isinstance(err, PermissionError)
        assert "permission denied" in err.message and str(good) in err.message
        assert "chmod" in err.hint and "ls -ld" in err.hint
    clone = pickle.loads(pickle.dumps(err))
    assert isinstance(clone, PermissionError) and clone.hint == err.hint


# -- directories -----------------------------------------------------------------------------


def test_empty_directory(tmp_path: Path) -> None:
    err = path_error(lambda: LazySafetensors.open(tmp_path), "empty-directory")
    assert "holds no .safetensors file" in err.message and "folder" in err.hint


def make_pipeline(root: Path) -> Path:
    root.mkdir()
    (root / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    for folder in ("transformer", "vae", "text_encoder"):
        (root / folder).mkdir(parents=True)
        save_file({"w": torch.ones(2)}, root / folder / "diffusion_pytorch_model.safetensors")
    (root / "scheduler").mkdir()
    (root / "scheduler" / "scheduler_config.json").write_text("{}")
    return root


@pytest.mark.parametrize("given", ["root", "model_index.json"])
def test_diffusers_pipeline_root(tmp_path: Path, given: str) -> None:
    root = make_pipeline(tmp_path / "FLUX.1-dev")
    path = root if given == "root" else root / "model_index.json"
    for how, call in entry_points(path).items():
        if how == "read_header" and given == "root":
            continue  # read_header takes one file
        err = path_error(call, "pipeline-root")
        assert "diffusers pipeline root" in err.message
        for folder in ("transformer/", "vae/", "text_encoder/"):
            assert folder in err.message
        assert "scheduler" not in err.message  # it holds no weights
        assert str(root / "transformer") in err.hint
    with LazySafetensors.open(root / "transformer") as checkpoint:  # what the hint says works
        assert checkpoint.tensor_names() == ["w"]


def test_unet_pipeline_points_to_the_unet(tmp_path: Path) -> None:
    (tmp_path / "model_index.json").write_text("{}")
    for folder in ("unet", "vae"):
        (tmp_path / folder).mkdir()
        save_file({"w": torch.ones(1)}, tmp_path / folder / "m.safetensors")
    err = path_error(lambda: LazySafetensors.open(tmp_path), "pipeline-root")
    assert str(tmp_path / "unet") in err.hint


def test_directory_of_pickles_and_parent_directory(tmp_path: Path) -> None:
    pickles = tmp_path / "bins"
    pickles.mkdir()
    torch.save({"w": torch.ones(2)}, pickles / "pytorch_model.bin")
    err = path_error(lambda: LazySafetensors.open(pickles), "pickle-directory")
    assert "pytorch_model.bin" in err.message and "does not unpickle" in err.message
    assert "weights_only=True" in err.hint and "save_file" in err.hint
    parent = tmp_path / "parent"
    (parent / "weights").mkdir(parents=True)
    save_file({"w": torch.ones(1)}, parent / "weights" / "m.safetensors")
    err = path_error(lambda: LazySafetensors.open(parent), "parent-directory")
    assert "weights/" in err.message and str(parent / "weights") in err.hint


# -- pickle checkpoints ----------------------------------------------------------------------


def write_pickles(root: Path) -> dict[str, Path]:
    state = {"w": torch.ones(2, 2)}
    files = {"torch.save .pt (zip)": root / "model.pt",
             "torch.save .bin (legacy pickle)": root / "pytorch_model.bin",
             "raw pickle .ckpt": root / "model.ckpt",
             "torch.save named .safetensors": root / "renamed.safetensors",
             "empty .pth": root / "empty.pth"}
    torch.save(state, files["torch.save .pt (zip)"])
    torch.save(state, files["torch.save .bin (legacy pickle)"],
               _use_new_zipfile_serialization=False)
    with open(files["raw pickle .ckpt"], "wb") as handle:
        pickle.dump({"state_dict": {"w": [1.0, 2.0]}}, handle, protocol=4)
    torch.save(state, files["torch.save named .safetensors"])
    files["empty .pth"].write_bytes(b"")
    return files


@pytest.mark.parametrize("which", ["torch.save .pt (zip)", "torch.save .bin (legacy pickle)",
                                   "raw pickle .ckpt", "torch.save named .safetensors",
                                   "empty .pth"])
def test_pickle_checkpoints_are_named_as_such(tmp_path: Path, which: str) -> None:
    path = write_pickles(tmp_path)[which]
    for call in entry_points(path).values():
        err = path_error(call, "pickle")
        assert str(path) in err.message
        assert "does not unpickle" in err.message and "arbitrary code" in err.message
        assert "header length" not in err.message  # not reported as a damaged safetensors
        assert "torch.load" in err.hint and "weights_only=True" in err.hint
        assert "safetensors.torch.save_file" in err.hint and str(path) in err.hint


def test_pickle_shard_in_an_index_is_named(tmp_path: Path) -> None:
    save_file({"a": torch.ones(2)}, tmp_path / "model-00001-of-00002.safetensors")
    torch.save({"b": torch.ones(2)}, tmp_path / "model-00002-of-00002.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    err = path_error(lambda: LazySafetensors.open(tmp_path), "pickle")
    assert "model-00002-of-00002.safetensors" in err.message


def test_conversion_in_the_hint_works(tmp_path: Path) -> None:
    source = tmp_path / "model.ckpt"
    torch.save({"state_dict": {"w": torch.arange(4.0)}}, source)
    err = path_error(lambda: LazySafetensors.open(source), "pickle")
    assert "sd['state_dict']" in err.hint
    sd = torch.load(source, map_location="cpu", weights_only=True)["state_dict"]
    save_file({k: v.clone().contiguous() for k, v in sd.items()}, tmp_path / "model.safetensors")
    with LazySafetensors.open(tmp_path / "model.safetensors") as checkpoint:
        assert torch.equal(checkpoint.load_tensor("w"), torch.arange(4.0))


def test_safetensors_content_wins_over_a_pickle_name_or_prefix(tmp_path: Path) -> None:
    named = tmp_path / "model.bin"
    save_file({"w": torch.ones(3)}, named)
    assert LazySafetensors.open(named).tensor_names() == ["w"]
    # A valid header of 640 bytes begins with 0x80 0x02: the bytes of a protocol-2 pickle.
    body = {"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}
    text = json.dumps(body).encode()
    header = text + b" " * (640 - len(text))
    path = tmp_path / "pickle-like.safetensors"
    path.write_bytes(struct.pack("<Q", 640) + header + struct.pack("<f", 1.5))
    assert path.read_bytes()[:2] == b"\x80\x02"
    assert LazySafetensors.open(path).load_tensor("w").tolist() == [1.5]
    # ... and the same file damaged or truncated is reported as damaged, not as a pickle
    path.write_bytes(struct.pack("<Q", 640) + header.replace(b'"F32"', b'"F99"'))
    with pytest.raises(SafetensorsFormatError, match="unknown dtype") as info:
        LazySafetensors.open(path)
    assert getattr(info.value, "kind", None) is None
    path.write_bytes(struct.pack("<Q", 640) + header[:100])
    with pytest.raises(SafetensorsFormatError, match="runs beyond the end") as info:
        LazySafetensors.open(path)
    assert getattr(info.value, "kind", None) is None


def test_json_file_given_as_weights(tmp_path: Path) -> None:
    config = tmp_path / "config.json.safetensors"
    config.write_text(json.dumps({"hidden_size": 8}))
    err = path_error(lambda: LazySafetensors.open(config), "json")
    assert "JSON file" in err.message and "*.safetensors" in err.hint


def test_resolve_checkpoint_and_read_index_use_the_same_checks(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "x.safetensors.index.json")
    assert isinstance(outcome_within(lambda: read_index(tmp_path / "x.safetensors.index.json"),
                                     tmp_path / "x.safetensors.index.json"),
                      SafetensorsFormatError)
    assert isinstance(outcome_within(lambda: resolve_checkpoint(tmp_path / "missing")),
                      FileNotFoundError)
