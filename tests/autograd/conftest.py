"""Fresh random inputs on every run, with the seed reported when a test fails.

Each test that takes ``rng`` gets a generator from a newly drawn seed. On failure the seed is shown
in a "random seed" section of the report; rerun with ``TINYTRAIN_TEST_SEED=<seed>`` to get the
same inputs again.
"""

import os

import numpy
import pytest


@pytest.fixture
def rng(request):
    seed = int(os.environ.get("TINYTRAIN_TEST_SEED") or numpy.random.SeedSequence().entropy % 2**32)
    request.node.user_properties.append(("seed", seed))
    return numpy.random.default_rng(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    seeds = [value for key, value in item.user_properties if key == "seed"]
    if report.failed and seeds:
        report.sections.append(
            ("random seed", f"inputs drawn from seed {seeds[0]}; rerun with TINYTRAIN_TEST_SEED={seeds[0]}")
        )
