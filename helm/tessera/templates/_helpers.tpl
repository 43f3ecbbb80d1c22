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
{{- if has .Values.redis.mode (list "bundled" "sentinel") }}
{{- default (include "tessera.componentName" (list . "redis")) .Values.redis.bundled.auth.existingSecret }}
{{- else }}
{{- .Values.redis.external.existingSecret }}
{{- end }}
{{- end }}

{{/* Key of the Redis password inside its Secret. */}}
{{- define "tessera.redis.passwordKey" -}}
{{- if has .Values.redis.mode (list "bundled" "sentinel") }}
{{- .Values.redis.bundled.auth.passwordKey }}
{{- else }}
{{- .Values.redis.external.passwordKey }}
{{- end }}
{{- end }}

{{/* The Sentinels of redis.mode sentinel, one per data pod: host:26379,host:26379,... */}}
{{- define "tessera.redis.sentinelHosts" -}}
{{- $name := include "tessera.componentName" (list . "redis") }}
{{- $hosts := list }}
{{- range $i := until (int .Values.redis.sentinel.replicas) }}
{{- $hosts = append $hosts (printf "%s-%d.%s-headless.%s.svc:26379" $name $i $name $.Release.Namespace) }}
{{- end }}
{{- join "," $hosts }}
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
{{- else if eq .Values.redis.mode "sentinel" }}
{{- printf "redis+sentinel://%s%s/%s/0" $auth (include "tessera.redis.sentinelHosts" .) .Values.redis.sentinel.primaryName }}
{{- else }}
{{- $url := urlParse (required "redis.external.url is required when redis.mode is external" .Values.redis.external.url) }}
{{- if $url.userinfo }}
{{- fail "redis.external.url must not carry credentials: put the password in the Secret named by redis.external.existingSecret" }}
{{- end }}
{{- if not (has $url.scheme (list "redis" "rediss" "redis+sentinel")) }}
{{- fail (printf "redis.external.url must start with redis://, rediss:// or redis+sentinel://, got %q" .Values.redis.external.url) }}
{{- end }}
{{- printf "%s://%s%s%s" $url.scheme $auth $url.host $url.path }}
{{- end }}
{{- end }}

{{/*
The Redis the Ray head's GCS writes to when rayService.gcsFaultTolerance is on, as RAY_REDIS_ADDRESS takes
it: host:port, or rediss://host:port for TLS. Default: the release's Redis (the database index of
redis.external.url is dropped: the GCS always uses database 0, its keys under the cluster's namespace).
*/}}
{{- define "tessera.gcsRedisAddress" -}}
{{- $ft := .Values.rayService.gcsFaultTolerance }}
{{- if $ft.redisAddress }}
{{- $ft.redisAddress }}
{{- else if eq .Values.redis.mode "bundled" }}
{{- printf "%s.%s.svc:6379" (include "tessera.componentName" (list . "redis")) .Release.Namespace }}
{{- else if or (eq .Values.redis.mode "sentinel") (hasPrefix "redis+sentinel:" .Values.redis.external.url) }}
{{- fail "rayService.gcsFaultTolerance.redisAddress is required with a Sentinel-managed Redis: Ray's GCS takes one fixed host:port and does not follow a failover" }}
{{- else }}
{{- $url := urlParse (required "redis.external.url is required when redis.mode is external" .Values.redis.external.url) }}
{{- $host := ternary $url.host (printf "%s:6379" $url.host) (contains ":" $url.host) }}
{{- ternary (printf "rediss://%s" $host) $host (eq $url.scheme "rediss") }}
{{- end }}
{{- end }}

{{/* The Secret (name, key) of the GCS Redis password as a secretKeyRef body, or "" when it needs none. */}}
{{- define "tessera.gcsRedisPasswordRef" -}}
{{- $secret := .Values.rayService.gcsFaultTolerance.passwordSecret }}
{{- if $secret.name }}
name: {{ $secret.name }}
key: {{ required "rayService.gcsFaultTolerance.passwordSecret.key is required when its name is set" $secret.key }}
{{- else if include "tessera.redis.secretName" . }}
name: {{ include "tessera.redis.secretName" . }}
key: {{ include "tessera.redis.passwordKey" . }}
{{- end }}
{{- end }}

{{/* Name of the Secret holding the Ray auth token (key auth_token). */}}
{{- define "tessera.rayAuthSecretName" -}}
{{- default (include "tessera.componentName" (list . "ray-auth")) .Values.rayService.auth.existingSecret }}
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

