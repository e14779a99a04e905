"""Every Python block of README.md runs as written, so the README cannot rot.

A block fenced ```` ```python ```` is executed on its own (a fresh namespace, in a scratch folder
that links the repository's ``checkpoints/``). A block fenced ```` ```python check-only ```` (it
needs a GPU, a trained model in hand or minutes of CPU) is checked as far as that is possible
without running it: it parses, every import resolves, and every call of an imported name binds
to that name's signature (so a renamed function or keyword fails here)."""
import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parent.parent
FENCE = re.compile(r"^```python([^\n]*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
TAGS = ("", "check-only")


def readme_blocks() -> list[tuple[str, str, str]]:
    """``(where, tag, source)`` of each Python block of README.md (``where``: ``README.md:LINE``)."""
    text = (ROOT / "README.md").read_text()
    return [(f"README.md:{text.count(chr(10), 0, m.start()) + 2}", m[1].strip(), m[2])
            for m in FENCE.finditer(text)]


BLOCKS = readme_blocks()


def _imported_names(tree: ast.AST) -> dict:
    """Name -> object for every import in ``tree`` (an import that fails raises here)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                module = importlib.import_module(a.name)  # `import a.b` binds `a`, `import a.b as c` binds a.b
                top = a.name.split(".")[0]
                names[a.asname or top] = module if a.asname else importlib.import_module(top)
        elif isinstance(node, ast.ImportFrom):
            module = importlib.import_module(node.module)
            for a in node.names:
                names[a.asname or a.name] = getattr(module, a.name)
    return names


def check_statically(source: str, where: str) -> int:
    """Parse ``source``, resolve its imports and bind each call of an imported name to its
    signature; returns the number of calls checked."""
    tree = ast.parse(source, filename=where)
    names = _imported_names(tree)
    checked = 0
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names):
            continue
        if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
            continue
        try:
            inspect.signature(names[node.func.id]).bind(*node.args, **{k.arg: k.value for k in node.keywords})
        except TypeError as err:
            raise AssertionError(f"{where}: {ast.unparse(node)}: {err}") from None
        checked += 1
    return checked


def test_the_readme_has_python_blocks_and_only_known_tags():
    assert sum(tag == "" for _, tag, _ in BLOCKS) >= 2
    assert all(tag in TAGS for _, tag, _ in BLOCKS), [(w, t) for w, t, _ in BLOCKS if t not in TAGS]


@pytest.mark.parametrize("where, tag, source", BLOCKS, ids=[w for w, _, _ in BLOCKS])
def test_readme_block(where, tag, source, tmp_path, monkeypatch, capsys):
    if tag == "check-only":
        assert check_statically(source, where) >= 1
        return
    (tmp_path / "checkpoints").symlink_to(ROOT / "checkpoints")
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    exec(compile(source, where, "exec"), {"__name__": "__readme__"})


def test_static_check_catches_a_wrong_keyword_and_a_missing_name():
    with pytest.raises(AssertionError, match="unexpected keyword argument 'sample'"):
        check_statically("from qedprobe.eval import run_eig\nrun_eig(None, [], sample=3)", "x")
    with pytest.raises(AttributeError):
        check_statically("from qedprobe.eval import no_such_function", "x")
