"""The names the renderer, the operator and the processes in the pods agree on, in one place.

The renderer writes them into the objects it makes; the operator finds those objects by them; the
driver, the trainer ranks, the stager and the metrics exporter read them inside the pods. Each side
imports them from here, so that none needs the other's module for a name (the operator does not
import the renderer for names: tests/unit/test_contract.py checks both). Plain values and string
functions only, importing nothing of kuberl: the operator, the stager image and every worker import
it.
"""

from __future__ import annotations

# --- labels and annotations -----------------------------------------------------------------

# On every object of a job, its pods included: the operator's kopf indices select by it.
JOB_LABEL = "kuberl.dev/job"
# What an object or pod is to the job: head, trainer, rollout, rayjob, config, workload, network.
ROLE_LABEL = "kuberl.dev/role"
# On the RayJob and the rendered job config: the attempt they belong to.
ATTEMPT_ANNOTATION = "kuberl.dev/attempt"
# Namespaces an administrator labelled to say "the Ray-job infrastructure runs here" (KubeRay's
# operator, kuberl's operator, Prometheus); the NetworkPolicy admits their pods to the Ray ports.
PEER_NAMESPACE_LABEL = "kuberl.dev/ray-head-peers"


def labels(job: str, role: str | None = None) -> dict[str, str]:
    """The labels of every object of job ``job``; ``role`` says which part of it this one is."""
    out = {
        "app.kubernetes.io/name": "kuberl",
        "app.kubernetes.io/instance": job,
        "app.kubernetes.io/managed-by": "kuberl-operator",
        JOB_LABEL: job,
    }
    if role:
        out[ROLE_LABEL] = role
    return out


# --- object names ---------------------------------------------------------------------------


def ray_job_name(job: str, attempt: int = 0) -> str:
    """Each restart gets a new RayJob so that the old one can be deleted without waiting for it."""
    return job if attempt == 0 else f"{job}-r{attempt}"


def config_map_name(job: str) -> str:
    """The ConfigMap holding the resolved job (``CONFIG_FILE``) and its run plan (``PLAN_FILE``)."""
    return f"{job}-config"


WORKLOAD_IDENTITY_SUFFIX = "-workload"


def workload_identity_name(job: str) -> str:
    """The ServiceAccount, Role and RoleBinding the job's pods run as."""
    return f"{job}{WORKLOAD_IDENTITY_SUFFIX}"


def network_policy_name(job: str) -> str:
    return f"{job}-ray"


# --- Ray groups and resources ---------------------------------------------------------------

HEAD_ROLE = "head"
TRAINER_GROUP = "trainer"
ROLLOUT_GROUP = "rollout"
# Custom Ray resources, one unit per process slot, that place trainer ranks and engines.
TRAINER_RESOURCE = "kuberl_trainer"
ROLLOUT_RESOURCE = "kuberl_rollout"

# --- the preemption notice (kuberl.driver.notices, kuberl.cli.notice) ----------------------------

# The driver's notice board: a named Ray actor on the head that a going pod's preStop hook finds
# by this name and namespace, and that the driver reads at every step boundary.
NOTICE_ACTOR = "kuberl-preemption-notices"
RAY_NAMESPACE = "kuberl"
# The preStop hook of the head and trainer pods: `kuberl preemption-notice --wait-seconds N`.
NOTICE_COMMAND = ["kuberl", "preemption-notice"]
# Where the hook also writes what it did: the container's own log (its PID 1's stdout), since the
# kubelet keeps a preStop hook's output only when the hook fails.
NOTICE_LOG = "/proc/1/fd/1"
# Of a pod's grace period, what the hook leaves for Ray's own stop after SIGTERM.
NOTICE_STOP_MARGIN_SECONDS = 5
# Ray's own drain of a node on SIGTERM (read by Ray's `ray start`; Ray 2.60 waits up to 30 s by
# default while the node's actors run on), 0 on the pods with the hook: the hook has held the pod
# until the step in flight was committed, and a drain then only lets the ranks run steps that the
# recovery runs again (28 steps in the 30 s, measured in pods).
RAY_DRAIN_ENV = "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"

# --- config and in-pod paths ----------------------------------------------------------------

# The job's ConfigMap, mounted read-only in every Ray container and init container.
CONFIG_DIR = "/etc/kuberl"
CONFIG_FILE = "job.yaml"
PLAN_FILE = "plan.yaml"
CONFIG_PATH = f"{CONFIG_DIR}/{CONFIG_FILE}"

# The pod-local volume (an emptyDir) the stager copies models and data into.
STAGE_DIR = "/kuberl"
MODEL_DIR = f"{STAGE_DIR}/model"
DATA_DIR = f"{STAGE_DIR}/data"
VALIDATION_DATA_DIR = f"{STAGE_DIR}/validation-data"
# Pod-local scratch: each trainer rank writes its checkpoint shards below ``<scratch>/rank-<r>``
# before uploading them, and nothing else ever reads them.
SCRATCH_DIR = f"{STAGE_DIR}/scratch"
# The job's own code when it is not in the image (spec.reward.source, spec.agent.source): a
# ConfigMap mounted here read-only, or a URI the stager fetched and verified into here; the
# directory goes first on sys.path of the processes that import the code.
CODE_DIR = f"{STAGE_DIR}/code"
REWARD_CODE_DIR = f"{CODE_DIR}/reward"
AGENT_CODE_DIR = f"{CODE_DIR}/agent"
# Where pvc://<claim>/<path> is mounted inside a pod (``PVC_ROOT_ENV`` tells the processes).
PVC_ROOT = "/mnt/pvc"

# --- the environment the renderer gives each container ---------------------------------------

JOB_NAME_ENV = "KUBERL_JOB_NAME"
NAMESPACE_ENV = "KUBERL_NAMESPACE"
ROLE_ENV = "KUBERL_ROLE"
METRICS_PORT_ENV = "KUBERL_METRICS_PORT"
PVC_ROOT_ENV = "KUBERL_PVC_ROOT"

# --- ports ----------------------------------------------------------------------------------

METRICS_PORT = 9400          # kuberl's own exporter (kuberl.common.metrics)
RAY_METRICS_PORT = 8080      # Ray's metrics export port
RAY_DASHBOARD_PORT = 8265    # Ray's dashboard and job-submission API, on the head only

# The user every container runs as: the images' own (images/Dockerfile) and the chart's.
RUN_AS_USER = 1000
