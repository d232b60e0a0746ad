"""A ``TGDIST_PLUGINS`` module for the tests: counts the calls of the one check of a config
(``tgdist.runtime.build._validate``, which ``validate`` and ``precheck`` call) in its process, and
writes the count to ``$TGDIST_TEST_VALIDATIONS`` when the process ends."""

import atexit
import os

from tgdist.runtime import build

_checks = build._validate
calls: list[int] = []


def _counted(cfg):
    calls.append(1)
    return _checks(cfg)


build._validate = _counted
atexit.register(lambda: open(os.environ["TGDIST_TEST_VALIDATIONS"], "w").write(str(len(calls))))
