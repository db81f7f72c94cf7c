"""No top-level folder of the repository shadows a well-known package when Python runs from
the repository root (where the README's commands run): `datasets` was Hugging Face's."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# packages the field's tooling imports by these names (Hugging Face, PyTorch, numpy, ...)
WELL_KNOWN = ("datasets", "transformers", "tokenizers", "safetensors", "accelerate", "evaluate",
              "deepspeed", "megatron", "apex", "torch", "numpy", "horovod", "gigatron")


def test_no_repository_folder_shadows_a_well_known_package():
    shadowing = [name for name in WELL_KNOWN if os.path.isdir(os.path.join(ROOT, name))
                 and os.path.isfile(os.path.join(ROOT, name, "__init__.py"))]
    assert shadowing == []


def test_import_datasets_from_repository_root_is_not_ours():
    code = ("import importlib.util, os, sys; spec = importlib.util.find_spec('datasets'); "
            "print('none' if spec is None else os.path.dirname(spec.origin or ''))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "none" or not out.startswith(ROOT), out
