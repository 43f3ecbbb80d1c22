{{/*
Standard helpers: names (63-character DNS labels), labels, images, security contexts and the environment
every Tessera process reads (settings.py: TESSERA_* variables).
*/}}

{{/* The chart name, or nameOverride. */}}
{{- define "tessera.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The resource-name prefix. The release name alone when it already contains the chart name, so
`helm install tessera helm/tessera` gives "tessera-gateway", not "tessera-tessera-gateway".
*/}}
{{- define "tessera.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* A component's resource name: "<fullname>-<component>", kept within 63 characters. */}}
{{- define "tessera.componentName" -}}
{{- $root := index . 0 }}
{{- $component := index . 1 }}
{{- $prefix := include "tessera.fullname" $root | trunc (int (sub 62 (len $component))) | trimSuffix "-" }}
{{- printf "%s-%s" $prefix $component }}
{{- end }}

{{/*
The RayService name. KubeRay appends a 6-character suffix for the RayCluster and "-head-svc" style
suffixes for its Services, so the name is kept to 40 characters.
*/}}
{{- define "tessera.rayServiceName" -}}
{{- printf "%s-engine" (include "tessera.fullname" . | trunc 33 | trimSuffix "-") }}
{{- end }}

{{/* "name-version" for the helm.sh/chart label. */}}
{{- define "tessera.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every object. */}}
{{- define "tessera.labels" -}}
helm.sh/chart: {{ include "tessera.chart" . }}
app.kubernetes.io/name: {{ include "tessera.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- if .Chart.AppVersion }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: tessera
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Labels of one component: the common labels plus app.kubernetes.io/component. Call with (list . "gateway"). */}}
{{- define "tessera.componentLabels" -}}
{{ include "tessera.labels" (index . 0) }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{/* Selector labels of the release's pods (stable across upgrades: no version labels). */}}
{{- define "tessera.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tessera.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Selector labels of one component. Call with (list . "gateway"). */}}
{{- define "tessera.componentSelectorLabels" -}}
{{ include "tessera.selectorLabels" (index . 0) }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{/* An image reference from {repository, tag, digest}; the tag defaults to the chart's appVersion. */}}
{{- define "tessera.image" -}}
{{- $root := index . 0 }}
{{- $image := index . 1 }}
{{- if $image.digest }}
{{- printf "%s@%s" $image.repository $image.digest }}
{{- else }}
{{- printf "%s:%s" $image.repository (default $root.Chart.AppVersion $image.tag) }}
{{- end }}
{{- end }}

{{/* The operator's service account name. */}}
{{- define "tessera.operatorServiceAccountName" -}}
{{- if .Values.operator.serviceAccount.create }}
{{- default (include "tessera.componentName" (list . "operator")) .Values.operator.serviceAccount.name }}
{{- else }}
{{- required "operator.serviceAccount.name is required when operator.serviceAccount.create is false" .Values.operator.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
Pod security context meeting the "restricted" Pod Security Standard: non-root, RuntimeDefault seccomp.
*/}}
{{- define "tessera.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .Values.podSecurityContext.runAsUser }}
runAsGroup: {{ .Values.podSecurityContext.runAsGroup }}
fsGroup: {{ .Values.podSecurityContext.fsGroup }}
fsGroupChangePolicy: OnRootMismatch
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/*
Container security context for the restricted standard. Call with (list . true) for a read-only root
filesystem, (list . false) where the process must write below / (Ray, vLLM and its compilers).
*/}}
{{- define "tessera.containerSecurityContext" -}}
allowPrivilegeEscalation: false
privileged: false
readOnlyRootFilesystem: {{ index . 1 }}
runAsNonRoot: true
capabilities:
  drop:
    - ALL
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/* Name of the Secret holding the Redis password, or "" when the server needs none. */}}
{{- define "tessera.redis.secretName" -}}
{{- if eq .Values.redis.mode "bundled" }}
{{- default (include "tessera.componentName" (list . "redis")) .Values.redis.bundled.auth.existingSecret }}
{{- else }}
{{- .Values.redis.external.existingSecret }}
{{- end }}
{{- end }}

{{/* Key of the Redis password inside its Secret. */}}
{{- define "tessera.redis.passwordKey" -}}
{{- if eq .Values.redis.mode "bundled" }}
{{- .Values.redis.bundled.auth.passwordKey }}
{{- else }}
{{- .Values.redis.external.passwordKey }}
{{- end }}
{{- end }}

{{/*
The Redis URL with the password left as "$(REDIS_PASSWORD)": Kubernetes expands it from the variable
defined just before it, so the password never appears in a manifest. A password needs URL-safe characters
(the generated one is alphanumeric).
*/}}
{{- define "tessera.redis.url" -}}
{{- $auth := ternary ":$(REDIS_PASSWORD)@" "" (ne (include "tessera.redis.secretName" .) "") }}
{{- if eq .Values.redis.mode "bundled" }}
{{- printf "redis://%s%s.%s.svc:6379/0" $auth (include "tessera.componentName" (list . "redis")) .Release.Namespace }}
{{- else }}
{{- $url := urlParse (required "redis.external.url is required when redis.mode is external" .Values.redis.external.url) }}
{{- if $url.userinfo }}
{{- fail "redis.external.url must not carry credentials: put the password in the Secret named by redis.external.existingSecret" }}
{{- end }}
{{- if not (has $url.scheme (list "redis" "rediss")) }}
{{- fail (printf "redis.external.url must start with redis:// or rediss://, got %q" .Values.redis.external.url) }}
{{- end }}
{{- printf "%s://%s%s%s" $url.scheme $auth $url.host $url.path }}
{{- end }}
{{- end }}

{{/* Environment: Redis (password from its Secret only), tracing and the pod's own identity. */}}
{{- define "tessera.env" -}}
{{- if include "tessera.redis.secretName" . }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "tessera.redis.secretName" . }}
      key: {{ include "tessera.redis.passwordKey" . }}
{{- end }}
- name: TESSERA_REDIS_URL
  value: {{ include "tessera.redis.url" . | quote }}
- name: TESSERA_TRACE_EXPORTER
  value: {{ .Values.telemetry.traceExporter | quote }}
{{- if ne .Values.telemetry.traceExporter "none" }}
- name: TESSERA_OTLP_ENDPOINT
  value: {{ required "telemetry.otlpEndpoint is required when telemetry.traceExporter is otlp-grpc or otlp-http" .Values.telemetry.otlpEndpoint | quote }}
{{- end }}
- name: TESSERA_TRACE_SAMPLE_RATIO
  value: {{ .Values.telemetry.sampleRatio | quote }}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
{{- end }}

{{/* imagePullSecrets of every pod. */}}
{{- define "tessera.imagePullSecrets" -}}
{{- with .Values.imagePullSecrets -}}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* The model volume (read-only PVC) when modelStorage.existingClaim is set. */}}
{{- define "tessera.modelVolume" -}}
{{- if .Values.modelStorage.existingClaim }}
- name: models
  persistentVolumeClaim:
    claimName: {{ .Values.modelStorage.existingClaim }}
    readOnly: true
{{- end }}
{{- end }}

{{- define "tessera.modelVolumeMount" -}}
{{- if .Values.modelStorage.existingClaim }}
- name: models
  mountPath: {{ .Values.modelStorage.mountPath }}
  readOnly: true
  {{- with .Values.modelStorage.subPath }}
  subPath: {{ . }}
  {{- end }}
{{- end }}
{{- end }}

{{/*
Peers for a NetworkPolicy "from" list: the given peers, or every source when the list is empty
(an ingress rule without "from" matches all sources).
*/}}
{{- define "tessera.networkPolicyFrom" -}}
{{- with . }}
from:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}
