"""`import vramkit` must initialize no CUDA context, import no JAX and call no NVML."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

_PROBE = textwrap.dedent(
    """
    import sys
    import torch, torch.cuda

    def _refuse(*args, **kwargs):
        raise RuntimeError("CUDA initialized during import vramkit")

    torch.cuda._lazy_init = _refuse
    torch.cuda.init = _refuse
    torch._C._cuda_init = _refuse

    try:
        import pynvml
    except ImportError:
        pynvml = None
    if pynvml is not None:
        def _nvml_refuse(*args, **kwargs):
            raise RuntimeError("NVML called during import vramkit")
        pynvml.nvmlInit = _nvml_refuse
        pynvml.nvmlInitWithFlags = _nvml_refuse

    import vramkit
    import vramkit.cli.main
    names = list(vramkit.__all__)
    assert "jax" not in sys.modules, "import vramkit imported jax"
    assert "jaxlib" not in sys.modules, "import vramkit imported jaxlib"
    print("OK", len(names))
    """
)


def test_import_is_free_of_cuda_jax_and_nvml() -> None:
    proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("OK")


def test_public_names_resolve() -> None:
    import vramkit

    missing = []
    for name in vramkit.__all__:
        try:
            getattr(vramkit, name)
        except (AttributeError, ImportError) as err:
            missing.append(f"{name}: {err}")
    assert not missing, "\n".join(missing)


def test_unknown_attribute_raises() -> None:
    import vramkit

    with pytest.raises(AttributeError):
        vramkit.no_such_thing  # noqa: B018
