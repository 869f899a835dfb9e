"""The real vLLM sources, from the PyPI wheels, cached per machine (harness/wheel_cache.py): the
default profile's release (0.34.0) for the whole suite, and every release a profile names for
the tests that run per release (`release`).

`vllm_originals` extracts the files the patch profile touches from the wheel (downloaded once,
`pip download --no-deps`). `vllm_venv` is the test virtualenv with the torch and torchvision the
wheel itself pins (its METADATA's `torch==`/`torchvision==`: with a torchvision that matches its
torch, vLLM's ModelConfig can import the model class to inspect its architecture), the wheel
installed `--no-deps`, and only the dependencies its config and the Qwen4Exp PLE modules need
(venv-requirements.txt). Both are built under a lock and marked complete only at the end, so an
interrupted run is redone rather than trusted.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness import wheel_cache
from sparkple import patch
from sparkple.patch.profile import PROFILES_DIR


@pytest.fixture(scope="session")
def vllm_originals() -> Path:
    """The extracted `vllm` package directory (paths inside it as the profile names them);
    SPARKPLE_VLLM_SOURCES names others (the GPU check's, offline)."""
    sources = wheel_cache.given_sources()
    return sources / "vllm" if sources else wheel_cache.vllm_originals()


@pytest.fixture(scope="session")
def vllm_venv() -> Path:
    """Python of a venv with the default release's vLLM (no deps) that imports the Qwen4Exp PLE
    modules.

    SPARKPLE_VLLM_PYTHON names another interpreter with that vLLM instead, e.g. one with
    CUDA torch and triton, where the `gpu` test can run.
    """
    override = os.environ.get("SPARKPLE_VLLM_PYTHON")
    if override:
        return Path(override)
    return wheel_cache.vllm_venv()


# Every release a patch profile names, the default first.
RELEASES = [
    wheel_cache.VLLM_VERSION,
    *sorted(set(wheel_cache.RELEASES) - {wheel_cache.VLLM_VERSION}),
]


@dataclass(frozen=True)
class Release:
    """One vLLM release under test: its profile, its venv's Python and its extracted sources."""

    version: str
    profile: str
    python: Path
    originals: Path


def profile_of(version: str) -> str:
    """The patch profile made for vLLM `version`."""
    (name,) = (
        directory.name
        for directory in sorted(PROFILES_DIR.iterdir())
        if (directory / "profile.yml").is_file()
        and patch.load_profile(directory).vllm_version == version
    )
    return name


@pytest.fixture(scope="module", params=RELEASES)
def release(request: pytest.FixtureRequest) -> Release:
    """Each release in turn: the default's venv and sources as the fixtures above give them
    (overridable), the others' from the cache."""
    version = str(request.param)
    if version == wheel_cache.VLLM_VERSION:
        python = request.getfixturevalue("vllm_venv")
        originals = request.getfixturevalue("vllm_originals")
    else:
        python, originals = wheel_cache.vllm_venv(version), wheel_cache.vllm_originals(version)
    return Release(version, profile_of(version), python, originals)
