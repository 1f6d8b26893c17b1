"""`import vramkit` must initialize no CUDA context, import no JAX and call no NVML."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

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


_SOURCE = Path(__file__).resolve().parents[1] / "src" / "vramkit"

#: Every subpackage of vramkit, nested ones included ("offload.x"), read from the source tree: a
#: new one is covered without a test change.
PACKAGES = sorted(".".join(init.parent.relative_to(_SOURCE).parts)
                  for init in _SOURCE.rglob("*/__init__.py"))

#: The subpackages that re-export their modules' public names (lazily, through
#: ``vramkit._lazy.lazy_exports``); the others (the command line) export nothing.
EXPORTING = [p for p in PACKAGES
             if "lazy_exports(" in (_SOURCE / p.replace(".", "/") / "__init__.py").read_text()]


def test_the_source_tree_lists_the_subpackages() -> None:
    assert {"devices", "distributed", "memory", "offload", "planning"} <= set(PACKAGES)


@pytest.mark.parametrize("package", sorted(set(PACKAGES) - set(EXPORTING)))
def test_a_package_that_exports_nothing_defines_nothing(package: str) -> None:
    import importlib
    import types

    module = importlib.import_module(f"vramkit.{package}")
    # Submodules imported elsewhere become attributes of their package: those are not names
    # the package defines.
    public = [name for name, value in vars(module).items()
              if not name.startswith("_") and name != "annotations"
              and not (isinstance(value, types.ModuleType)
                       and value.__name__ == f"{module.__name__}.{name}")]
    assert not public, f"vramkit.{package} defines {public} without lazy_exports"


@pytest.mark.parametrize("package", EXPORTING)
def test_package_exports_resolve(package: str) -> None:
    import importlib

    module = importlib.import_module(f"vramkit.{package}")
    assert module.__all__, f"vramkit.{package} exports nothing"
    missing = [name for name in module.__all__ if getattr(module, name, None) is None]
    assert not missing, f"vramkit.{package} cannot resolve {missing}"
    assert set(module.__all__) <= set(dir(module))
    with pytest.raises(AttributeError):
        module.no_such_name  # noqa: B018


#: Packages that are one component behind one door (httpx's ``_transports/`` shape): their
#: modules are its parts, sharing names among themselves; the door exports the component's API.
ONE_DOOR = {"offload.swap"}


@pytest.mark.parametrize("package", [p for p in EXPORTING if p not in ONE_DOOR])
def test_every_public_name_is_exported_from_where_it_lives(package: str) -> None:
    import importlib
    import pkgutil

    module = importlib.import_module(f"vramkit.{package}")
    exported = set(module.__all__)
    for info in pkgutil.iter_modules(module.__path__):
        if info.name.startswith("_") or info.ispkg:
            continue  # private modules are reached through the public ones; subpackages are
            # packages of their own, checked by their own parameter
        sub = importlib.import_module(f"{module.__name__}.{info.name}")
        for name in getattr(sub, "__all__", ()):
            assert name in exported, f"{sub.__name__}.{name} is not re-exported"
            assert getattr(module, name) is getattr(sub, name)


def test_importing_a_package_imports_none_of_its_modules() -> None:
    probe = "import sys\n" + "".join(
        f"import vramkit.{p}\n" for p in PACKAGES) + textwrap.dedent(f"""
        packages = {{"vramkit." + p for p in {PACKAGES!r}}}
        loaded = sorted(m for m in sys.modules if m.startswith("vramkit.")
                        and m.count(".") >= 2 and m not in packages)
        print(loaded)
        """)
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout


#: The public face, locked: a name joins or leaves it on purpose, with this list.
PUBLIC = [
    "VramkitError", "ConfigError", "DeviceError", "TooLateError", "PoolExhaustedError",
    "OffloadError", "PlanError", "QuantizationError", "SafetensorsFormatError", "KernelError",
    "RecoveryError", "VramkitWarning", "parse_size", "format_size",
    "detect_devices", "select_device", "DeviceManager", "DeviceConfiguration", "MemoryStrategy",
    "get_device_manager", "setup_cuda_memory_management", "MemoryInfo", "read_memory_info",
    "MemoryPool", "PoolConfig", "QuantizedLinear", "QuantizationConfig", "quantize_model",
    "save_quantized", "load_quantized_model", "AdamW8bit",
    "LazySafetensors", "MemoryEfficientLoader", "load_into", "BlockSwapper", "SwapConfig",
    "SwapStats", "CPUOffloadManager", "offload_activations", "CPUOffloadOptimizer",
    "enable_gradient_checkpointing", "MemoryProfiler", "classify_oom",
    "train_with_memory_recovery",
    "plan", "fit", "Fitted", "FitReport", "Plan", "VAETiling",
    "optimize_flux_memory", "optimize_sdxl_memory",
]


@pytest.mark.parametrize("package", sorted(ONE_DOOR))
def test_a_one_door_package_names_its_component(package: str) -> None:
    import importlib

    door = importlib.import_module(f"vramkit.{package}")
    assert {"BlockSwapper", "SwapConfig", "SwapStats"} <= set(door.__all__)
    for name in door.__all__:
        assert getattr(door, name) is not None


def test_the_public_face_is_locked() -> None:
    import vramkit

    assert vramkit.__all__ == PUBLIC
    assert dir(vramkit) == sorted(PUBLIC)


@pytest.mark.parametrize("name", ["DiT", "DiTConfig", "run_demo", "DemoConfig", "DemoResult",
                                  "select_precision", "Any", "TYPE_CHECKING", "importlib"])
def test_names_outside_the_face_are_not_attributes(name: str) -> None:
    import vramkit

    with pytest.raises(AttributeError):
        getattr(vramkit, name)


@pytest.mark.parametrize("old", ["vramkit.checkpointing", "vramkit.demo", "vramkit.presets",
                                 "vramkit.models", "vramkit.kernels.layout"])
def test_old_module_paths_are_gone(old: str) -> None:
    import importlib

    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(old)
