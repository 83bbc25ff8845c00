"""Progress reporting: the driver patches its RLTrainingJob's status through the pod's own
ServiceAccount (whose Role allows only ``patch`` on this job's status); outside Kubernetes it logs.

A failed report never stops training: it is logged and the next one tries again.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import ssl
import threading
import time
import urllib.error
import urllib.request
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from kuberl.api.types import GROUP, MAX_REPLICAS, PLURAL, RECOVERY_KINDS, VERSION
from kuberl.api.contract import JOB_NAME_ENV, NAMESPACE_ENV

log = logging.getLogger("kuberl.train")
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


# Environment variables a credentials Secret of the spec fills (envFrom): the keys the API docs name
# (WANDB_API_KEY, MLFLOW_TRACKING_TOKEN / _PASSWORD, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
# AWS_SESSION_TOKEN, HF_TOKEN) and any other name with such a word. A process cannot tell which of
# its variables came from a Secret, so the name decides; whole words only (TOKENIZERS_PARALLELISM=false
# is no credential, and redacting it would blank out every "false").
_SECRET_NAME = re.compile(r"(^|_)(KEY|APIKEY|TOKEN|SECRET|PASS|PASSWORD|PASSWD|PASSPHRASE|CREDENTIALS?|AUTH|PRIVATE)"
                          r"(_|$)", re.IGNORECASE)
# Shorter values ("1", "yes") would blank out ordinary words; no credential is that short.
_MIN_SECRET_CHARS = 4
# user:password@ in a URL (MLFLOW_TRACKING_URI=https://user:pass@host, an S3 endpoint...).
_URL_USERINFO = re.compile(r"(\b[a-z][a-z0-9+.-]*://)[^/\s@]+@", re.IGNORECASE)
REDACTED = "[redacted]"


def redact_secrets(text: str, env: Mapping[str, str] | None = None) -> str:
    """``text`` with the value of every credential variable of ``env`` (default: this process's
    environment, where the pod's Secrets are) and the user info of every URL replaced."""
    env = os.environ if env is None else env
    values = {value for name, value in env.items() if _SECRET_NAME.search(name) and len(value) >= _MIN_SECRET_CHARS}
    for value in sorted(values, key=len, reverse=True):  # a value inside a longer one goes after it
        text = text.replace(value, REDACTED)
    return _URL_USERINFO.sub(rf"\1{REDACTED}@", text)


def gpu_busy(metrics: Mapping[str, float]) -> dict[str, float]:
    """By role, the share of a step's wall time its GPUs were busy, from the step's phase timings
    (``Driver._phase``): the trainer's in logprobs and update, the engines' in generate. With
    asyncRollout the generate that fed the step ran beside it, so a share is capped at 1."""
    step = metrics.get("step_seconds") or 0.0
    if step <= 0:
        return {}
    busy = {"trainer": metrics.get("logprobs_seconds", 0.0) + metrics.get("update_seconds", 0.0),
            "rollout": metrics.get("generate_seconds", 0.0)}
    return {role: round(min(1.0, seconds / step), 4) for role, seconds in busy.items()}


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# status.progress.activity shows what the driver does once it has done it this long: a job of
# short steps (about 1 s each on the test cluster) then patches nothing more than its steps, and
# a slow phase (a long generation, a trainer recovery) still shows within seconds.
ACTIVITY_SHOWN_AFTER_S = 2.0

# (the activity, when it began: time.monotonic, and as status shows it), or None between activities.
Current = tuple[str, float, str] | None


def activity_shown(current: Current, shown: Current, now: float, after_s: float) -> tuple[Current, float | None]:
    """What status.progress.activity should show at ``now``, and in how many seconds that can next
    change without a new activity: ``current`` once it has lasted ``after_s``, else nothing (a
    shown activity that ended is cleared at once, so status never names one the driver left)."""
    if current is None or current == shown:
        return current, None
    wait = current[1] + after_s - now
    return (current, None) if wait <= 0 else (None, wait)


class ActivityBoard:
    """status.progress.activity and activitySince, kept by a thread of its own: ``set`` costs the
    driver nothing, and the thread patches status only when what it should show changes
    (``activity_shown``): at most two patches per activity of ``after_s`` or more (shown, then
    cleared or replaced), none for shorter ones."""

    def __init__(self, send: Callable[[dict[str, Any]], None], after_s: float = ACTIVITY_SHOWN_AFTER_S):
        self._send = send
        self._after_s = after_s
        self._changed = threading.Condition()
        self._current: Current = None
        self._shown: Current = None
        self._closed = False
        self._thread: threading.Thread | None = None

    def set(self, activity: str | None) -> None:
        with self._changed:
            self._current = None if activity is None else (activity, time.monotonic(), _now())
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="activity", daemon=True)
                self._thread.start()
            self._changed.notify()

    def close(self) -> None:
        """Clear what status shows (the run is over) and stop the thread."""
        with self._changed:
            self._current, self._closed = None, True
            self._changed.notify()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=15)

    def _run(self) -> None:
        while True:
            with self._changed:
                shown, wait = activity_shown(self._current, self._shown, time.monotonic(), self._after_s)
                if shown == self._shown:
                    if self._closed:
                        return
                    self._changed.wait(wait)
                    continue
                self._shown = shown
            name, since = (None, None) if shown is None else (shown[0], shown[2])
            self._send({"progress": {"activity": name, "activitySince": since}})


