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


@pytest.fixture
def fresh_settings(monkeypatch):
    """settings() read anew from this test's environment, and again after it."""
    from sglang_dflash.settings import settings

    settings.cache_clear()
    yield monkeypatch
    monkeypatch.undo()
    settings.cache_clear()


def test_a_bad_setting_stops_a_dflash_server_instead_of_leaving_it_to_sglangs_builtin(fresh_settings):
    """SGLang's load_plugins logs a plugin's exception and goes on: were register() to raise on a bad setting,
    SGLang's own DFLASH would run in our place. The plugin registers the request checks and hooks that stop
    DFLASH's argument handling and worker with the setting's message; other algorithms are unaffected."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_dflash import plugin, request_checks

    registered = {}
    fresh_settings.setattr(HookRegistry, "register", lambda target, hook, kind: registered.setdefault(target, hook))
    fresh_settings.setattr(plugin, "_registered", False)
    fresh_settings.setenv("SGLANG_DFLASH_WINDOW", "adaptive")
    plugin.register()
    assert set(registered) == {request_checks.VALIDATE_REQUEST, plugin.HANDLE_ARGS, plugin.CREATE_WORKER}
    message = "sglang-dflash cannot run DFLASH: SGLANG_DFLASH_WINDOW is no longer read"
    with pytest.raises(ValueError, match=message):
        registered[plugin.HANDLE_ARGS](lambda args: None, object())

    class Algorithm:
        def __init__(self, dflash):
            self.is_dflash = lambda: dflash

    with pytest.raises(ValueError, match=message):
        registered[plugin.CREATE_WORKER](lambda self, args: "builtin", Algorithm(True), object())
    assert registered[plugin.CREATE_WORKER](lambda self, args: "eagle", Algorithm(False), object()) == "eagle"