{{/*
Model paths. models[].engine.model, .tokenizer and .speculative.draftModel are each a directory in the pod,
a Hugging Face hub id, or "pvc://<claim>/<path>": that PersistentVolumeClaim is mounted read-only at
<modelStorage.pvcMountRoot>/<claim> (engine workers and gateway) and the engine is given the path below it.
"tessera.modelPaths" lists them as JSON [{where, path}] for the helpers and checks below.
*/}}
{{- define "tessera.modelPaths" -}}
{{- $paths := list }}
{{- range $i, $m := .Values.models }}
{{- $where := printf "models[%d] (%s).engine" $i $m.name }}
{{- range $key := list "model" "tokenizer" }}
{{- with index $m.engine $key }}
{{- $paths = append $paths (dict "where" (printf "%s.%s" $where $key) "path" (toString .)) }}
{{- end }}
{{- end }}
{{- if kindIs "map" $m.engine.speculative }}
{{- with $m.engine.speculative.draftModel }}
{{- $paths = append $paths (dict "where" (printf "%s.speculative.draftModel" $where) "path" (toString .)) }}
{{- end }}
{{- end }}
{{- end }}
{{- toJson $paths }}
{{- end }}

{{/* The claim of a "pvc://<claim>/<path>" model path ("" when it names none). */}}
{{- define "tessera.pvcClaim" -}}
{{- first (splitList "/" (trimPrefix "pvc://" .)) }}
{{- end }}

{{/* The path the engine is given for a model path: pvc:// paths below their mount, others unchanged. Call with (list . path). */}}
{{- define "tessera.modelPath" -}}
{{- $root := index . 0 }}
{{- $path := index . 1 }}
{{- if hasPrefix "pvc://" $path }}
{{- printf "%s/%s" (trimSuffix "/" $root.Values.modelStorage.pvcMountRoot) (trimPrefix "pvc://" $path | trimSuffix "/") }}
{{- else }}
{{- $path }}
{{- end }}
{{- end }}

{{/* The claims named by pvc:// model paths, sorted, space-separated. */}}
{{- define "tessera.pvcClaims" -}}
{{- $claims := list }}
{{- range include "tessera.modelPaths" . | fromJsonArray }}
{{- if hasPrefix "pvc://" .path }}
{{- $claims = append $claims (include "tessera.pvcClaim" .path) }}
{{- end }}
{{- end }}
{{- $claims | compact | uniq | sortAlpha | join " " }}
{{- end }}

{{/* The hub ids among the model paths (neither a pod path nor a URL), sorted, space-separated. */}}
{{- define "tessera.hubModelIds" -}}
{{- $ids := list }}
{{- range include "tessera.modelPaths" . | fromJsonArray }}
{{- if not (or (hasPrefix "/" .path) (hasPrefix "." .path) (contains "://" .path)) }}
{{- $ids = append $ids .path }}
{{- end }}
{{- end }}
{{- $ids | uniq | sortAlpha | join " " }}
{{- end }}

{{/* The volume name of a pvc:// claim: "pvc-<claim>" when that is a DNS label, else a hash of the claim. */}}
{{- define "tessera.pvcVolumeName" -}}
{{- if and (le (len .) 59) (regexMatch "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$" .) }}
{{- printf "pvc-%s" . }}
{{- else }}
{{- printf "pvc-%s" (sha256sum . | trunc 16) }}
{{- end }}
{{- end }}

{{/* The model volumes (read-only PVCs): modelStorage.existingClaim and the claims of pvc:// model paths. */}}
{{- define "tessera.modelVolume" -}}
{{- if .Values.modelStorage.existingClaim }}
- name: models
  persistentVolumeClaim:
    claimName: {{ .Values.modelStorage.existingClaim }}
    readOnly: true
{{- end }}
{{- range include "tessera.pvcClaims" . | splitList " " | compact }}
- name: {{ include "tessera.pvcVolumeName" . }}
  persistentVolumeClaim:
    claimName: {{ . }}
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
{{- range include "tessera.pvcClaims" . | splitList " " | compact }}
- name: {{ include "tessera.pvcVolumeName" . }}
  mountPath: {{ printf "%s/%s" (trimSuffix "/" $.Values.modelStorage.pvcMountRoot) . }}
  readOnly: true
{{- end }}
{{- end }}

{{/* A quantity as written in a manifest or a message: numbers (Helm holds them as float64) in full. */}}
{{- define "tessera.quantityText" -}}
{{- if kindIs "float64" . }}{{ int64 . }}{{ else }}{{ toString . }}{{ end }}
{{- end }}

