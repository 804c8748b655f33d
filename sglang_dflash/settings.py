"""The settings SGLang's own server arguments do not carry, in one place: environment variables, read once
per process (settings()), checked, and logged in one start-up line (describe()). README.md's settings
table lists the same variables.

    SGLANG_DFLASH_IMPL        sglang_dflash (default): --speculative-algorithm DFLASH runs this package's
                              worker; builtin: SGLang's own DFLASH runs, untouched (side-by-side runs)
    SGLANG_DFLASH_STATS_FILE  a path: the worker counts committed tokens per verify step and the windows it
                              verified, in memory, and rewrites this JSON file after every decode step (for
                              `sglang-dflash bench`); unset: off
    SGLANG_DFLASH_PROFILE     1: the stats also time each step phase, with a device sync on both sides of
                              each (which costs a GPU its overlap of host and device work); 0 (default): not
    SGLANG_DFLASH_HOME        where set-up, fixtures and training work folders live (~/.cache/sglang-dflash)

Build-time only (setup.py, launch/setup.sh): SGLANG_DFLASH_BUILD_CUDA (auto / 0 / 1) and
SGLANG_DFLASH_PYTHON (the interpreter set-up builds the environment with).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path

IMPL, STATS_FILE, PROFILE, HOME = "SGLANG_DFLASH_IMPL", "SGLANG_DFLASH_STATS_FILE", "SGLANG_DFLASH_PROFILE", "SGLANG_DFLASH_HOME"
CHOICES = {IMPL: ("sglang_dflash", "builtin"), PROFILE: ("0", "1")}
# The verify window is SGLang's own flags' (--speculative-num-draft-tokens, --speculative-adaptive: plugin.py);
# SGLANG_DFLASH_WINDOW, which chose it before, is refused by name so that a stale setting is not silently ignored.
RETIRED = {"SGLANG_DFLASH_WINDOW": "the verify window is adaptive by default (no --speculative-num-draft-tokens) "
                                   "or with --speculative-adaptive; --speculative-num-draft-tokens K alone fixes it"}


@dataclasses.dataclass(frozen=True)
class Settings:
    impl: str = "sglang_dflash"  # SGLANG_DFLASH_IMPL
    stats_file: str | None = None  # SGLANG_DFLASH_STATS_FILE
    profile: bool = False  # SGLANG_DFLASH_PROFILE
    home: Path = Path.home() / ".cache" / "sglang-dflash"  # SGLANG_DFLASH_HOME

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "Settings":
        """The settings of env (default os.environ); a value outside a variable's choices is an error naming it."""
        env = os.environ if env is None else env
        for name, why in RETIRED.items():
            if name in env:
                raise ValueError(f"{name} is no longer read: {why}")
        for name, choices in CHOICES.items():
            if name in env and env[name] not in choices:
                raise ValueError(f"{name}={env[name]!r}: expected one of {', '.join(map(repr, choices))}")
        d = cls()
        s = cls(impl=env.get(IMPL, d.impl), stats_file=env.get(STATS_FILE) or None,
                profile=env.get(PROFILE, "0") == "1", home=Path(env[HOME]) if env.get(HOME) else d.home)
        if s.profile and not s.stats_file:
            raise ValueError(f"{PROFILE}=1 needs {STATS_FILE}: the phase timings are written there")
        return s

    def describe(self) -> str:
        """One line for the start-up log."""
        return (f"{IMPL}={self.impl} {STATS_FILE}={self.stats_file or '(off)'} "
                f"{PROFILE}={int(self.profile)} {HOME}={self.home}")


@functools.cache
def settings() -> Settings:
    """This process's settings, read from its environment the first time they are asked for."""
    return Settings.from_env()
