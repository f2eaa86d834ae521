{{/* Names ------------------------------------------------------------------ */}}

{{- define "batchpilot.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "batchpilot.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The operator's objects: <fullname>-operator (room left for the suffix). */}}
{{- define "batchpilot.operator.fullname" -}}
{{- printf "%s-operator" (include "batchpilot.fullname" . | trunc 54 | trimSuffix "-") -}}
{{- end -}}

{{/* A model runtime's objects: <fullname>-<model name>. Call with (list $ $model). */}}
{{- define "batchpilot.runtime.fullname" -}}
{{- $root := index . 0 -}}
{{- $model := index . 1 -}}
{{- printf "%s-%s" (include "batchpilot.fullname" $root | trunc 30 | trimSuffix "-") $model.name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "batchpilot.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "batchpilot.operator.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "batchpilot.adminTokenSecretName" -}}
{{- if .Values.adminToken.existingSecret -}}
{{- .Values.adminToken.existingSecret -}}
{{- else -}}
{{- printf "%s-admin-token" (include "batchpilot.fullname" . | trunc 50 | trimSuffix "-") -}}
{{- end -}}
{{- end -}}

{{/* Labels ----------------------------------------------------------------- */}}

{{/* Labels of every object, for use beside selector labels (which carry name and instance). */}}
{{- define "batchpilot.metaLabels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: batchpilot
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "batchpilot.labels" -}}
{{ include "batchpilot.metaLabels" . }}
app.kubernetes.io/name: {{ include "batchpilot.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "batchpilot.operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "batchpilot.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* Every runtime pod of the release, whatever its model (NetworkPolicy, PodMonitor). */}}
{{- define "batchpilot.runtime.commonSelectorLabels" -}}
app.kubernetes.io/name: {{ include "batchpilot.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: runtime
{{- end -}}

{{/* The runtime pods of one model. Call with (list $ $model). */}}
{{- define "batchpilot.runtime.selectorLabels" -}}
{{- $root := index . 0 -}}
{{- $model := index . 1 -}}
{{ include "batchpilot.runtime.commonSelectorLabels" $root }}
batchpilot.dev/model: {{ $model.name }}
{{- end -}}

{{/* Images ----------------------------------------------------------------- */}}

{{- define "batchpilot.operator.image" -}}
{{- $image := .Values.operator.image -}}
{{- if $image.digest -}}
{{- printf "%s@%s" $image.repository $image.digest -}}
{{- else -}}
{{- printf "%s:%s" $image.repository (default .Chart.AppVersion $image.tag) -}}
{{- end -}}
{{- end -}}

{{/* Call with (list $ $model): the CUDA tag for models that request GPUs. */}}
{{- define "batchpilot.runtime.image" -}}
{{- $root := index . 0 -}}
{{- $model := index . 1 -}}
{{- $image := mergeOverwrite (deepCopy $root.Values.runtime.image) (default dict $model.image) -}}
{{- $tag := default $root.Chart.AppVersion $image.tag -}}
{{- if gt (int (default 0 $model.gpus)) 0 -}}
{{- $tag = printf "%s%s" $tag $image.cudaTagSuffix -}}
{{- end -}}
{{- printf "%s:%s" $image.repository $tag -}}
{{- end -}}

{{/* Operator mode ---------------------------------------------------------- */}}

{{- define "batchpilot.clusterwide" -}}
{{- if .Values.operator.watchNamespaces -}}false{{- else -}}true{{- end -}}
{{- end -}}

{{/* Checks that the schema cannot express. */}}
{{- define "batchpilot.validate" -}}
{{- if and (gt (int .Values.operator.replicas) 1) (not .Values.operator.peering.enabled) -}}
{{- fail "operator.replicas > 1 needs operator.peering.enabled=true: without kopf peering, replicas would act at the same time" -}}
{{- end -}}
{{- $seen := dict -}}
{{- range $index, $model := .Values.models -}}
{{- if hasKey $seen $model.name -}}
{{- fail (printf "models[%d].name: %q is used twice" $index $model.name) -}}
{{- end -}}
{{- $_ := set $seen $model.name true -}}
{{- if and $model.preset $model.checkpoint -}}
{{- fail (printf "models[%d]: give preset or checkpoint, not both" $index) -}}
{{- end -}}
{{- end -}}
{{- if and (not .Values.adminToken.create) (not .Values.adminToken.existingSecret) -}}
{{- fail "adminToken: set create=true or name an existingSecret; the operator and the runtimes need the token" -}}
{{- end -}}
{{- end -}}

{{/* RBAC rules on namespaced resources; call with (dict "peering" bool). */}}
{{- define "batchpilot.rbac.namespacedRules" -}}
# kopf watches BatchProfiles and patches its progress annotations and finalizers on them.
- apiGroups: ["batchpilot.dev"]
  resources: ["batchprofiles"]
  verbs: ["get", "list", "watch", "patch"]
# Status (window in force, observations, conditions) goes through the status subresource.
- apiGroups: ["batchpilot.dev"]
  resources: ["batchprofiles/status"]
  verbs: ["get", "patch", "update"]
# The index of runtime pods by labels: their IPs and readiness.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch"]
# An Event for every decision and push failure.
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
# A profile's spec.runtime.adminTokenSecret: the bearer token of its pods' admin API.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get"]
# tuning.mode restart: the workload of spec.restart is read and its engine container's args applied.
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "patch"]
- apiGroups: ["apps"]
  resources: ["statefulsets"]
  verbs: ["get", "patch"]
{{- if .peering }}
# kopf peering of namespaced operators, one KopfPeering per watched namespace.
- apiGroups: ["kopf.dev"]
  resources: ["kopfpeerings"]
  verbs: ["get", "list", "watch", "patch"]
{{- end }}
{{- end -}}
