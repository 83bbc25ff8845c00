{{- define "kuberl.operatorName" -}}
{{- printf "%s-kuberl-operator" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kuberl.serviceAccountName" -}}
{{- default (include "kuberl.operatorName" .) .Values.serviceAccount.name -}}
{{- end -}}

{{- define "kuberl.labels" -}}
app.kubernetes.io/name: kuberl
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "kuberl.selectorLabels" -}}
app.kubernetes.io/name: kuberl
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* The namespaces the operator reconciles (unless watchAllNamespaces): the list, else the release's. */}}
{{- define "kuberl.watchNamespaces" -}}
{{- if and .Values.watchAllNamespaces .Values.watchNamespaces -}}
{{- fail "watchAllNamespaces: true watches every namespace; leave watchNamespaces empty (or set watchAllNamespaces: false to watch only the listed ones)" -}}
{{- end -}}
{{- toYaml (.Values.watchNamespaces | default (list .Release.Namespace)) -}}
{{- end -}}

{{/* What the operator does in a namespace it watches; nothing more. */}}
{{- define "kuberl.operatorRules" -}}
# The jobs: read, write the operator's status fields, delete after ttlSecondsAfterFinished.
- apiGroups: [kuberl.dev]
  resources: [rltrainingjobs]
  verbs: [get, list, watch, delete]
- apiGroups: [kuberl.dev]
  resources: [rltrainingjobs/status]
  verbs: [get, patch]
# One RayJob per attempt; suspend/resume patches it; restarts delete the failed one.
- apiGroups: [ray.io]
  resources: [rayjobs]
  verbs: [get, list, watch, create, patch, delete]
# A live resize of spec.rollout.replicas patches the rollout group's size (and workersToDelete).
- apiGroups: [ray.io]
  resources: [rayclusters]
  verbs: [get, list, watch, patch]
# Kueue (spec.scheduling.queueName): its Workload says whether the job is admitted or what it
# waits for; a suspend/resume sets the Workload's spec.active. Harmless where Kueue is absent.
- apiGroups: [kueue.x-k8s.io]
  resources: [workloads]
  verbs: [get, list, watch, patch]
# Pods are read for init-container (staging) failures and readiness.
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch]
# The job's ConfigMap, and its per-job identity (server-side apply: create + patch).
- apiGroups: [""]
  resources: [configmaps]
  verbs: [get, list, watch, create, patch]
- apiGroups: [""]
  resources: [serviceaccounts]
  verbs: [get, create, patch]
- apiGroups: [rbac.authorization.k8s.io]
  resources: [roles, rolebindings]
  verbs: [get, create, patch]
# One NetworkPolicy per job guarding its Ray pods.
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, create, patch]
- apiGroups: ["", events.k8s.io]
  resources: [events]
  verbs: [create, patch]
{{- end -}}
