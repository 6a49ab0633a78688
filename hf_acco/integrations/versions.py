"""The releases of the Hugging Face libraries this version of hf_acco was tested with.

``ACCOTrainer`` overrides private methods of ``transformers.Trainer`` and ``prepare_acco`` calls Accelerate's
``prepare_model(..., evaluation_mode=True)``: a new minor release can change them without notice. The exact
versions the test suite passed with are in ``constraints.txt``; outside the ranges below, importing the glue
gives one warning that names them (``make test-latest`` runs the suite against the newest releases).
"""

from __future__ import annotations

import warnings
from importlib.metadata import PackageNotFoundError, version

from packaging.version import Version

# package: (lowest tested, first untested): the oldest and the newest pair `make test-range` ran the default suite on
# (benchmarks/results/test_range/); constraints.txt pins the pair the project develops on (CI's run)
TESTED = {
    "transformers": ("5.19", "5.26"),
    "accelerate": ("1.14", "1.17"),
}
_warned: set[str] = set()


class UntestedVersionWarning(UserWarning):
    """A library hf_acco's glue depends on is at a release outside the tested range."""


def warn_if_untested(package: str) -> None:
    """Warn once per process if ``package`` is installed at a version outside ``TESTED[package]``."""
    if package in _warned:
        return
    _warned.add(package)
    try:
        installed = Version(version(package))
    except PackageNotFoundError:
        return
    low, high = TESTED[package]
    if not Version(low) <= Version(installed.base_version) < Version(high):
        warnings.warn(
            f"hf_acco was tested with {package}>={low},<{high}; {package} {installed} is installed. ACCOTrainer "
            f"overrides private {package} methods that a new release may change: if training fails or differs, "
            f'install the tested versions with `pip install -c constraints.txt -e ".[tests]"` from the hf_acco '
            "checkout, or report what broke.",
            UntestedVersionWarning,
            stacklevel=3,
        )
