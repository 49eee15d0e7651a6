"""What a broker process is told: :class:`BrokerConfig`, built once from the command line.

The command line itself lives above (``rankboard/cli.py``); this layer only knows the values.
A config can give back its own ``rankboard broker ...`` arguments (:meth:`BrokerConfig.argv`)
because ``rankboard up`` runs its broker as a child process: the flags are written out from
the typed values in this one place instead of by hand at each spawn. Alert webhook URLs are
the exception: they may hold a secret, and a command line is readable by every user of the
host (``/proc/<pid>/cmdline``), so they travel in the child's environment instead
(:meth:`BrokerConfig.child_env`, PROTOCOL 3.1).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from broker.webhooks.notifier import DEFAULT_REPEAT, ENV_VAR
from rank_agent.protocol import DEFAULT_INGEST, DEFAULT_PUBLISH, DEFAULT_SNAPSHOT

__all__ = ["BrokerConfig", "default_data_dir"]


def default_data_dir() -> Path:
    """``$XDG_STATE_HOME/rankboard``, else ``~/.local/state/rankboard``."""
    state = os.environ.get("XDG_STATE_HOME")
    base = Path(state) if state else Path.home() / ".local" / "state"
    return base / "rankboard"


@dataclass(frozen=True)
class BrokerConfig:
    """Every setting of ``rankboard broker`` (defaults are the command line's)."""

    ingest: str = DEFAULT_INGEST
    publish: str = DEFAULT_PUBLISH
    snapshot: str = DEFAULT_SNAPSHOT
    #: None: :func:`default_data_dir` (resolved when the server is built, not at parse time)
    data_dir: Path | None = None
    stale_after: float = 30.0
    step_close_after: float = 10.0
    max_runs: int = 1000
    retention_days: float | None = None
    curve_secret_key: Path | None = None
    curve_authorized: Path | None = None
    #: the webs' public keys (a directory or one key file): whose requests for dumps reach
    #: ranks under CURVE (``up``/``demo``: defaults to their own web's key file)
    curve_web_authorized: Path | None = None
    log_level: str = "INFO"
    #: ``--alert-webhook`` URLs (already checked by :func:`broker.webhooks.notifier.webhook_urls`);
    #: left out of ``repr``: a URL may hold a secret.
    alert_webhooks: tuple[str, ...] = field(default=(), repr=False)
    alert_repeat: float = DEFAULT_REPEAT
    public_url: str | None = None
    #: ``--shard K/N`` (PROTOCOL 7.3): this broker owns the runs whose id hashes to K of N
    shard: tuple[int, int] = (0, 1)
    #: ``--retain-bytes`` (PROTOCOL 8.4): the runs' bytes on disk at most (None: no bound)
    retain_bytes: int | None = None
    #: ``--control-secret-file`` (rank_agent/controlauth.py): None = ``<data dir>/control.secret``
    control_secret_file: Path | None = None

    def argv(self) -> list[str]:
        """``broker --ingest ...``: the arguments that make a child process this broker."""
        cmd = ["broker", "--ingest", self.ingest, "--publish", self.publish,
               "--snapshot", self.snapshot, "--stale-after", repr(float(self.stale_after)),
               "--step-close-after", repr(float(self.step_close_after)),
               "--max-runs", str(self.max_runs)]
        if self.data_dir is not None:
            cmd += ["--data-dir", str(self.data_dir)]
        if self.retention_days is not None:
            cmd += ["--retention-days", repr(float(self.retention_days))]
        if self.curve_secret_key is not None:
            cmd += ["--curve-secret-key", str(self.curve_secret_key)]
        if self.curve_authorized is not None:
            cmd += ["--curve-authorized", str(self.curve_authorized)]
        if self.curve_web_authorized is not None:
            cmd += ["--curve-web-authorized", str(self.curve_web_authorized)]
        if self.alert_repeat != DEFAULT_REPEAT:
            cmd += ["--alert-repeat", repr(float(self.alert_repeat))]
        if self.public_url is not None:
            cmd += ["--public-url", self.public_url]
        if self.shard != (0, 1):
            cmd += ["--shard", f"{self.shard[0]}/{self.shard[1]}"]
        if self.retain_bytes is not None:
            cmd += ["--retain-bytes", str(self.retain_bytes)]
        if self.control_secret_file is not None:
            cmd += ["--control-secret-file", str(self.control_secret_file)]
        # never the webhook URLs: see child_env()
        return cmd + ["--log-level", self.log_level]

    def child_env(self) -> dict[str, str]:
        """What the child's environment must hold besides :meth:`argv`: the webhook URLs
        (``RANKBOARD_ALERT_WEBHOOK``, set even when empty so the child takes exactly these,
        not a copy of ours that they already include)."""
        return {ENV_VAR: " ".join(self.alert_webhooks)}

    def build_server(self) -> Any:
        """The :class:`broker.server.BrokerServer` this config describes (not yet bound)."""
        from broker.server import BrokerServer

        return BrokerServer(
            self.ingest, self.publish, self.snapshot,
            stale_after=self.stale_after,
            step_close_after=self.step_close_after,
            data_dir=self.data_dir if self.data_dir is not None else default_data_dir(),
            curve_secret_key=self.curve_secret_key,
            curve_authorized=self.curve_authorized,
            curve_web_authorized=self.curve_web_authorized,
            max_runs=self.max_runs,
            retention_days=self.retention_days,
            alert_webhooks=self.alert_webhooks,
            alert_repeat=self.alert_repeat,
            public_url=self.public_url,
            shard=self.shard,
            retain_bytes=self.retain_bytes,
            control_secret_file=self.control_secret_file,
        )
