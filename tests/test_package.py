"""The package's public face and the one-way data flow of its layers."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import lightning_vit_balance

PACKAGE_DIR = Path(lightning_vit_balance.__file__).parent

# Data flows one way: a module may import only modules of earlier layers (or its own layer).
LAYERS: dict[str, int] = {
    "callsite": 0,  # where the package's warnings point: the first frame outside it and the libraries
    "caching": 0,  # a lock-free cached attribute for the value classes
    "eager": 0,  # where torch.compile stops: the package's own code runs eagerly in a compiled model
    "config": 0,
    "cost": 1,
    "planning": 2,
    "solvers": 2,  # the planner's solvers: pure Python and numpy
    "simulate": 2,  # the what-would-I-gain simulator: config, cost and planning only
    "problems": 2,  # the table of input problems: pure, no communication
    "exchange": 3,
    "host_group": 3,  # the gloo twin of an NCCL group, for the host-side gathers
    "wire": 3,  # the return buffer's codec: no communication, reads exchange's ReturnLayout
    "routes": 3,  # exchange's values of recent plans, made once per plan: no communication
    "outputs": 4,
    "encoding": 5,  # the ViT side of a balanced call: checks, the forward, its status
    "prepared": 5,  # a plan made before the forward
    "recompute": 5,  # activation checkpointing: a call recomputed in the backward pass, its plan
    "balancer": 6,
    "hf": 7,
    "metrics": 7,  # balanced calls' stats as vit_balance/* metrics, for any loop's logger
    "lightning": 8,
    "hf_trainer": 8,  # Hugging Face's Trainer: the drop-in's state in its checkpoints
}


def _module_layer(path: Path) -> tuple[str, int] | None:
    relative = path.relative_to(PACKAGE_DIR).with_suffix("")
    head = relative.parts[0]
    return (head, LAYERS[head]) if head in LAYERS else None


def _package_imports(path: Path) -> set[str]:
    """Top-level names of everything ``path`` imports, ``lightning_vit_balance.X`` as ``pkg:X``."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules = [node.module]
        else:
            continue
        for module in modules:
            parts = module.split(".")
            names.add(f"pkg:{parts[1]}" if parts[0] == "lightning_vit_balance" and len(parts) > 1 else module)
    return names


def test_every_public_name_resolves() -> None:
    for name in lightning_vit_balance.__all__:
        assert getattr(lightning_vit_balance, name) is not None, name
    assert sorted(lightning_vit_balance.__all__) == sorted(set(lightning_vit_balance.__all__))


def test_layers_import_only_earlier_layers() -> None:
    checked = 0
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        layer = _module_layer(path)
        if layer is None:
            continue
        name, level = layer
        for imported in _package_imports(path):
            if imported.startswith("pkg:"):
                target = imported[4:]
                assert LAYERS[target] <= level, f"{path.name} ({name}) imports the later layer {target}"
            elif imported.split(".")[0] in {"lightning", "pytorch_lightning", "torchmetrics"}:
                assert name == "lightning", f"{path} imports {imported}; only lightning/ may"
            elif imported.split(".")[0] == "transformers":
                assert name == "hf_trainer", f"{path} imports {imported}; only hf_trainer may"
        checked += 1
    assert checked >= len(LAYERS)


def test_planning_has_no_torch_distributed() -> None:
    imports = _package_imports(PACKAGE_DIR / "planning.py") | _package_imports(PACKAGE_DIR / "cost.py")
    solver_files = sorted((PACKAGE_DIR / "solvers").glob("*.py"))
    assert solver_files
    for path in solver_files:
        imports |= _package_imports(path)
    assert not any(name.startswith("torch") for name in imports), imports


def test_importing_the_package_imports_only_what_is_used() -> None:
    # The lazy names resolve (test_every_public_name_resolves); importing Lightning and transformers
    # here only to see them load would cost this fresh interpreter about 10 s. Planning and the
    # simulator need NumPy alone: torch costs a command-line run about a second and 230 MB.
    code = (
        "import sys, lightning_vit_balance as m, lightning_vit_balance.simulate; "
        "m.plan_rebalance([[4], [16]]); "
        "assert 'torch' not in sys.modules, 'eager torch import'; "
        "m.ViTBalancer; "
        "assert 'torch' in sys.modules; "
        "assert m.exchange.STATUS_WORD and m.balancer.ViTBalancer is m.ViTBalancer; "  # as after imports
        "assert 'lightning' not in sys.modules, 'eager lightning import'; "
        "assert 'torchmetrics' not in sys.modules, 'eager torchmetrics import'; "
        "assert 'transformers' not in sys.modules, 'eager transformers import'; "
        "assert {'ViTBalanceMixin', 'ViTBalanceTrainerCallback'} <= set(m.__all__) - set(vars(m)); "
        # The engine's and the drop-in's code compile lazily: TorchDynamo costs an import a second.
        "import lightning_vit_balance.hf; "
        "assert 'torch._dynamo' not in sys.modules, 'eager TorchDynamo import'; "
        "import importlib.metadata as md; "
        "assert m.__version__ == md.version('lightning-vit-balance'), m.__version__"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_without_transformers_the_rest_imports_and_the_trainer_callback_says_what_to_install() -> None:
    # transformers hidden from the import system (None in sys.modules) and from the installed
    # distributions, which torchmetrics (imported by Lightning) asks before importing it.
    code = (
        "import sys, importlib.metadata as md\n"
        "sys.modules['transformers'] = None\n"
        "def hide(real):\n"
        "    def hidden(name, *args, **kwargs):\n"
        "        if name == 'transformers':\n"
        "            raise md.PackageNotFoundError(name)\n"
        "        return real(name, *args, **kwargs)\n"
        "    return hidden\n"
        "md.version, md.distribution = hide(md.version), hide(md.distribution)\n"
        "from lightning_vit_balance import *\n"
        "import lightning_vit_balance as m\n"
        "assert ViTBalanceMixin and balance_vision_tower and 'ViTBalanceTrainerCallback' not in dir()\n"
        "try:\n"
        "    m.ViTBalanceTrainerCallback\n"
        "except ImportError as error:\n"
        "    assert \"pip install 'lightning-vit-balance[hf]'\" in str(error), error\n"
        "else:\n"
        "    raise AssertionError('no ImportError')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_drop_in_names_the_transformers_releases_make_tests() -> None:
    """The drop-in's refusals say which transformers releases it is tested with: those the
    requirements files pin (a release moved there must move in the message too)."""
    from lightning_vit_balance.hf import _TESTED_TRANSFORMERS

    requirements = PACKAGE_DIR.parent / "requirements"
    pinned = []
    for name in ("transformers4.txt", "transformers.txt"):
        lines = (requirements / name).read_text().splitlines()
        (pin,) = [line for line in lines if line.startswith("transformers==")]
        pinned.append(".".join(pin.removeprefix("transformers==").split(".")[:2]))
    assert " and ".join(pinned) == _TESTED_TRANSFORMERS
