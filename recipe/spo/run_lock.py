"""One run per checkpoint folder at a time: a launch holds a lock file in ``trainer.default_local_dir``
while it trains, and a second launch into the folder is refused before Ray, naming the holder.

Two runs writing into one folder interleave their ``global_step_*`` checkpoints and their configuration
records, and verl's ``resume_mode=auto`` then resumes whichever wrote last. The lock names the driver's
process, host and start time (``LOCK_FILE``, YAML). Only the driver holds it, the process that runs
``recipe.spo.main_spo`` on the launching node: the workers on other nodes write their checkpoint shards
under the driver's lock and take none of their own.

A driver killed without cleaning up (SIGKILL, a node lost) leaves its lock behind. On the same host its
process id tells: a lock whose process is gone is stale and the next launch takes it over. A lock from
another host (the folder on a shared file system) cannot be checked that way, so the holder refreshes the
file's modification time every ``HEARTBEAT_S`` seconds and such a lock is stale once it has not been
refreshed for ``STALE_AFTER_S``.
"""

from __future__ import annotations

import datetime
import os
import socket
import threading
import time
from pathlib import Path

import yaml

from recipe.spo.resume_guard import NEW_FOLDER

LOCK_FILE = "spo_run.lock"
HEARTBEAT_S = 60.0
# Ten missed heartbeats: a driver busy for minutes (a long save) still refreshes from its own thread.
STALE_AFTER_S = 600.0


def lock_path(folder: str | Path) -> Path:
    return Path(folder) / LOCK_FILE


def read_holder(path: Path) -> dict | None:
    """The holder the lock file names, None where there is no lock; an unreadable lock names nothing."""
    try:
        text = path.read_text()
        modified = path.stat().st_mtime
    except FileNotFoundError:
        return None
    try:
        holder = yaml.safe_load(text)
    except yaml.YAMLError:
        holder = None
    holder = holder if isinstance(holder, dict) else {}
    holder["refreshed"] = modified
    return holder


def pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: running
        return True
    return True


def is_stale(holder: dict, now: float | None = None, host: str | None = None) -> tuple[bool, str]:
    """(stale, why) for a lock's holder."""
    now = time.time() if now is None else now
    host = socket.gethostname() if host is None else host
    pid = holder.get("pid")
    if holder.get("host") == host and isinstance(pid, int):
        if pid_running(pid):
            return False, f"process {pid} is running on this host"
        return True, f"process {pid} no longer runs on this host"
    age = now - holder["refreshed"]
    if age > STALE_AFTER_S:
        return True, f"not refreshed for {age:.0f} s (a running driver refreshes it every {HEARTBEAT_S:.0f} s)"
    return False, f"refreshed {age:.0f} s ago"


def describe(holder: dict) -> str:
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, started {holder.get('started', '?')}"


def lock_problem(folder: str | Path, now: float | None = None, host: str | None = None) -> tuple[str | None, str]:
    """(why a launch may not train into ``folder`` now, what it found): the first None where it may."""
    path = lock_path(folder)
    holder = read_holder(path)
    if holder is None:
        return None, "not in use by another run"
    stale, why = is_stale(holder, now, host)
    if stale:
        return None, f"a stale lock ({path}: {describe(holder)}; {why}) is taken over at launch"
    return (f"trainer.default_local_dir={folder} is in use by another run: {path} names {describe(holder)}; {why}. "
            f"One run per checkpoint folder: wait for that run to end, or, for a new run, {NEW_FOLDER}; if that run "
            f"is gone, delete {path}"), why


class RunLock:
    """The lock held by this process (the driver) while it trains; released on ``release`` or at exit."""

    def __init__(self, path: Path, holder: dict):
        self.path = path
        self.holder = holder
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._heartbeat, name="spo-run-lock", daemon=True)
        self._thread.start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except FileNotFoundError:  # removed by hand: nothing left to refresh
                return

    def release(self) -> None:
        self._stop.set()
        current = read_holder(self.path)
        if current is not None and current.get("pid") == self.holder["pid"] and current.get("host") == self.holder["host"]:
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def acquire(folder: str | Path, command: str = "") -> tuple[RunLock, str | None]:
    """Take the folder's lock for this process: (the lock, a note where a stale one was taken over).
    Raises ``ValueError`` with the refusal where a running launch holds it."""
    path = lock_path(folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    holder = {"pid": os.getpid(), "host": socket.gethostname(),
              "started": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
              "command": command}
    note = None
    for _ in range(2):
        try:
            descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            refusal, found = lock_problem(folder)
            if refusal is not None:
                raise ValueError(refusal) from None
            note = found
            path.unlink(missing_ok=True)  # stale: its holder is gone
            continue
        with os.fdopen(descriptor, "w") as file:
            yaml.safe_dump(holder, file, sort_keys=False)
        return RunLock(path, holder), note
    # Another launch took the stale lock over between our two tries: it holds the folder now.
    refusal, _ = lock_problem(folder)
    raise ValueError(refusal or f"{path}: another launch took this folder's lock at the same time")
