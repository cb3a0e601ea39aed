"""The package's layering, read from the source: imports run one way (inference -> models -> attention and
layers), and the model's `Attention` protocol is what every backend and the piecewise graphs' cut implement."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import weft
from weft.attention import available_backends, get_backend
from weft.inference.cuda_graphs import AttentionCut
from weft.models.llama import Attention

pytestmark = pytest.mark.correctness

PACKAGE = Path(weft.__file__).parent


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports (absolute names), at any depth of its code."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level:
            names.add(f"<relative {node.module}>")
        elif isinstance(node, ast.ImportFrom):  # `from weft import attention` imports weft.attention
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return names


@pytest.mark.parametrize(("package", "forbidden"), [("layers", ("weft.attention", "weft.inference")),
                                                     ("attention", ("weft.inference",))])
def test_imports_never_run_back_up(package, forbidden):
    files = sorted((PACKAGE / package).rglob("*.py"))
    assert files
    crossing = {f"{f.relative_to(PACKAGE)}: {m}" for f in files for m in imported_modules(f)
                if m.startswith("<relative") or any(m == p or m.startswith(p + ".") for p in forbidden)}
    assert not crossing, f"weft/{package} imports what it must not: {sorted(crossing)}"


def test_the_check_sees_an_import_that_crosses(tmp_path):
    bad = tmp_path / "rotary.py"
    bad.write_text("from weft import attention\n\ndef f():\n    from weft.attention.base import CacheSlots\n")
    assert {"weft.attention", "weft.attention.base"} <= imported_modules(bad)


def protocol_methods() -> dict[str, inspect.Signature]:
    return {name: inspect.signature(getattr(Attention, name)) for name in ("cache_slots", "forward", "attend")}


@pytest.mark.parametrize("implementation", [*(get_backend(n) for n in available_backends()), AttentionCut],
                         ids=lambda c: c.__name__)
def test_every_attention_implements_the_models_protocol(implementation):
    """Each method the model calls takes the protocol's parameters, in its order, and any more have defaults."""
    for name, want in protocol_methods().items():
        got = inspect.signature(getattr(implementation, name))
        params = list(got.parameters.values())
        assert [p.name for p in params[: len(want.parameters)]] == list(want.parameters), (implementation, name)
        assert all(p.default is not inspect.Parameter.empty for p in params[len(want.parameters) :]), name
