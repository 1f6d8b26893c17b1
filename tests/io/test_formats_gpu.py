"""The checkpoint-format door on a GPU: tensors that need work after reading (FLUX's swapped
final modulation, fp8 scales) and GGUF bytes, loaded to CUDA, equal the CPU load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.io._single_files import tiny_flux, to_original, write_gguf
from vramkit.io._single_file import FLUX, LDM_PREFIX
from vramkit.io.loader import load_into

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
pytest.importorskip("diffusers")


def _files(tmp_path: Path) -> dict[str, Path]:
    state = tiny_flux().state_dict()
    files = {"bf16": tmp_path / "flux1.safetensors", "fp8": tmp_path / "fp8.safetensors",
             "gguf": tmp_path / "flux1-Q8_0.gguf"}
    original = to_original(FLUX, state, prefix=LDM_PREFIX)
    save_file({k: v.bfloat16() for k, v in original.items()}, files["bf16"])
    fp8: dict[str, torch.Tensor] = {}
    for name, t in original.items():
        if name.endswith(".weight") and t.dim() == 2:
            scale = t.abs().max().float() / 448
            fp8[name] = (t / scale).to(torch.float8_e4m3fn)
            fp8[name.removesuffix(".weight") + ".scale_weight"] = scale.reshape(())
        else:
            fp8[name] = t
    save_file(fp8, files["fp8"])
    bare = to_original(FLUX, state)
    write_gguf(str(files["gguf"]), bare, {n: "Q8_0" for n, t in bare.items()
                                          if t.dim() == 2 and t.shape[1] % 32 == 0})
    return files


@pytest.mark.parametrize("kind", ["bf16", "fp8", "gguf"])
def test_a_cuda_load_equals_the_cpu_load(tmp_path: Path, kind: str) -> None:
    path = _files(tmp_path)[kind]
    on_cpu, on_gpu = tiny_flux("meta"), tiny_flux("meta")
    load_into(on_cpu, path)
    load_into(on_gpu, path, device="cuda")
    want, got = on_cpu.state_dict(), on_gpu.state_dict()
    assert set(want) == set(got)
    for key, value in want.items():
        assert got[key].is_cuda, key
        assert torch.equal(got[key].cpu(), value), key
