"""Which packages the distribution holds; everything else about it is in ``pyproject.toml``.

The top-level folders ``kernels/`` and ``hooks/`` are installed as ``qedprobe.kernels`` and
``qedprobe.hooks`` (``PACKAGE_DIRS``), so they are imported only under ``qedprobe.`` and no bare
``import kernels`` / ``import hooks`` ever exists. Every folder with an ``__init__.py`` below
``qedprobe/``, ``kernels/`` and ``hooks/`` is found (``find_packages``), so a new sub-package needs
no entry here or in ``pyproject.toml``.
"""
from setuptools import find_packages, setup

PACKAGE_DIRS = {"qedprobe": "qedprobe", "qedprobe.kernels": "kernels", "qedprobe.hooks": "hooks"}


def discover_packages() -> list[str]:
    """``qedprobe``, ``qedprobe.kernels``, ``qedprobe.hooks`` and every package below their folders."""
    return sorted(f"{name}.{sub}" if sub else name
                  for name, folder in PACKAGE_DIRS.items() for sub in ["", *find_packages(folder)])


setup(package_dir=PACKAGE_DIRS, packages=discover_packages())
