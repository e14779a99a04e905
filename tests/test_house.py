"""The house stays livable: no function of the package over 60 lines (Triton kernels aside), and
the import graph inside ``qedprobe`` has no circle, between modules or between its sub-packages
(a circle between sub-packages is an arrow that runs back up: ``model`` importing ``eval`` while
``eval`` imports ``model``). Read from the source with ``ast``; nothing is imported."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"qedprobe": ROOT / "qedprobe", "qedprobe.kernels": ROOT / "kernels", "qedprobe.hooks": ROOT / "hooks"}
"""Module prefix -> folder (``kernels/`` and ``hooks/`` install as ``qedprobe.kernels`` / ``.hooks``)."""
MAX_LINES = 60


def modules() -> dict[str, Path]:
    """Every module of the package, by dotted name (a package by its ``__init__.py``)."""
    out = {}
    for prefix, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([prefix, *parts])] = path
    return out


def is_triton_kernel(fn: ast.FunctionDef) -> bool:
    """Decorated with ``triton.jit`` (or ``@triton.jit(...)``, ``@triton.autotune`` over it)."""
    for dec in fn.decorator_list:
        target = dec.func if isinstance(dec, ast.Call) else dec
        if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "triton":
            return True
    return False


def long_functions() -> list[str]:
    """``path:line name (N lines)`` of every function longer than :data:`MAX_LINES`, from its
    ``def`` line to its last line."""
    found = []
    for path in modules().values():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not is_triton_kernel(node):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_LINES:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def imported_modules(name: str, path: Path, known: dict) -> set[str]:
    """The package's modules that module ``name`` imports anywhere in its body (also inside
    functions): ``from a import b`` names module ``a.b`` when that is a module, else ``a``."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        out.update(t for t in targets if t in known and t != name)
    return out


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imported_modules(name, path, known) for name, path in known.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def room(module: str) -> str:
    """The sub-package (or top-level module) a module belongs to: ``qedprobe.eval.sweep`` ->
    ``qedprobe.eval``; ``qedprobe.kernels.qed.chunk`` -> ``qedprobe.kernels``."""
    parts = module.split(".")
    return ".".join(parts[:2])


def test_no_function_is_longer_than_sixty_lines():
    assert long_functions() == []


def test_no_module_imports_itself_through_others():
    assert circles(import_graph()) == []


def test_no_subpackage_imports_one_that_imports_it_back():
    rooms = {}
    for module, targets in import_graph().items():
        rooms.setdefault(room(module), set()).update(room(t) for t in targets if room(t) != room(module))
    assert circles(rooms) == []


def test_the_checks_find_what_they_look_for(tmp_path):
    """The helpers see a long function, a Triton kernel, a relative import and a circle."""
    fn = ast.parse("def f():\n" + "    x = 1\n" * 70 + "\n@triton.jit\ndef k():\n    pass\n")
    long_fn, kernel = [n for n in fn.body if isinstance(n, ast.FunctionDef)]
    assert long_fn.end_lineno - long_fn.lineno + 1 > MAX_LINES and not is_triton_kernel(long_fn)
    assert is_triton_kernel(kernel)
    (tmp_path / "m.py").write_text("from .store import x\nfrom qedprobe.eval import plots\n")
    known = {"qedprobe.eval.m": None, "qedprobe.eval.store": None, "qedprobe.eval.plots": None, "qedprobe.eval": None}
    assert imported_modules("qedprobe.eval.m", tmp_path / "m.py", known) == {"qedprobe.eval.store", "qedprobe.eval.plots"}
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert room("qedprobe.kernels.qed.chunk") == "qedprobe.kernels" and room("qedprobe.tokenizer") == "qedprobe.tokenizer"