class StatusReporter:
    """Logs progress; subclasses also send it somewhere."""

    def __init__(self) -> None:
        self._recoveries: dict[str, int] = {}  # kind -> count, where nothing else keeps it

    def progress(self, step: int, total_steps: int, reward: float | None,
                 tokens_per_second: float | None, busy: Mapping[str, float] | None = None) -> None:
        log.info("step %d/%d reward %s tokens/s %s", step, total_steps,
                 "n/a" if reward is None else f"{reward:.4f}",
                 "n/a" if tokens_per_second is None else f"{tokens_per_second:.1f}")
        progress = {"step": step, "totalSteps": total_steps, "reward": reward,
                    "tokensPerSecond": tokens_per_second, "updatedTime": _now(), "heldForSuspend": False}
        if busy:
            progress["gpuBusy"] = dict(busy)
        self._patch({"progress": progress})

    def activity(self, name: str | None) -> None:
        """The driver now does ``name`` (``kuberl.api.types.Activity``), or nothing in particular:
        shown in status.progress.activity once it has lasted a while (``ActivityBoard``)."""

    def close(self) -> None:
        """The run is over: nothing more to report."""

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

    def resumed(self, uri: str, step: int) -> None:
        log.info("resumed from %s (step %d)", uri, step)

    def failed(self, attempt: int, reason: str, message: str) -> None:
        """The job's own input is at fault (status.workloadError): the operator fails the job
        instead of restarting it. Everyone who may read the job reads this, so the pod's Secret
        values are redacted (before truncating: a cut value would no longer match)."""
        message = redact_secrets(message)
        log.error("%s: %s", reason, message)
        self._patch({"workloadError": {"attempt": attempt, "reason": reason, "message": message[:4096],
                                       "time": _now()}})

    def suspend_requested(self) -> bool:
        """Whether the job's spec.suspend is true: never, outside Kubernetes."""
        return False

    def rollout_replicas(self) -> int | None:
        """The job's spec.rollout.replicas as it is now (a live resize): None outside Kubernetes,
        where nothing can change it."""
        return None

    def rollout(self, attempt: int, replicas: int, engine_pods: list[str]) -> None:
        """The driver runs spec.rollout.replicas ``replicas`` now, its live engines in
        ``engine_pods`` (a scale-down has KubeRay delete other rollout pods only)."""
        log.info("rollout pool at %d replicas; engines live in %s", replicas, ", ".join(engine_pods) or "no pod")
        self._patch({"rollout": {"attempt": attempt, "replicas": replicas, "enginePods": engine_pods}})

    def recovered(self, kind: str, seconds: float | None, times: int = 1) -> None:
        """``times`` more recoveries of ``kind`` (``kuberl.api.types.Recoveries``' fields), the
        last taking ``seconds``: counted in status.recoveries, where the operator posts an Event."""
        count = self._recoveries[kind] = self._recovery_count(kind) + times
        log.info("recovery %s #%d%s", kind, count, "" if seconds is None else f" in {seconds:.1f} s")
        self._patch({"recoveries": {RECOVERY_KINDS[kind]: {
            "count": count, "lastSeconds": None if seconds is None else round(seconds, 3), "lastTime": _now()}}})

    def _recovery_count(self, kind: str) -> int:
        """How many of ``kind`` so far."""
        return self._recoveries.get(kind, 0)

    def _patch(self, status: dict[str, Any]) -> None:
        """Nothing to send outside Kubernetes."""


