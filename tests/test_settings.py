"""settings.py: the environment variables, read and checked in one place."""

from pathlib import Path

import pytest

from sglang_dflash.settings import Settings

pytestmark = pytest.mark.unit


def test_defaults_values_and_the_start_up_line():
    assert Settings.from_env({}) == Settings()
    s = Settings.from_env({"SGLANG_DFLASH_IMPL": "builtin", "SGLANG_DFLASH_STATS_FILE": "/tmp/s.json",
                           "SGLANG_DFLASH_PROFILE": "1", "SGLANG_DFLASH_HOME": "/tmp/h"})
    assert s == Settings(impl="builtin", stats_file="/tmp/s.json", profile=True, home=Path("/tmp/h"))
    assert s.describe() == ("SGLANG_DFLASH_IMPL=builtin SGLANG_DFLASH_STATS_FILE=/tmp/s.json SGLANG_DFLASH_PROFILE=1 "
                            "SGLANG_DFLASH_HOME=/tmp/h")
    with pytest.raises(ValueError, match="SGLANG_DFLASH_PROFILE=1 needs SGLANG_DFLASH_STATS_FILE"):
        Settings.from_env({"SGLANG_DFLASH_PROFILE": "1"})
    assert "SGLANG_DFLASH_STATS_FILE=(off)" in Settings.from_env({"SGLANG_DFLASH_STATS_FILE": ""}).describe()


@pytest.mark.parametrize("name", ["SGLANG_DFLASH_IMPL", "SGLANG_DFLASH_PROFILE"])
def test_a_value_outside_the_choices_is_an_error_naming_the_variable(name):
    with pytest.raises(ValueError, match=f"{name}='adpative': expected one of"):
        Settings.from_env({name: "adpative"})


def test_the_retired_window_variable_is_refused_by_name():
    """The verify window is SGLang's flags' now: a stale SGLANG_DFLASH_WINDOW stops the process, never ignored."""
    with pytest.raises(ValueError, match="SGLANG_DFLASH_WINDOW is no longer read: the verify window is adaptive"):
        Settings.from_env({"SGLANG_DFLASH_WINDOW": "adaptive"})
