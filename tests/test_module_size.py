"""Every module of the package stays readable in one sitting: at most 700 lines (issue 26: the studies
and the Triton modules were split by part, not by line count). A module that grows past the cap is
split by what it does, as ops/_triton_solve.py (host) and ops/_triton_solve_kernels.py (device) were."""

from pathlib import Path

import pytest

import kernelmix

MAX_MODULE_LINES = 700
PACKAGE = Path(kernelmix.__file__).parent
MODULES = sorted(PACKAGE.rglob("*.py"))


def test_the_package_has_modules():
    assert len(MODULES) > 50, f"found only {len(MODULES)} modules under {PACKAGE}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_is_at_most_700_lines(path):
    lines = len(path.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_MODULE_LINES, (f"{path.relative_to(PACKAGE)} has {lines} lines (cap {MAX_MODULE_LINES}): "
                                       "split it by what its parts do")
