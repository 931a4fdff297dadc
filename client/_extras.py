"""What to install for an optional part, in the one wording every hint uses.

weightserve is not on a package index, so installing it by name with an extra fails: each
hint names the forms that work, from a checkout (``pip install -e '.[EXTRA]'``) or from the
wheel ``python -m build`` makes there.
"""

from __future__ import annotations

from types import ModuleType

# pyproject.toml's torch extra pins this version.
TORCH_REQUIREMENT = "torch==2.13.0"


def install_hint(extra: str, *also: str) -> str:
    """How to install weightserve's ``extra`` (and the requirements ``also``), one line."""
    more = "".join(f" '{requirement}'" for requirement in also)
    return (
        f"pip install -e '.[{extra}]'{more} in a checkout of weightserve (it is not on PyPI), "
        f"or build a wheel there with python -m build and pip install --find-links dist "
        f"'weightserve[{extra}]'{more}"
    )


def import_torch() -> ModuleType:
    """``torch``, or a ModuleNotFoundError that says what to install."""
    try:
        import torch
    except ModuleNotFoundError as e:
        if e.name != "torch":
            raise  # torch is there, something it imports is not
        raise ModuleNotFoundError(
            f"loading onto a device needs PyTorch: pip install {TORCH_REQUIREMENT} "
            f"(the version the torch extra pins: {install_hint('torch')})",
            name="torch",
        ) from None
    return torch
