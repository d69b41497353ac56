"""`ferrocupy.torch` and the lab's scripts use ferrocupy through its public names only: no
`from ferrocupy... import _x`, and no `._x` attribute on anything that comes from ferrocupy (a
module, a class, an engine or backend made from one). A private name (one leading underscore,
not a dunder) may change without notice; a script that needs more of the backend gets a public
seam (`ferrocupy.cuda.tuning`, `configs.only`, the loader's overlay) instead.

The check is static (AST), and practical rather than complete: a name counts as ferrocupy's if
it is bound by an import from ferrocupy or assigned from an expression that uses such a name;
besides, `._x` is refused on any object where `_x` is a private name that ferrocupy defines
(an engine handed over by a helper function is caught that way), unless the file defines `_x`
itself or the object is `self`/`cls`."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ferrocupy"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _defined_private_names(tree: ast.AST) -> set:
    """Private names a module defines: functions, classes, assigned names and attributes, and
    `__slots__` entries."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.add(node.value)  # __slots__ strings (and harmless others)
    return {n for n in names if _private(n)}


@functools.lru_cache(maxsize=1)
def package_private_names() -> frozenset:
    return frozenset().union(*(_defined_private_names(ast.parse(p.read_text()))
                               for p in PACKAGE.rglob("*.py")))


def _root(node: ast.AST):
    """The name an attribute chain, call or subscript starts from (`a` of `a.b().c[0]`)."""
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _from_ferrocupy(node: ast.ImportFrom, in_package: bool) -> bool:
    return (node.level > 0 and in_package) or (node.module or "").split(".")[0] == "ferrocupy"


def _bound_names(target: ast.AST) -> list:
    return [n.id for n in ast.walk(target) if isinstance(n, ast.Name)]


def private_uses(source: str, in_package: bool = False, package_names: set | None = None) -> list:
    """(line, what) for each use of a private ferrocupy name in `source`. `in_package`: the file
    is inside ferrocupy (its relative imports are ferrocupy's)."""
    tree = ast.parse(source)
    package_names = package_private_names() if package_names is None else package_names
    own = _defined_private_names(tree)
    found, tainted = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "ferrocupy":
                    tainted.add((alias.asname or alias.name).split(".")[0])
                    found += [(node.lineno, f"import {alias.name}")
                              for part in alias.name.split(".") if _private(part)]
        elif isinstance(node, ast.ImportFrom) and _from_ferrocupy(node, in_package):
            module = "." * node.level + (node.module or "")
            found += [(node.lineno, f"from {module} import ...")
                      for part in (node.module or "").split(".") if _private(part)]
            for alias in node.names:
                tainted.add(alias.asname or alias.name)
                if _private(alias.name):
                    found.append((node.lineno, f"from {module} import {alias.name}"))
    # Names assigned from an expression that uses a ferrocupy name are ferrocupy's too.
    assigns = [(n.targets if isinstance(n, ast.Assign) else [n.target], n.value)
               for n in ast.walk(tree)
               if isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.NamedExpr))
               and n.value is not None]
    assigns += [([n.target], n.iter) for n in ast.walk(tree) if isinstance(n, (ast.For,
                                                                                ast.comprehension))]
    assigns += [([item.optional_vars], item.context_expr) for n in ast.walk(tree)
                if isinstance(n, ast.With) for item in n.items if item.optional_vars]
    changed = True
    while changed:
        changed = False
        for targets, value in assigns:
            if {n.id for n in ast.walk(value) if isinstance(n, ast.Name)} & tainted:
                new = {name for t in targets for name in _bound_names(t)} - tainted
                tainted |= new
                changed = changed or bool(new)

    def check(node, obj, attr):
        if not _private(attr):
            return
        root = _root(obj)
        if root in tainted or (attr in package_names and attr not in own
                               and root not in ("self", "cls")):
            found.append((node.lineno, f"{ast.unparse(obj)}.{attr}"))

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            check(node, node.value, node.attr)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            check(node, node.args[0], node.args[1].value)
    return sorted(found)


# --- the checker itself, on planted uses ------------------------------------------------------------
NAMES = {"_plan", "_launch", "_check_call", "_smem_limit"}


@pytest.mark.parametrize("source", [
    "from ferrocupy.cuda.backend import _pointers",
    "from ferrocupy.cuda import backend\nbackend._launch(1)",
    "import ferrocupy.cuda.backend as b\nx = b.CudaBackend()._plan",
    "from ferrocupy.cuda.backend import CudaBackend\nb = CudaBackend()\nb._whatever",
    "from ferrocupy import ComputeEngine\nfor e in [ComputeEngine()]:\n    e.backend._kernels",
    "from ferrocupy import ComputeEngine\nwith ComputeEngine() as e:\n    e._x",
    "import ferrocupy\nlimit = ferrocupy.cuda.backend.CudaBackend()._smem_limit",
    "def f(engine):\n    return engine._check_call('forward', {}, None)",  # a ferrocupy private name
    "from ferrocupy import ComputeEngine\ne = ComputeEngine()\ngetattr(e, '_checked')",
    "from ferrocupy.cuda import configs\nconfigs._table()",
])
def test_checker_finds_planted_private_uses(source):
    assert private_uses(source, package_names=NAMES), source


@pytest.mark.parametrize("source", [
    "from ferrocupy.cuda import configs, tuning\nt = tuning.forcing(configs.TABLE)",
    "import torch\nx = torch._C._cuda_getCurrentRawStream",  # torch's privates are torch's
    "class A:\n    def f(self):\n        return self._plan",
    "_plan = 1\nimport numpy as np\nnp.zeros(3)._plan",  # the file's own name
    "from ferrocupy import ComputeEngine\nComputeEngine.__init__\nComputeEngine().__dict__",
    "def f(x):\n    return x._private_of_something_else",
])
def test_checker_passes_public_uses(source):
    assert not private_uses(source, package_names=NAMES), source


def test_relative_imports_count_inside_the_package():
    assert private_uses("from .engine import _option_values", in_package=True, package_names=NAMES)
    assert not private_uses("from .engine import _option_values", package_names=NAMES)


# --- the files that must use public names only --------------------------------------------------
LAB_FILES = sorted((ROOT / "lab").rglob("*.py"))


@pytest.mark.parametrize("path", LAB_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_lab_uses_public_names_only(path):
    uses = private_uses(path.read_text())
    assert not uses, f"{path.relative_to(ROOT)} uses private ferrocupy names: {uses}"


def test_there_are_lab_scripts_to_check():
    assert len(LAB_FILES) >= 5, LAB_FILES


@pytest.mark.parametrize("module", ["torch.py", "transformers.py", "flash_attn.py",
                                    "context_parallel.py"])
def test_framework_modules_use_public_names_only(module):
    path = PACKAGE / module
    uses = private_uses(path.read_text(), in_package=True)
    assert not uses, f"ferrocupy/{module} uses private ferrocupy names: {uses}"
