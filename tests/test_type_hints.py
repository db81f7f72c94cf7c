"""Every public function of the package has type hints on all its arguments and its return,
so the type check in CI (.ci/typecheck.sh, mypy) reads the whole API, not only its typed half.

Public: a module-level function or a method of a public class whose name does not start
with `_` (constructors and `__call__` included). `self`/`cls` need no hint, `__init__` no
return hint.
"""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _package_folders() -> list:
    """Every folder installed as gigatron.* (setup.py's TOP_LEVEL) and package/, the
    namespace's own files: none can be left out of the check."""
    tree = ast.parse(open(os.path.join(ROOT, "setup.py")).read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "TOP_LEVEL":
            return ast.literal_eval(node.value) + ["package"]
    raise AssertionError("setup.py has no TOP_LEVEL list")


def _missing_hints(node: ast.AST, where: str, public: bool):
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.ClassDef):
            yield from _missing_hints(child, f"{where}{child.name}.",
                                      public and not child.name.startswith("_"))
        elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = child.name
            if not public or (name.startswith("_") and name not in ("__init__", "__call__")):
                continue
            a = child.args
            args = [x for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]
            args += [x for x in (a.vararg, a.kwarg) if x is not None]
            bare = [x.arg for x in args if x.annotation is None]
            if child.returns is None and name != "__init__":
                bare.append("return")
            if bare:
                yield f"{where}{name} (line {child.lineno}): {', '.join(bare)}"


def test_every_public_function_has_full_type_hints():
    missing = []
    folders = _package_folders()
    assert "engine" in folders and "training" in folders, folders
    for folder in folders:
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            for name in sorted(files):
                if name.endswith(".py"):
                    path = os.path.join(dirpath, name)
                    with open(path) as f:
                        tree = ast.parse(f.read(), path)
                    rel = os.path.relpath(path, ROOT)
                    missing += _missing_hints(tree, f"{rel}: ", True)
    assert missing == [], "public functions without full type hints:\n" + "\n".join(missing)


def test_the_check_finds_a_function_without_hints():
    tree = ast.parse("def f(x, y: int) -> int: ...\nclass C:\n    def g(self, z: int): ...\n")
    assert list(_missing_hints(tree, "m: ", True)) == ["m: f (line 1): x",
                                                        "m: C.g (line 3): return"]