{{/* The Hugging Face cache of the engine workers: modelStorage.hubCache's claim, or an emptyDir. */}}
{{- define "tessera.hubCacheVolume" -}}
{{- $cache := .Values.modelStorage.hubCache -}}
- name: hf-cache
  {{- if $cache.existingClaim }}
  persistentVolumeClaim:
    claimName: {{ $cache.existingClaim }}
  {{- else if $cache.sizeLimit }}
  emptyDir:
    sizeLimit: {{ include "tessera.quantityText" $cache.sizeLimit }}
  {{- else }}
  emptyDir: {}
  {{- end }}
{{- end }}

{{/* What the engine workers' and the fetch container's model downloads need: HF_HOME and HF_TOKEN. */}}
{{- define "tessera.hubEnv" -}}
- name: HF_HOME
  value: {{ .Values.modelStorage.hubCache.mountPath | quote }}
{{- with .Values.hfTokenSecret.name }}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.hfTokenSecret.key }}
{{- end }}
{{- end }}

{{/* The environment the chart sets on an engine worker container (extra env is appended after it). */}}
{{- define "tessera.engineWorkerEnv" -}}
{{ include "tessera.env" . | trim }}
# The address a replica registers in Redis for the gateway to call it at.
- name: TESSERA_ADVERTISE_HOST
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
# The port ranges the NetworkPolicy opens on this pod: replica HTTP endpoints to the
# gateway, KV events to the controller ("start-end", inclusive).
- name: TESSERA_ENGINE_PORT_RANGE
  value: "{{ .Values.rayService.engineWorkers.replicaPorts.start }}-{{ .Values.rayService.engineWorkers.replicaPorts.end }}"
- name: TESSERA_KV_EVENTS_PORT_RANGE
  value: "{{ .Values.kvcontrol.kvEventsPorts.start }}-{{ .Values.kvcontrol.kvEventsPorts.end }}"
{{ include "tessera.dataPlaneEnv" (list . true) }}
{{ include "tessera.hubEnv" . }}
{{- end }}

{{/* The chart's volumes and mounts of the engine workers and of the Ray head (extra ones are appended). */}}
{{- define "tessera.engineWorkerVolumes" -}}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ include "tessera.quantityText" .Values.rayService.engineWorkers.shmSizeLimit }}
- name: ray-logs
  emptyDir: {}
{{ include "tessera.dataPlaneVolume" (list . true) }}
{{ include "tessera.hubCacheVolume" . }}
{{- include "tessera.modelVolume" . }}
{{- end }}

{{- define "tessera.engineWorkerMounts" -}}
- name: dshm
  mountPath: /dev/shm
- name: ray-logs
  mountPath: /tmp/ray
{{ include "tessera.dataPlaneMount" . }}
- name: hf-cache
  mountPath: {{ .Values.modelStorage.hubCache.mountPath }}
{{- include "tessera.modelVolumeMount" . }}
{{- end }}

{{- define "tessera.rayHeadVolumes" -}}
- name: ray-logs
  emptyDir: {}
{{ include "tessera.dataPlaneVolume" (list . true) }}
{{- end }}

{{- define "tessera.rayHeadMounts" -}}
- name: ray-logs
  mountPath: /tmp/ray
{{ include "tessera.dataPlaneMount" . }}
{{- end }}

