"""Install gigatron: the top-level folders become the `gigatron.*` namespace.

The repository root shows the architecture (parallel/, models/, ops/, ...); `package_dir`
maps each folder to `gigatron.<folder>` so code imports `gigatron.parallel.topology`.
`package/` holds the namespace's own files (`python -m gigatron`), `csrc/` is installed as
`gigatron/csrc` for the just-in-time kernel build, and the Megatron-style scripts
(pretrain_gpt.py, tools/*.py) are installed as scripts next to the `gigatron` command.

Contributors: `pip install -e '.[test]' --config-settings editable_mode=strict` builds a
static link tree that editors, mypy and pyright resolve (re-run it after adding a file).
"""
import os

from setuptools import find_packages, setup

TOP_LEVEL = ["parallel", "models", "ops", "training", "data", "engine", "cli"]
# files that are not Python modules but that an installed gigatron needs
PACKAGE_DATA = {
    "gigatron.models.zoo": ["*.json"],
    "gigatron.csrc": ["*.cpp", "*.cu", "*.cuh", "*.h", "*.sh"],
    "gigatron": ["py.typed"],
}
SCRIPTS = ["pretrain_gpt.py", "tools/preprocess_data.py", "tools/train_tokenizer.py"]


def _packages():
    """Every package under the top-level folders, plus `gigatron` itself and its csrc/ data."""
    packages, package_dir = ["gigatron", "gigatron.csrc"], {"gigatron": "package",
                                                            "gigatron.csrc": "csrc"}
    for top in TOP_LEVEL:
        for sub in [top] + [f"{top}.{p}" for p in find_packages(top)]:
            name = "gigatron." + sub
            packages.append(name)
            package_dir[name] = sub.replace(".", "/")
    return packages, package_dir


def _cuda_extension():
    """Fused kernels from csrc/ as gigatron.ops._fused_kernels, only when GIGATRON_BUILD_CUDA=1.

    Needs a CUDA torch and nvcc: `GIGATRON_BUILD_CUDA=1 pip install -e . --no-build-isolation`
    (TORCH_CUDA_ARCH_LIST="8.0;9.0" picks the GPUs; default: the ones present).
    """
    if os.environ.get("GIGATRON_BUILD_CUDA") != "1":
        return {}
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension

    if torch.version.cuda is None or CUDA_HOME is None:
        raise SystemExit("GIGATRON_BUILD_CUDA=1 needs a CUDA build of torch and nvcc (CUDA_HOME); "
                         f"found torch {torch.__version__}, CUDA_HOME={CUDA_HOME}. Unset it to skip.")
    csrc = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
    ext = CUDAExtension(
        "gigatron.ops._fused_kernels",
        sources=[f"csrc/{name}" for name in ("binding.cpp", "softmax.cu", "norms.cu")],
        include_dirs=[csrc],
        extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3", "-lineinfo"]},
    )
    return {"ext_modules": [ext], "cmdclass": {"build_ext": BuildExtension}}


packages, package_dir = _packages()
setup(
    name="gigatron",
    version="0.1.0",
    description="Megatron-like 3D-parallel GPT training that runs anywhere, down to a laptop CPU",
    python_requires=">=3.10",
    packages=packages,
    package_dir=package_dir,
    package_data=PACKAGE_DATA,
    include_package_data=False,
    scripts=SCRIPTS,
    entry_points={"console_scripts": ["gigatron = gigatron.cli:main"]},
    # safetensors: `gigatron convert` (Hugging Face folders) and --ckpt-format safetensors
    install_requires=["torch>=2.4", "numpy", "sentencepiece", "tokenizers", "safetensors"],
    extras_require={
        # the tests cover every optional path, so they need the optional packages too
        # pytest-xdist: the README's test command runs the files on 2 workers (--dist loadfile)
        "test": ["pytest>=7", "pytest-xdist", "tensorboard", "matplotlib", "transformers",
                 "tiktoken", "megatron-core==0.16.1",  # megatron-core: the import oracle
                 "import-linter",  # the import contracts in pyproject.toml
                 "accelerate"],  # the "auto" values accelerate fills (test_deepspeed_auto.py)
        "monitor": ["tensorboard"],
        "plot": ["matplotlib"],  # gigatron plot metrics.jsonl
    },
    **_cuda_extension(),
)