class KubernetesStatusReporter(StatusReporter):
    def __init__(self, api_server: str, namespace: str, name: str, token_file: Path, ca_file: Path):
        super().__init__()
        self.job_url = f"{api_server}/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}/{name}"
        self.url = f"{self.job_url}/status"
        self.token_file = token_file
        self.context = ssl.create_default_context(cafile=str(ca_file))
        self._activity = ActivityBoard(self._patch)

    def activity(self, name: str | None) -> None:
        self._activity.set(name)

    def close(self) -> None:
        self._activity.close()

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

    def rollout_replicas(self) -> int | None:
        """spec.rollout.replicas as the API server has it now; None (no change) when it cannot be read."""
        try:
            value = ((json.loads(self._request(self.job_url)).get("spec") or {}).get("rollout") or {}).get("replicas", 1)
        except (urllib.error.URLError, OSError, ValueError) as exc:
            log.warning("could not read spec.rollout.replicas from %s: %s", self.job_url, exc)
            return None
        if type(value) is not int or not 1 <= value <= MAX_REPLICAS:  # the API server bounds it
            log.warning("spec.rollout.replicas %r is not a count from 1 to %d; keeping the pool as it is",
                        value, MAX_REPLICAS)
            return None
        return value

    def _recovery_count(self, kind: str) -> int:
        """The count in status (an earlier attempt's driver counted there too), else this one's."""
        try:
            status = json.loads(self._request(self.job_url)).get("status") or {}
            count = ((status.get("recoveries") or {}).get(RECOVERY_KINDS[kind]) or {}).get("count", 0)
            return max(int(count), super()._recovery_count(kind))
        except (urllib.error.URLError, OSError, ValueError, TypeError) as exc:
            log.warning("could not read status.recoveries from %s: %s", self.job_url, exc)
            return super()._recovery_count(kind)

    def _patch(self, status: dict[str, Any]) -> None:
        try:
            self._send(status)
        except (urllib.error.URLError, OSError) as exc:
            detail = exc.read().decode(errors="replace")[:300] if isinstance(exc, urllib.error.HTTPError) else ""
            log.warning("could not report status to %s: %s %s", self.url, exc, detail)


def reporter_from_env(env: dict[str, str] | None = None, service_account: Path = SERVICE_ACCOUNT) -> StatusReporter:
    """The Kubernetes reporter inside a kuberl pod (KUBERL_JOB_NAME set, token mounted), else logs."""
    env = dict(os.environ if env is None else env)
    name, host = env.get(JOB_NAME_ENV), env.get("KUBERNETES_SERVICE_HOST")
    token = service_account / "token"
    if not (name and host and token.exists()):
        return StatusReporter()
    port = env.get("KUBERNETES_SERVICE_PORT", "443")
    host = f"[{host}]" if ":" in host else host
    namespace = env.get(NAMESPACE_ENV) or (service_account / "namespace").read_text().strip()
    return KubernetesStatusReporter(f"https://{host}:{port}", namespace, name, token, service_account / "ca.crt")


@contextlib.contextmanager
def user_errors_reported(reporter: StatusReporter, attempt: int) -> Iterator[None]:
    """Errors in the job's own input found only while training (a reward function that raises,
    hangs or returns no number, an agent's environment or harness that fails or hangs, data that
    does not parse) go to status.workloadError before they end the run: the operator then fails
    the job naming them, where a restart would only repeat them (a resumed run replays the same
    episodes and rewards)."""
    from kuberl.common.reward_values import RewardError
    from kuberl.driver.data import DataError
    from kuberl.rollout.agents.environment import AgentError

    try:
        yield
    except (RewardError, AgentError, DataError) as exc:
        # The driver's last error line also reaches status (KubeRay copies the log's tail into
        # the RayJob, the operator quotes it): the exception goes on redacted as well.
        exc.args = (redact_secrets(str(exc)),)
        reason = ("RewardFunctionFailed" if isinstance(exc, RewardError)
                  else "AgentFailed" if isinstance(exc, AgentError) else "DataInvalid")
        reporter.failed(attempt, reason, str(exc))
        raise
