{{/* Names, labels and the watched namespaces, shared by every template. */}}

{{- define "splitserve.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "splitserve.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name | quote }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "splitserve.labels" -}}
{{ include "splitserve.selectorLabels" . }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: splitserve
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "splitserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "splitserve.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- /* Falling back to "default" would bind the operator's Roles to every pod's account. */ -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false: name an existing ServiceAccount for the operator (the chart would otherwise bind its Roles to the namespace's default ServiceAccount)" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The namespaces a namespaced operator watches: watch.namespaces, or the release's. */}}
{{- define "splitserve.namespaces" -}}
{{- if .Values.watch.namespaces -}}
{{- .Values.watch.namespaces | toJson -}}
{{- else -}}
{{- list .Release.Namespace | toJson -}}
{{- end -}}
{{- end -}}

{{/* RBAC rules for LLMServices and their children, in every watched namespace. */}}
{{- define "splitserve.namespacedRules" -}}
- apiGroups: [splitserve.io]
  resources: [llmservices]
  verbs: [get, list, watch, patch]
- apiGroups: [splitserve.io]
  resources: [llmservices/status]
  verbs: [patch]
# Owner references with blockOwnerDeletion need it (OwnerReferencesPermissionEnforcement).
- apiGroups: [splitserve.io]
  resources: [llmservices/finalizers]
  verbs: [update]
# Each config version is its own immutable ConfigMap. list, delete: a superseded one, once no
# pod, Deployment or live ReplicaSet mounts it (only the ones an LLMService owns).
- apiGroups: [""]
  resources: [configmaps]
  verbs: [get, list, create, patch, delete]
- apiGroups: [""]
  resources: [services]
  verbs: [get, list, watch, create, patch]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch]
# list: which config versions a rollout's ReplicaSets still need.
- apiGroups: [apps]
  resources: [replicasets]
  verbs: [list]
# list: why a pool's pods are not running (unschedulable, image pull), for its status.
# patch: the built-in autoscaler's pod-deletion-cost before a scale-down (idlest pods go first).
- apiGroups: [""]
  resources: [pods]
  verbs: [list, patch]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, create, patch]
{{- if .Values.networkPolicies.enabled }}
# One per LLMService: only its router (and its prefill pool) reach the workers' gRPC ports.
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, create, patch]
{{- end }}
# delete: when an LLMService sets monitoring.enabled (or alerts.enabled) false (only the ones
# it owns). prometheusrules: the alerts on each LLMService's SLO.
- apiGroups: [monitoring.coreos.com]
  resources: [servicemonitors, podmonitors, prometheusrules]
  verbs: [get, create, patch, delete]
# autoscaling.mode HPA: the pools' HorizontalPodAutoscalers (delete: when the mode changes).
- apiGroups: [autoscaling]
  resources: [horizontalpodautoscalers]
  verbs: [get, list, watch, create, patch, delete]
# autoscaling.mode KEDA: the pools' ScaledObjects (delete: when the mode changes).
- apiGroups: [keda.sh]
  resources: [scaledobjects]
  verbs: [get, create, patch, delete]
# kopf posts core/v1 Events.
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- end -}}
