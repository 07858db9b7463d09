"""Worker output: to the console (``[rank N]``-prefixed), to per-attempt log files, or both.

Layout of ``--log-dir DIR``: ``DIR/<run id>_<8 hex>/attempt_<N>/<local rank>/`` holding
``stdout.log``, ``stderr.log`` and ``error.json`` (the worker's ``TORCHELASTIC_ERROR_FILE``);
``attempt_<N>/filtered_stdout.log`` and ``filtered_stderr.log`` hold the lines that
``--duplicate-*-filters`` picked, from every local rank.
"""

from __future__ import annotations

import collections
import os
import threading
from dataclasses import dataclass
from typing import IO

from plugdist._launcher.config import LaunchConfig

__all__ = ["Duplicate", "Sink", "StreamPlan", "plan_streams", "pump"]

_MAX_CHUNK = 1 << 16        # longest piece read at once, so one endless line cannot eat memory


class Sink:
    """A binary output shared by reader threads: whole writes under a lock, flushed at once.

    A broken destination (reader of our stdout went away) is dropped, never raised, so the
    workers' pipes keep draining and no worker blocks on a full pipe.
    """

    def __init__(self, stream: IO[str] | IO[bytes], binary: bool = False) -> None:
        self._stream = stream
        self._binary: IO[bytes] | None = (stream if binary  # type: ignore[assignment]
                                          else getattr(stream, "buffer", None))
        self._lock = threading.Lock()
        self._broken = False

    def write(self, data: bytes) -> None:
        with self._lock:
            if self._broken:
                return
            try:
                if self._binary is not None:
                    self._binary.write(data)
                    self._binary.flush()
                else:
                    self._stream.write(data.decode("utf-8", "replace"))  # type: ignore[call-overload]
                    self._stream.flush()
            except (OSError, ValueError):
                self._broken = True

    def text(self, message: str) -> None:
        self.write((message + "\n").encode("utf-8", "replace"))

    def close(self) -> None:
        with self._lock:
            try:
                self._stream.close()
            except OSError:
                pass


@dataclass(frozen=True)
class StreamPlan:
    """Where one stream of one worker goes."""

    console: bool
    file: str | None

    @property
    def piped(self) -> bool:
        return self.file is not None or self.console


def plan_streams(cfg: LaunchConfig, local_rank: int, rank_dir: str | None,
                 ) -> tuple[StreamPlan, StreamPlan]:
    """(stdout, stderr) plans of one worker. ``rank_dir``: its log directory (None: no files).

    ``-r`` sends a stream to its file only, ``-t`` to both; with ``--log-dir`` and neither, both
    streams are kept in files and shown. ``--local-ranks-filter`` hides other ranks' console
    output (files keep it)."""
    shown = cfg.local_ranks_filter is None or local_rank in cfg.local_ranks_filter
    redirect, tee = cfg.redirects.of(local_rank), cfg.tee.of(local_rank)
    plans = []
    for bit, name in ((1, "stdout"), (2, "stderr")):
        to_file = rank_dir is not None and (cfg.log_dir is not None or (redirect | tee) & bit)
        path = os.path.join(rank_dir, f"{name}.log") if to_file and rank_dir else None
        plans.append(StreamPlan(console=shown and not redirect & bit, file=path))
    return plans[0], plans[1]


@dataclass(frozen=True)
class Duplicate:
    """``--duplicate-*-filters``: lines containing any of ``needles`` also go to ``sink``
    (prefixed like the console), the attempt's ``filtered_<stream>.log``."""

    sink: Sink
    needles: tuple[bytes, ...]


def pump(src: IO[bytes], console: Sink | None, prefix: bytes, file: Sink | None,
         tail: collections.deque[bytes] | None, duplicate: Duplicate | None = None) -> None:
    """Copy ``src`` line by line to the console (prefixed) and the file until EOF (runs in a
    reader thread); keep the last lines in ``tail``; copy matching lines to ``duplicate``."""
    at_line_start = True
    try:
        while True:
            chunk = src.readline(_MAX_CHUNK)
            if not chunk:
                break
            if tail is not None:
                tail.append(chunk)
            if file is not None:
                file.write(chunk)
            if duplicate is not None and any(n in chunk for n in duplicate.needles):
                duplicate.sink.write((prefix if at_line_start else b"") + chunk
                                     + (b"" if chunk.endswith(b"\n") else b"\n"))
            if console is not None:
                console.write((prefix if at_line_start and prefix else b"") + chunk)
            at_line_start = chunk.endswith(b"\n")
        if console is not None and prefix and not at_line_start:
            console.write(b"\n")  # keep the next rank's prefixed line on a line of its own
    except (OSError, ValueError):
        pass
    finally:
        src.close()
        if file is not None:
            file.close()
        if duplicate is not None:
            duplicate.sink.close()