{{/*
The init container that fetches the models into the hub cache (modelStorage.fetch). Restricted like every
container; by default it downloads each hub id of `models` with huggingface_hub.snapshot_download.
*/}}
{{- define "tessera.modelFetchContainer" -}}
{{- $fetch := .Values.modelStorage.fetch -}}
- name: fetch-models
  {{- if $fetch.image.repository }}
  image: {{ include "tessera.image" (list . $fetch.image) }}
  imagePullPolicy: {{ $fetch.image.pullPolicy }}
  {{- else }}
  image: {{ include "tessera.image" (list . .Values.image) }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  {{- end }}
  {{- if $fetch.command }}
  command:
    {{- toYaml $fetch.command | nindent 4 }}
  {{- else }}
  command:
    - python3
    - -c
    - |
      import sys
      from huggingface_hub import snapshot_download
      for repo_id in sys.argv[1:]:
          print(f"fetching {repo_id}", flush=True)
          print(snapshot_download(repo_id=repo_id), flush=True)
    {{- range include "tessera.hubModelIds" . | splitList " " | compact }}
    - {{ . | quote }}
    {{- end }}
  {{- end }}
  securityContext:
    {{- include "tessera.containerSecurityContext" (list . false) | nindent 4 }}
  env:
    {{- include "tessera.hubEnv" . | nindent 4 }}
    {{- with $fetch.env }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  resources:
    {{- toYaml $fetch.resources | nindent 4 }}
  volumeMounts:
    - name: hf-cache
      mountPath: {{ .Values.modelStorage.hubCache.mountPath }}
    {{- with .Values.rayService.engineWorkers.extraVolumeMounts }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end }}

{{/*
The engine workers' startup probe. An engine replica's model loads inside a Ray actor that Ray Serve places
on some worker pod after the pod's raylet has joined the cluster, and it serves on a port picked from a
range, so no fixed port or file of the pod says "loaded". Ray Serve does know: a replica is STARTING until
its constructor (EngineHost.start: vLLM load, KV profiling, warm-up, endpoint listening) has returned. The
probe passes once the local raylet is healthy and the head's Serve API lists no replica on this pod's IP
that is still starting. A pod that hosts no replica passes as soon as its raylet is up.
Arguments: the local dashboard agent's URL and the head dashboard's port (a test runs the script against
a stand-in server); the head's address comes from FQ_RAY_IP, which KubeRay sets on every worker.
*/}}
{{- define "tessera.engineStartupProbe" -}}
{{- $probe := .Values.rayService.engineWorkers.startupProbe -}}
exec:
  command:
    - python3
    - -c
    - |
      import json, os, sys, urllib.request
      # With Ray token auth (rayService.auth) KubeRay puts the token in this container's RAY_AUTH_TOKEN.
      token = os.environ.get("RAY_AUTH_TOKEN")
      headers = {"Authorization": f"Bearer {token}"} if token else {}
      def get(url):
          with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=4) as response:
              return response.read()
      agent, dashboard_port = sys.argv[1], sys.argv[2]
      try:
          if b"success" not in get(f"{agent}/api/local_raylet_healthz"):
              sys.exit("the raylet is not healthy yet")
          head = os.environ.get("FQ_RAY_IP") or os.environ["RAY_IP"]
          status = json.loads(get(f"http://{head}:{dashboard_port}/api/serve/applications/"))
      except Exception as exc:
          sys.exit(f"cannot tell yet: {exc}")
      here = os.environ["TESSERA_ADVERTISE_HOST"]
      loading = sorted(
          f"{app_name}/{replica.get('replica_id')}"
          for app_name, app in (status.get("applications") or {}).items()
          for deployment in (app.get("deployments") or {}).values()
          for replica in deployment.get("replicas") or []
          if replica.get("node_ip") == here and replica.get("state") in ("STARTING", "UPDATING", "RECOVERING")
      )
      if loading:
          sys.exit("engine replicas still starting on this pod: " + ", ".join(loading))
    - http://localhost:52365
    - "8265"
initialDelaySeconds: {{ $probe.initialDelaySeconds }}
periodSeconds: {{ $probe.periodSeconds }}
timeoutSeconds: {{ $probe.timeoutSeconds }}
failureThreshold: {{ $probe.failureThreshold }}
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

{{/* The NetworkPolicy peer of the KubeRay operator: every pod of its namespace. */}}
{{- define "tessera.kubeRayOperatorPeer" -}}
- namespaceSelector:
    matchLabels:
      kubernetes.io/metadata.name: {{ required "networkPolicy.kubeRayOperatorNamespace is required when networkPolicy.enabled" .Values.networkPolicy.kubeRayOperatorNamespace }}
{{- end }}

{{/* The Secret holding the data-plane key and the replicas' scrape token (secrets.yaml, or dataPlane.existingSecret). */}}
{{- define "tessera.dataPlaneSecretName" -}}
{{- default (include "tessera.componentName" (list . "data-plane")) .Values.dataPlane.existingSecret }}
{{- end }}

{{/*
The data-plane credentials as files (docs/security.md "The data plane"). Argument: (list $ withScrapeToken).
Engine pods get the key and the scrape token; the gateway and the KV controller, which only call replicas,
the key alone. The operator and Redis get neither.
*/}}
{{- define "tessera.dataPlaneVolume" -}}
{{- $ := index . 0 }}
- name: data-plane
  secret:
    secretName: {{ include "tessera.dataPlaneSecretName" $ }}
    defaultMode: 0440
    items:
      - key: {{ $.Values.dataPlane.keyKey }}
        path: data-plane.key
      {{- if index . 1 }}
      - key: {{ $.Values.dataPlane.metricsTokenKey }}
        path: metrics-token
      {{- end }}
{{- end }}

{{- define "tessera.dataPlaneMount" -}}
- name: data-plane
  mountPath: /etc/tessera/data-plane
  readOnly: true
{{- end }}

{{- define "tessera.dataPlaneEnv" -}}
- name: TESSERA_DATA_PLANE_KEY_FILE
  value: /etc/tessera/data-plane/data-plane.key
{{- if index . 1 }}
- name: TESSERA_METRICS_TOKEN_FILE
  value: /etc/tessera/data-plane/metrics-token
{{- end }}
{{- end }}
