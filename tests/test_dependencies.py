"""setup.py's install_requires is what the package imports: a module imported unguarded is
declared (a fresh `pip install gigatron` then runs `gigatron convert` without "No module
named 'safetensors'"), an optional one is imported under `except ImportError` with the fix
in its message, and every declared package is used."""
import ast
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = ["parallel", "models", "ops", "training", "data", "engine", "cli", "package"]
# optional packages looked up before use, not imported under a guard
CHECKED_BEFORE_USE = {"wandb": "training/config/features.py checks it with --wandb-project"}


def install_requires():
    """The module names of setup.py's install_requires (version specifiers dropped)."""
    with open(os.path.join(REPO, "setup.py")) as f:
        tree = ast.parse(f.read())
    (keyword,) = [k for node in ast.walk(tree) if isinstance(node, ast.Call)
                  for k in node.keywords if k.arg == "install_requires"]
    names = [ast.literal_eval(e) for e in keyword.value.elts]
    return {n.split(">")[0].split("=")[0].split("<")[0].strip() for n in names}


def _guarded(node, parents):
    """Whether an import sits in a `try` whose handlers catch ImportError (or wider)."""
    for parent in parents.get(node, []):
        if isinstance(parent, ast.Try) and node not in parent.handlers:
            for handler in parent.handlers:
                names = ast.unparse(handler.type) if handler.type else "BaseException"
                if any(n in names for n in ("ImportError", "ModuleNotFoundError",
                                            "Exception")):
                    return True
    return False


def third_party_imports():
    """{top-level module: {file: guarded}} for every import in the package, in functions
    too; a file guards a module when one of its imports of it is guarded (the later ones,
    `import matplotlib.pyplot`, run only after the guarded `import matplotlib`)."""
    found = {}
    for top in SOURCES:
        for root, _, files in os.walk(os.path.join(REPO, top)):
            for name in sorted(f for f in files if f.endswith(".py")):
                path = os.path.join(root, name)
                with open(path) as f:
                    tree = ast.parse(f.read())
                parents = {}
                for parent in ast.walk(tree):
                    for child in ast.walk(parent):
                        if child is not parent:
                            parents.setdefault(child, []).append(parent)
                for node in ast.walk(tree):
                    if isinstance(node, ast.Import):
                        modules = [a.name for a in node.names]
                    elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                        modules = [node.module]
                    else:
                        continue
                    for module in modules:
                        top_name = module.split(".")[0]
                        if top_name not in sys.stdlib_module_names and top_name != "gigatron":
                            uses = found.setdefault(top_name, {})
                            where = os.path.relpath(path, REPO)
                            uses[where] = uses.get(where, False) or _guarded(node, parents)
    return found


def test_every_unguarded_import_is_an_install_requirement():
    declared = install_requires()
    missing = {module: sorted(path for path, guarded in uses.items() if not guarded)
               for module, uses in third_party_imports().items()
               if module not in declared and module not in CHECKED_BEFORE_USE}
    missing = {module: paths for module, paths in missing.items() if paths}
    assert not missing, f"imported without a guard, not in install_requires: {missing}"


def test_every_install_requirement_is_imported():
    assert install_requires() - set(third_party_imports()) == set()


def test_the_hugging_face_converter_needs_only_declared_packages():
    assert {"safetensors", "tokenizers", "sentencepiece"} <= install_requires()
