"""Import contracts: the layers of DESIGN.md §3, checked on the source.

Every import in every module under bios/ counts, those inside functions and `if TYPE_CHECKING:` blocks included
(`importlib.import_module("literal")` too), so a lazy import cannot hide an upward one. One check is exact rather
than static: a coordinator process, with all its modules imported, has not loaded torch. A failure names the
importing file, its line and the forbidden module.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections import deque
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

import bios

PACKAGE = Path(bios.__file__).resolve().parent
REPO = PACKAGE.parent
HEAVY = ("torch", "transformers")


@dataclass(frozen=True)
class Import:
    path: str  # the importing file, relative to the repository
    line: int
    module: str  # the imported module, absolute
    importer: str
    top_level: bool  # runs when the importer is imported (not inside a function or a TYPE_CHECKING block)

    def __str__(self) -> str:
        return f"{self.path}:{self.line} imports {self.module}"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _is_package(module: str) -> bool:
    path = _modules().get(module)
    return path is not None and path.name == "__init__.py"


def _resolve(module: str, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    package = module if _is_package(module) else module.rpartition(".")[0]
    base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
    return f"{base}.{node.module}" if node.module else base


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


class _Collector(ast.NodeVisitor):
    def __init__(self, module: str, path: str) -> None:
        self.module, self.path = module, path
        self.found: list[Import] = []
        self._deferred = 0  # inside a function or a TYPE_CHECKING block

    def _add(self, node: ast.AST, imported: str) -> None:
        self.found.append(Import(self.path, node.lineno, imported, self.module, self._deferred == 0))

    def _visit_deferred(self, node: ast.AST) -> None:
        self._deferred += 1
        self.generic_visit(node)
        self._deferred -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _visit_deferred

    def visit_If(self, node: ast.If) -> None:
        if not _is_type_checking(node.test):
            self.generic_visit(node)
            return
        self._deferred += 1
        for child in node.body:
            self.visit(child)
        self._deferred -= 1
        for child in node.orelse:
            self.visit(child)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(node, alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = _resolve(self.module, node)
        plain = False
        for alias in node.names:
            submodule = f"{base}.{alias.name}"
            if submodule in _modules():  # `from bios import messages`: the module bios.messages
                self._add(node, submodule)
            else:
                plain = True
        if plain:
            self._add(node, base)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        if name == "import_module" and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            self._add(node, node.args[0].value)
        self.generic_visit(node)


@cache
def _imports_of(module: str) -> tuple[Import, ...]:
    path = _modules()[module]
    collector = _Collector(module, str(path.relative_to(REPO)))
    collector.visit(ast.parse(path.read_text(), filename=str(path)))
    return tuple(collector.found)


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


@dataclass(frozen=True)
class Contract:
    name: str
    importers: tuple[str, ...]  # the modules (and packages) whose imports are checked
    forbidden: tuple[str, ...]  # what they may not import...
    allowed: tuple[str, ...] = ()  # ...except these

    def violations(self) -> list[Import]:
        return [imp for module in _modules() if any(_within(module, p) for p in self.importers)
                for imp in _imports_of(module)
                if any(_within(imp.module, f) for f in self.forbidden)
                and not any(_within(imp.module, a) for a in self.allowed)]


FRONT_ENDS = ("bios.sdk", "bios.gateway")  # the native SDK; the HTTP gateway (Tinker and OpenAI APIs, web console)

CONTRACTS = [
    Contract("the vocabulary (bios.messages) is plain data: no plumbing, no process, no torch",
             ("bios.messages",),
             ("bios.actors", "bios.transport", "bios.wire", "bios.coordinator", "bios.worker", "bios.sdk",
              "bios.gateway", *HEAVY)),
    Contract("the transport knows nothing of Bios", ("bios.transport",), ("bios",), allowed=("bios.transport",)),
    Contract("the actor runtime stands on the transport alone (and the errors it carries)", ("bios.actors",),
             ("bios",), allowed=("bios.actors", "bios.transport", "bios.exceptions")),
    Contract("the coordinator never imports torch or transformers", ("bios.coordinator",), HEAVY),
    Contract("the coordinator never imports the worker", ("bios.coordinator",), ("bios.worker",)),
    Contract("the worker never imports the coordinator", ("bios.worker",), ("bios.coordinator",)),
    Contract("the SDK reaches the coordinator and workers by messages, and starts them as processes",
             ("bios.sdk",), ("bios.coordinator", "bios.worker")),
    Contract("the coordinator imports no layer above it: no front end, no command line", ("bios.coordinator",),
             ("bios.sdk", "bios.gateway", "bios.cli")),
    Contract("the worker imports no layer above it", ("bios.worker",), ("bios.sdk", "bios.gateway", "bios.cli")),
    Contract("the gateway uses the coordinator through its front door and its accounts facade, nothing else",
             ("bios.gateway",), ("bios.coordinator",),
             allowed=("bios.coordinator.front_door", "bios.coordinator.accounts")),
    *(Contract(f"front end {front} does not import front end {other}", (front,), (other,))
      for front in FRONT_ENDS for other in FRONT_ENDS if other != front),
]


@pytest.mark.parametrize("contract", CONTRACTS, ids=lambda c: c.name)
def test_import_contract(contract: Contract) -> None:
    violations = contract.violations()
    assert not violations, f"{contract.name}:\n" + "\n".join(f"  {v}" for v in violations)


def test_the_scan_sees_every_kind_of_import() -> None:
    """The contracts above pass only because the scan finds what they forbid where it exists."""
    assert len(_modules()) > 100
    codec = _imports_of("bios.transport.codec")
    assert any(i.module == "torch" and not i.top_level for i in codec)  # inside a function
    assert any(i.module == "bios.sdk.futures" for i in _imports_of("bios.sdk"))  # relative, in a package
    assert any(i.module == "bios.transport.codec" for i in _imports_of("bios.transport.sockets"))  # relative
    retries = _imports_of("bios.coordinator.retries")
    assert any(i.module == "bios.coordinator.runs" and not i.top_level for i in retries)  # TYPE_CHECKING
    assert any(i.module == "bios.sdk" for i in _imports_of("bios"))  # importlib.import_module("bios.sdk")
    assert Contract("probe", ("bios.transport",), HEAVY).violations()


def _chain_to(starts: list[str], targets: tuple[str, ...]) -> list[Import] | None:
    """The shortest chain of top-level imports from one of `starts` to a module in `targets`, if any."""
    came: dict[str, Import | None] = {s: None for s in starts}
    queue = deque(starts)
    while queue:
        module = queue.popleft()
        for imp in _imports_of(module):
            if not imp.top_level:
                continue
            hop = [m for m in _modules() if _within(imp.module, m)]  # the module and the packages above it
            if any(_within(imp.module, t) for t in targets):
                chain = [imp]
                while (step := came[chain[0].importer]) is not None:
                    chain.insert(0, step)
                return chain
            for nxt in hop:
                if nxt not in came:
                    came[nxt] = imp
                    queue.append(nxt)
    return None


def test_a_coordinator_process_never_loads_torch() -> None:
    """Exact: import every module of bios.coordinator in a fresh interpreter and look at what got loaded."""
    coordinator = sorted(m for m in _modules() if _within(m, "bios.coordinator"))
    code = ("import importlib, json, sys\n"
            f"for name in {coordinator!r}:\n"
            "    importlib.import_module(name)\n"
            f"print(json.dumps(sorted(n for n in {HEAVY!r} if n in sys.modules)))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    if loaded:
        chain = _chain_to(coordinator, HEAVY)
        where = " -> ".join(str(i) for i in chain) if chain else "(no static chain: a dynamic import)"
        pytest.fail(f"importing bios.coordinator loads {', '.join(loaded)}: {where}")
