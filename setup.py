"""Install gigatron: the top-level folders become the `gigatron.*` namespace.

The repository root shows the architecture (parallel/, models/, ops/, ...); `package_dir`
maps each folder to `gigatron.<folder>` so code imports `gigatron.parallel.topology`.
"""
from setuptools import find_packages, setup

TOP_LEVEL = ["parallel", "models", "ops", "training", "datasets"]


def _packages():
    packages, package_dir = [], {}
    for top in TOP_LEVEL:
        for sub in [top] + [f"{top}.{p}" for p in find_packages(top)]:
            name = "gigatron." + sub
            packages.append(name)
            package_dir[name] = sub.replace(".", "/")
    return packages, package_dir


packages, package_dir = _packages()
setup(
    name="gigatron",
    version="0.1.0",
    description="Megatron-like 3D-parallel GPT training that runs anywhere, down to a laptop CPU",
    python_requires=">=3.10",
    packages=packages,
    package_dir=package_dir,
    install_requires=["torch>=2.4", "numpy", "einops", "sentencepiece", "tokenizers"],
    extras_require={
        "test": ["pytest>=7", "tokenizers", "safetensors"],
        "monitor": ["tensorboard"],
    },
)
