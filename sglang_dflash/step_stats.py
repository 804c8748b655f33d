"""What the DFLASH worker counts about its decode steps, for benchmarks: tokens committed per verify step (by
the window verified, so that per-row acceptance counts only the steps that reached a row), the window each
decode batch verified, the tree steps' requests whose accepted path went beyond the draft's chain of first
choices, the adaptive window's estimates (window.py, when the window is adaptive), and (when
profiling) the wall time of each step phase. Off (the
default) it is NO_STATS, whose phase() is a null context and record() does nothing: the step pays nothing.

With the stats file setting (settings.py) the counts are kept in memory and the JSON file is rewritten after
every decode step (atomically: write, then rename): no device sync, a bincount and a small file. Only with
the profile setting as well is each phase timed, with a device sync on both sides so that it times the
work, not its launch. `sglang-dflash bench` reads the file before and after a run (bench.stats_figures).
"""

from __future__ import annotations

import contextlib
import json
import os
import time

import torch


class NoStats:
    def phase(self, name: str):
        return contextlib.nullcontext()

    def record(self, commit_lens: torch.Tensor, K: int, window_policy=None) -> None:
        pass

    def record_tree(self, tokens, depths, logprobs, paths, accept_len) -> None:
        pass


NO_STATS = NoStats()


class StepStats(NoStats):
    def __init__(self, path: str, max_window: int, device, profile: bool = False):
        self.path = path
        self.profile = profile
        # [K, n]: request steps of window K (K rows verified) that committed n tokens (n - 1 drafts accepted)
        self.accept_hist = torch.zeros(max_window + 1, max_window + 1, dtype=torch.long)
        self.window_hist = [0] * (max_window + 1)  # index k: decode batches that verified k rows per request
        self.decode_batches = 0
        self.beyond_chain = 0  # tree steps' requests whose accepted path took a row's second or later choice
        self.phase_seconds: dict[str, float] = {}
        cuda = str(device) != "cpu" and torch.cuda.is_available()
        self.sync = torch.cuda.synchronize if cuda else (lambda: None)

    def phase(self, name: str):
        return self._timed(name) if self.profile else contextlib.nullcontext()

    @contextlib.contextmanager
    def _timed(self, name: str):
        self.sync()
        t0 = time.perf_counter()
        yield
        self.sync()
        self.phase_seconds[name] = self.phase_seconds.get(name, 0.0) + time.perf_counter() - t0

    def record_tree(self, tokens, depths, logprobs, paths, accept_len) -> None:
        """A tree step (before its record()): tokens, depths [bs, N], the draft's logprobs [bs, N-1, V], the accepted
        paths [bs, D+1] and accept_len [bs]; counts the requests whose path went beyond the draft's chain of first
        choices (a node whose token is not its row's argmax), where the tree accepted what the chain could not."""
        first = torch.cat([tokens[:, :1], logprobs.argmax(-1)], dim=1)  # [bs, N]: by depth, the root's own token
        first_choice = tokens == first.gather(1, depths)  # [bs, N]
        place = torch.arange(paths.shape[1], device=paths.device)[None, :]
        beyond = ~first_choice.gather(1, paths) & (place <= accept_len[:, None])  # [bs, D+1]
        self.beyond_chain += int(beyond.any(1).sum())

    def record(self, commit_lens: torch.Tensor, K: int, window_policy=None) -> None:
        """One decode step: commit_lens [bs] tokens committed per request, K rows verified per request; the
        adaptive window's state (window.AdaptiveWindow.summary) when it chose K."""
        self.accept_hist[K] += torch.bincount(commit_lens.cpu(), minlength=self.accept_hist.shape[1])
        self.window_hist[K] += 1
        self.decode_batches += 1
        tmp = f"{self.path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"accept_length_histogram": self.accept_hist.sum(0).tolist(),
                       "accept_length_histogram_by_window": self.accept_hist.tolist(),
                       "decode_batches": self.decode_batches, "window_histogram": self.window_hist,
                       "tree_requests_beyond_the_chain": self.beyond_chain,
                       **({"phase_seconds": self.phase_seconds} if self.profile else {}),
                       **({"adaptive_window": window_policy.summary()} if window_policy is not None else {})}, f)
        os.replace(tmp, self.path)
