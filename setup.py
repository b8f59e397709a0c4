"""The one thing pyproject.toml cannot say: the embedded default models stay in ``weights/`` at the
repository's top level, and an installed wheel carries them inside the package, as ``gencli/_weights``
(a package mapped to that folder, its files package data: see pyproject.toml), where
:func:`gencli.weights.weights_dir` finds them. A checkout (an editable install too) reads ``weights/``
itself. The package list is what ``[tool.setuptools.packages.find]`` would find, plus that one."""

from setuptools import find_namespace_packages, setup

setup(
    packages=[*find_namespace_packages(include=["gencli*"]), "gencli._weights"],
    package_dir={"gencli._weights": "weights"},
)
