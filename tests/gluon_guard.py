"""Where triton has no Gluon, the Gluon tests skip, except in CI: CI installs the newest triton, which has
Gluon, so there a missing Gluon is a break that a skip would hide."""
import os

import pytest


def require_gluon(have_gluon: bool, module_level: bool = False) -> None:
    if have_gluon:
        return
    if os.environ.get("CI"):
        pytest.fail("this triton has no Gluon (triton.experimental.gluon did not import) in CI", pytrace=False)
    pytest.skip("this triton has no Gluon", allow_module_level=module_level)
