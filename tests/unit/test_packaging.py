"""The package's metadata as setuptools reads it when installing: no deprecation on the way."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def test_pyproject_reads_without_setuptools_deprecations():
    """``license = { text = ... }`` is deprecated (setuptools fails such builds from 2027-02-18): the SPDX
    string form, which setuptools>=77 (the build requirement) reads as the license expression."""
    setuptools = pytest.importorskip("setuptools")
    from setuptools.config.pyprojecttoml import apply_configuration, read_configuration
    from setuptools.dist import Distribution

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = apply_configuration(Distribution(), str(PYPROJECT))
    deprecations = [str(w.message).splitlines()[0] for w in caught
                    if issubclass(w.category, (DeprecationWarning, setuptools.SetuptoolsDeprecationWarning))]
    assert deprecations == []
    assert dist.metadata.license_expression == "Apache-2.0"
    requires = read_configuration(str(PYPROJECT), expand=False)["build-system"]["requires"]
    assert "setuptools>=77" in requires
