"""A run folder belongs to one run: the lease on --ckpt_save_path.

Before a run writes anything under --ckpt_save_path, rank 0 takes <ckpt_save_path>/owner.json for it
(host, pid, Slurm job, start time and a heartbeat, renewed every HEARTBEAT_SECONDS by a thread) and
deletes it when the run ends (with the folders it created, when a start that failed wrote nothing
else there). A second run into the same folder stops in one line naming the live
owner, before any write. A lease whose owner is gone is taken over with a note: at once when the same
Slurm job starts again (a requeue) or when its pid is gone on this host, otherwise once its heartbeat
is older than STALE_SECONDS (a run on another host that died). A run confirms that the lease is still
its own before each checkpoint, so a run whose lease was taken never overwrites the new owner's.

Locally the lease is created exclusively (a hard link of a complete temporary file: whole, and only
once); object storage has no exclusive create, so there the marker is read before it is written and
read back after, and the heartbeat's check catches the rare race of two starts at the same moment.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from fms_fsdp.atomic import fsync_path
from fms_fsdp.errors import ConfigError, TrainingError, first_line
from fms_fsdp.storage import is_remote, make_folder

OWNER_FILE = "owner.json"
HEARTBEAT_SECONDS = 30.0
STALE_SECONDS = 600.0  # no heartbeat for this long: the owner (on another host) is gone


@dataclass(frozen=True)
class Owner:
    """Who holds a run folder."""

    host: str
    pid: int
    job: str  # SLURM_JOB_ID ("" outside Slurm): a requeued job keeps it
    started: float
    heartbeat: float
    token: str  # this run's, unique

    @staticmethod
    def me() -> "Owner":
        now = time.time()
        return Owner(socket.gethostname(), os.getpid(), os.environ.get("SLURM_JOB_ID", ""), now, now, uuid.uuid4().hex)

    def describe(self) -> str:
        job = f", Slurm job {self.job}" if self.job else ""
        started = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(self.started))
        return (
            f"pid {self.pid} on {self.host}{job}, started {started}, heartbeat {time.time() - self.heartbeat:.0f} s ago"
        )

    def gone(self, me: "Owner") -> Optional[str]:
        """Why this owner no longer holds the folder (for a note), or None while it may be alive."""
        if self.job and self.job == me.job:
            return f"Slurm job {self.job} started again (a requeue)"
        if self.host == me.host and not _running(self.pid):
            return f"pid {self.pid} on {self.host} is gone"
        if time.time() - self.heartbeat > STALE_SECONDS:
            return f"no heartbeat for {time.time() - self.heartbeat:.0f} s"
        return None


def _running(pid: int) -> bool:
    """Whether process `pid` of this host is alive: a zombie (killed, not reaped yet: in a container
    whose first process reaps nothing, never) is not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):  # no /proc (not Linux), or it just ended
        return True
    return state not in ("Z", "X")


def _missing(folder: Path) -> list[Path]:
    """`folder` and those of its parents that do not exist yet, innermost first."""
    missing = []
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    return missing


class RunLease:
    """The lease of one run on its folder `root` (rank 0 holds it)."""

    def __init__(self, root: Path):
        self.root, self.path = root, root / OWNER_FILE
        self.me = Owner.me()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._made: list[Path] = []  # the folders acquire created, innermost first

    def acquire(self) -> Optional[str]:
        """Take the folder for this run; returns a note when a dead run's lease was taken over. ConfigError
        naming the live owner when another run holds it, or naming the folder when it cannot be written."""
        try:
            if not is_remote(self.root) and self.root.exists() and not self.root.is_dir():
                raise ConfigError(f"--ckpt_save_path: {self.root} is a file, not a folder")
            self._made = [] if is_remote(self.root) else _missing(self.root)
            make_folder(self.root)
            note = self._take()
        except ConfigError:
            raise
        except Exception as e:  # a read-only disk; in object storage a missing bucket, no endpoint or access
            raise ConfigError(
                f"--ckpt_save_path: cannot write {self.root} ({type(e).__name__}: {first_line(e)})"
            ) from None
        self._thread = threading.Thread(target=self._beat, name="run-lease", daemon=True)
        self._thread.start()
        return note

    def _take(self) -> Optional[str]:
        if self._create():
            return None
        owner = self.read()
        why = None if owner is None else owner.gone(self.me)
        if owner is not None and why is None:
            raise ConfigError(
                f"--ckpt_save_path: {self.root} belongs to a running run ({owner.describe()}); give this run "
                f"another --ckpt_save_path, or stop that run first"
            )
        self._write(self.me)
        if (self.read() or self.me).token != self.me.token:  # another start took it at the same moment
            raise ConfigError(f"--ckpt_save_path: {self.root} was taken by another run starting at the same time")
        return f"note: took over {self.path} from a run that ended without releasing it ({why or 'unreadable'})"

    def confirm(self) -> None:
        """TrainingError when the folder is no longer this run's (call before writing a checkpoint)."""
        owner = self.read()
        if owner is None or owner.token != self.me.token:
            who = owner.describe() if owner else "no owner record"
            raise TrainingError(
                f"--ckpt_save_path: {self.root} was taken over by another run ({who}) while this one was "
                "out of contact: this run stops without writing there"
            )

    def release(self) -> None:
        """Stop the heartbeat and delete the lease, if it is still this run's, and the folders acquire
        created if nothing else was written there (a start that failed)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            owner = self.read()
            if owner is not None and owner.token == self.me.token:
                self.path.unlink()
        except Exception:  # a folder gone read-only: the next run takes the lease over (pid gone)
            pass
        for folder in self._made:  # a start that failed leaves no folder behind
            try:
                folder.rmdir()
            except OSError:  # the run wrote there
                break

    def read(self) -> Optional[Owner]:
        """The owner record there (None when absent or unreadable)."""
        try:
            return Owner(**json.loads(self.path.read_text()))
        except FileNotFoundError:
            return None
        except (ValueError, TypeError):  # a half-written record of another store, or a foreign file
            return None

    def _create(self) -> bool:
        """Write this run's record only if there is none; whether it was written."""
        if is_remote(self.path):
            if self.path.exists():
                return False
            self._write(self.me)
            return True
        tmp = self._temp(self.me)
        try:
            os.link(tmp, self.path)
            fsync_path(self.root)
            return True
        except FileExistsError:
            return False
        finally:
            tmp.unlink()

    def _write(self, owner: Owner) -> None:
        if is_remote(self.path):
            self.path.write_text(json.dumps(asdict(owner)))
            return
        os.replace(self._temp(owner), self.path)

    def _temp(self, owner: Owner) -> Path:
        tmp = self.root / f".{OWNER_FILE}.tmp{os.getpid()}"
        with tmp.open("w") as f:
            json.dump(asdict(owner), f)
            f.flush()
            os.fsync(f.fileno())
        return tmp

    def _beat(self) -> None:
        """Renew the heartbeat while the record is this run's (a failed write is retried at the next beat)."""
        while not self._stop.wait(HEARTBEAT_SECONDS):
            try:
                owner = self.read()
                if owner is None or owner.token != self.me.token:
                    return  # taken over: confirm() stops the run at its next save
                self._write(Owner(**{**asdict(self.me), "heartbeat": time.time()}))
            except Exception:
                pass
