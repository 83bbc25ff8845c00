"""Progress reporting: the driver patches its RLTrainingJob's status through the pod's own
ServiceAccount (whose Role allows only ``patch`` on this job's status); outside Kubernetes it logs.

A failed report never stops training: it is logged and the next one tries again.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import ssl
import urllib.error
import urllib.request
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

from kuberl.api.types import GROUP, PLURAL, VERSION

log = logging.getLogger("kuberl.train")
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class StatusReporter:
    """Logs progress; subclasses also send it somewhere."""

    def progress(self, step: int, total_steps: int, reward: float | None,
                 tokens_per_second: float | None) -> None:
        log.info("step %d/%d reward %s tokens/s %s", step, total_steps,
                 "n/a" if reward is None else f"{reward:.4f}",
                 "n/a" if tokens_per_second is None else f"{tokens_per_second:.1f}")
        self._patch({"progress": {"step": step, "totalSteps": total_steps, "reward": reward,
                                  "tokensPerSecond": tokens_per_second, "updatedTime": _now(),
                                  "heldForSuspend": False}})

    def held_for_suspend(self, held: bool) -> None:
        """Whether the driver holds after its last reported step for a suspend: the operator
        deletes the Ray cluster only once it does, so no step is in flight when the cluster goes."""
        self._patch({"progress": {"heldForSuspend": held}})

    def validation(self, step: int, reward: float) -> None:
        log.info("validation at step %d: reward %.4f", step, reward)
        # A merge patch: the rest of progress stays as the last step left it.
        self._patch({"progress": {"validationReward": reward, "validationStep": step}})

    def checkpoint(self, uri: str, step: int) -> None:
        log.info("checkpoint step %d complete: %s", step, uri)
        self._patch({"lastCheckpoint": {"uri": uri, "step": step, "time": _now()}})

    def failed(self, attempt: int, reason: str, message: str) -> None:
        """The job's own input is at fault (status.workloadError): the operator fails the job
        instead of restarting it."""
        log.error("%s: %s", reason, message)
        self._patch({"workloadError": {"attempt": attempt, "reason": reason, "message": message[:4096],
                                       "time": _now()}})

    def suspend_requested(self) -> bool:
        """Whether the job's spec.suspend is true: never, outside Kubernetes."""
        return False

    def _patch(self, status: dict[str, Any]) -> None:
        """Nothing to send outside Kubernetes."""


class KubernetesStatusReporter(StatusReporter):
    def __init__(self, api_server: str, namespace: str, name: str, token_file: Path, ca_file: Path):
        self.job_url = f"{api_server}/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}/{name}"
        self.url = f"{self.job_url}/status"
        self.token_file = token_file
        self.context = ssl.create_default_context(cafile=str(ca_file))

    def _request(self, url: str, method: str = "GET", body: bytes | None = None) -> bytes:
        # The token is re-read each time: projected tokens rotate.
        token = self.token_file.read_text().strip()
        headers = {"Authorization": f"Bearer {token}"}
        if body is not None:
            headers["Content-Type"] = "application/merge-patch+json"
        request = urllib.request.Request(url, data=body, method=method, headers=headers)
        with urllib.request.urlopen(request, context=self.context, timeout=10) as response:
            return response.read()

    def _send(self, status: dict[str, Any]) -> None:
        """One merge patch of the status subresource; raises on failure."""
        self._request(self.url, "PATCH", json.dumps({"status": {k: v for k, v in status.items() if v is not None}}).encode())

    def suspend_requested(self) -> bool:
        """The job's spec.suspend (its Role lets it get this one job). An unreachable API server
        reads as "not suspended": training goes on, as it would without this check."""
        try:
            return bool((json.loads(self._request(self.job_url)).get("spec") or {}).get("suspend"))
        except (urllib.error.URLError, OSError, ValueError) as exc:
            log.warning("could not read spec.suspend from %s: %s", self.job_url, exc)
            return False

    def _patch(self, status: dict[str, Any]) -> None:
        try:
            self._send(status)
        except (urllib.error.URLError, OSError) as exc:
            detail = exc.read().decode(errors="replace")[:300] if isinstance(exc, urllib.error.HTTPError) else ""
            log.warning("could not report status to %s: %s %s", self.url, exc, detail)


def reporter_from_env(env: dict[str, str] | None = None, service_account: Path = SERVICE_ACCOUNT) -> StatusReporter:
    """The Kubernetes reporter inside a kuberl pod (KUBERL_JOB_NAME set, token mounted), else logs."""
    env = dict(os.environ if env is None else env)
    name, host = env.get("KUBERL_JOB_NAME"), env.get("KUBERNETES_SERVICE_HOST")
    token = service_account / "token"
    if not (name and host and token.exists()):
        return StatusReporter()
    port = env.get("KUBERNETES_SERVICE_PORT", "443")
    host = f"[{host}]" if ":" in host else host
    namespace = env.get("KUBERL_NAMESPACE") or (service_account / "namespace").read_text().strip()
    return KubernetesStatusReporter(f"https://{host}:{port}", namespace, name, token, service_account / "ca.crt")


@contextlib.contextmanager
def user_errors_reported(reporter: StatusReporter, attempt: int) -> Iterator[None]:
    """Errors in the job's own input found only while training (a reward function that raises,
    hangs or returns no number, an agent's environment or harness that fails or hangs, data that
    does not parse) go to status.workloadError before they end the run: the operator then fails
    the job naming them, where a restart would only repeat them (a resumed run replays the same
    episodes and rewards)."""
    from kuberl.agents.environment import AgentError
    from kuberl.train.data import DataError
    from kuberl.train.rewards import RewardError

    try:
        yield
    except RewardError as exc:
        reporter.failed(attempt, "RewardFunctionFailed", str(exc))
        raise
    except AgentError as exc:
        reporter.failed(attempt, "AgentFailed", str(exc))
        raise
    except DataError as exc:
        reporter.failed(attempt, "DataInvalid", str(exc))
        raise
